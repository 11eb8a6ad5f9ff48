"""The OpenAI front on local:// (the tiny offline Llama with a BPE tokenizer and a chat template, CPU).

Tolerance: captured sample log-probs equal ``compute_logprobs`` on the captured tokens within 1e-4 (both are
fp32 on CPU; they differ only by batching and kernel order)."""

from __future__ import annotations

import os
from urllib.parse import quote

import pytest

from asyncsess import ServiceClient
from asyncsess.chat import chat_tokens
from asyncsess.rl.capture import build_trajectory
from asyncsess.serve.openai_front import OpenAIFront

from .helpers import ScriptedSampler

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.local, pytest.mark.anyio]
TOLERANCE = 1e-4
HI = [{"role": "user", "content": "what is two plus three?"}]


@pytest.fixture
async def sampler(tmp_path):
    from asyncsess_local.testing import tiny_llama_dir

    tiny = str(tiny_llama_dir())
    async with ServiceClient(f"local://?model={quote(tiny)}&device=cpu&dir={quote(str(tmp_path))}") as svc:
        yield await svc.create_sampling_client(base_model=tiny)


async def test_local_captures_match_compute_logprobs_and_stream_equals_plain(sampler):
    front = OpenAIFront(sampler)
    kwargs = dict(model="policy", messages=HI, n=2, seed=11, max_tokens=16, logprobs=True)
    async with front.openai_client("plain") as client:
        plain = await client.chat.completions.create(**kwargs)
    async with front.openai_client("streamed") as client:
        chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
    [a], [b] = front.captures.calls("plain"), front.captures.calls("streamed")
    assert a.prompt_tokens == chat_tokens(sampler.get_tokenizer(), HI, add_generation_prompt=True)
    for choice in a.choices:
        scored = await sampler.compute_logprobs(a.prompt_tokens + choice.tokens)
        assert choice.logprobs == pytest.approx(scored[len(a.prompt_tokens) :], abs=TOLERANCE)
    assert [c.tokens for c in a.choices] == [c.tokens for c in b.choices]  # same seed, same tokens
    for x, y in zip(a.choices, b.choices):
        assert x.logprobs == pytest.approx(y.logprobs, abs=TOLERANCE) and x.text == y.text
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == 0)
    assert text == plain.choices[0].message.content


async def test_local_multi_turn_trains_only_sampled_tokens(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client("m") as client:
        messages = list(HI)
        for turn in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=10, seed=turn)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "and then?"}]
    calls = front.captures.calls("m")
    traj = build_trajectory("m", calls, 1.0)
    segments = traj.segments()
    assert len(segments) == 1 + len(traj.drift)
    trained = [t for s in segments for t, m in zip(s["tokens"], s["mask"]) if m]
    assert trained == [t for c in calls for t in c.choices[0].tokens]


async def test_http_backend_captures_match_compute_logprobs(tmp_path):
    """The same front over http:// (a running worker in a thread): the backend does not matter to it."""
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread
    from asyncsess_local.testing import tiny_llama_dir

    tiny = str(tiny_llama_dir())
    worker = serve_in_thread(LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path)), ["k"])
    try:
        async with ServiceClient(worker.url, api_key="k") as svc:
            sampler = await svc.create_sampling_client(base_model=tiny)
            front = OpenAIFront(sampler)
            async with front.openai_client("h") as client:
                messages = list(HI)
                for seed in (1, 2):
                    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=seed)
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "so?"}]
            calls = front.captures.calls("h")
            for call in calls:
                scored = await sampler.compute_logprobs(call.prompt_tokens + call.choices[0].tokens)
                assert call.choices[0].logprobs == pytest.approx(scored[len(call.prompt_tokens) :], abs=TOLERANCE)
            traj = build_trajectory("h", calls, 1.0)
            trained = [t for s in traj.segments() for t, m in zip(s["tokens"], s["mask"]) if m]
            assert trained == [t for c in calls for t in c.choices[0].tokens]
    finally:
        worker.stop()


async def test_logprob_bytes_join_into_the_reply_where_tokens_split_characters(sampler):
    """OpenAI's ``bytes`` exist to put back together characters split over tokens. A byte-level BPE token that
    holds part of a character decodes alone to U+FFFD, and its ``bytes`` were those of U+FFFD (EF BF BD): joined,
    the bytes of '日本 🙂' were replacement characters. They are now the token's own bytes, plain and streamed."""
    reply = "日本 🙂 ok"
    front = OpenAIFront(ScriptedSampler(sampler, [reply, reply]))
    async with front.openai_client("b") as client:
        plain = await client.chat.completions.create(model="policy", messages=HI, logprobs=True)
        chunks = [c async for c in await client.chat.completions.create(model="policy", messages=HI, logprobs=True, stream=True)]
    entries = plain.choices[0].logprobs.content
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert plain.choices[0].message.content == reply and any(e.token == "\ufffd" for e in entries)  # characters are split
    for got in (entries, streamed):
        joined = bytes(b for e in got for b in e.bytes)
        assert joined.decode() == reply  # the content exactly: not the turn's end token (the capture keeps it)


async def test_completion_text_offsets_are_where_each_token_starts_in_the_text(sampler):
    """Legacy ``text_offset`` counted one character per token piece, and a token holding part of a character is
    one U+FFFD: past '日' every offset was off. A streamed chunk's offset was always 0."""
    reply = "日本 🙂 ok"
    front = OpenAIFront(ScriptedSampler(sampler, [reply, reply]))
    async with front.openai_client("o") as client:
        plain = await client.completions.create(model="policy", prompt="x", logprobs=0)
        chunks = [c async for c in await client.completions.create(model="policy", prompt="x", logprobs=0, stream=True)]
    tokens = front.captures.calls("o")[0].choices[0].tokens
    tok = sampler.get_tokenizer()
    assert tokens[-1] == tok.eos_token_id  # captured; the served log-probs stop before it
    expected = [len(tok.decode(tokens[:i], skip_special_tokens=True).rstrip("\ufffd")) for i in range(len(tokens) - 1)]
    assert plain.choices[0].text == reply and expected[3] == 1  # the three tokens of '日' start at 0, '本' at 1
    assert plain.choices[0].logprobs.text_offset == expected
    assert [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == expected


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calc"}}])
async def test_a_forced_tool_call_renders_back_to_the_same_bpe_tokens(sampler, choice):
    """``tool_choice`` forces the reply's opening into the prompt, tokenized as the template renders that turn in
    context: the reply sent back (opening and sampled text, rendered as one string by a byte-level BPE) extends the
    captured prompt and reply token for token, so only the sampled tokens are trained."""
    from .helpers import CALC

    rest = ' {"expr": "2+3"}}</tool_call>' if isinstance(choice, dict) else 'calc", "arguments": {"expr": "2+3"}}</tool_call>'
    front = OpenAIFront(ScriptedSampler(sampler, [rest, "It is 5."]))
    async with front.openai_client("t") as client:
        first = await client.chat.completions.create(model="policy", messages=HI, tools=[CALC], tool_choice=choice)
        [call] = first.choices[0].message.tool_calls
        answer = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        await client.chat.completions.create(model="policy", messages=[*HI, first.choices[0].message, answer], tools=[CALC])
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calc"
    calls = front.captures.calls("t")
    traj = build_trajectory("t", calls, 1.0)
    assert traj.drift == []
    trained = [t for s in traj.segments() for t, m in zip(s["tokens"], s["mask"]) if m]
    assert trained == [t for c in calls for t in c.choices[0].tokens]
