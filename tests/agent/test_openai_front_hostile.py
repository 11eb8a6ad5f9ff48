"""Round two of hostile callers of the OpenAI front: clients that hang up or time out while their call samples, tool
names OpenAI refuses, budgets that disagree, and prompts the sampler refuses, named as the caller sent them."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any, ClassVar

import anyio
import httpx
import openai
import pytest

from asyncsess import ServiceClient
from asyncsess.serve.capture import CapturedCall, CapturedChoice
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess.serve.openai_wire import MAX_TEXT_CHARS
from asyncsess.types import SampledSequence, SampleResponse

from .helpers import post_scope

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "Say hi."}]
HOLD_MS = 30_000  # a sample that holds its pool slot this long (the fix frees it at once)


@pytest.fixture
async def held():
    """A sampler whose every sample holds its pool slot for HOLD_MS."""
    async with ServiceClient(f"mock://?latency_ms={HOLD_MS}") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


def _scope(path: str) -> dict:
    return post_scope(path, [(b"x-rollout-id", b"gone")])


class _Unscored:
    """A sampler whose samples come back at once without log-probs: the front scores them with compute_logprobs."""

    def __init__(self, real) -> None:
        self.real, self.sampler_id, self.base_model = real, real.sampler_id, real.base_model

    def __getattr__(self, name):
        return getattr(self.real, name)

    def sample(self, prompt, num_samples=1, sampling_params=None, **kwargs):
        async def unscored() -> SampleResponse:
            return SampleResponse(sequences=[SampledSequence(stop_reason="length", tokens=[5, 6])] * num_samples)

        return unscored()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scored", [False, True], ids=["sampling", "scoring"])
async def test_a_client_that_hangs_up_while_its_call_samples_frees_the_slot_at_once(held, stream, scored):
    """The server sampled on for a client that was gone, holding a pool slot (and a worker's per-key in-flight
    count) to the end of the reply, then answered no one; other agents queued behind it. The hang-up now withdraws
    the sample (or the scoring of a sample that came without log-probs): the slot is free when the handler returns,
    nothing is captured, no call index is used."""
    front = OpenAIFront(_Unscored(held) if scored else held)
    app = front.app()
    body = {"model": "policy", "messages": HI, "max_tokens": 4, "stream": stream}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        while front.stats()["in_flight"] == 0:  # hang up once the call holds its slot (it holds it for HOLD_MS)
            await anyio.sleep(0)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(_scope("/v1/chat/completions"), receive, send)
    s = front.stats()
    assert s["in_flight"] == 0 and s["peak_in_flight"] == 1 and front.counts["sampled_tokens"] == 0, (s, front.counts)
    assert sent[0]["status"] == 499 and front.captures.calls("gone") == []
    front.captures.reserve("gone")  # the next call of the rollout is its first
    assert front.captures.release("gone", 0)


async def test_an_in_process_client_that_times_out_leaves_no_slot_held(held):
    """The in-process transport cancels a call at the client's read timeout; the sample went on in the background
    holding its pool slot, so an agent that timed out and retried held two."""
    front = OpenAIFront(held)
    async with front.openai_client("t", timeout=0.5, max_retries=1) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="policy", messages=HI, max_tokens=4)
    s = front.stats()
    assert s["in_flight"] == 0 and front.counts["sampled_tokens"] == 0 and front.captures.calls("t") == [], s


class _HeldOnce(_Unscored):
    """A sampler whose first sample waits for ``gate`` (``entered`` is set once it waits); later ones do not."""

    def __init__(self, real) -> None:
        super().__init__(real)
        self.entered, self.gate = anyio.Event(), anyio.Event()

    def sample(self, prompt, num_samples=1, sampling_params=None, **kwargs):
        pending = self.real.sample(prompt, num_samples, sampling_params, **kwargs)
        if self.entered.is_set():
            return pending

        async def held() -> SampleResponse:
            self.entered.set()
            await self.gate.wait()
            return await pending

        return held()


async def test_a_call_still_sampling_when_its_rollout_is_taken_is_late_and_not_captured(sampler):
    """A trainer that took a rollout (DELETE of its captures) while one of its calls still sampled found that call
    captured afterwards under the taken id, alone, as if it were a new rollout's first call."""
    held = _HeldOnce(sampler)
    front = OpenAIFront(held)
    replies: list[str | None] = []
    async with front.openai_client("r") as client:

        async def call() -> None:
            reply = await client.chat.completions.create(model="policy", messages=HI, max_tokens=4, seed=1)
            replies.append(reply.choices[0].message.content)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await held.entered.wait()
            assert front.captures.pop("r") == []  # the trainer takes the rollout while the call samples
            held.gate.set()
        assert len(replies) == 1  # the agent still gets its reply
        assert front.captures.calls("r") == [] and front.stats()["late_calls"] == 1
        await call()  # the rollout id, used again once nothing of it is left, starts again at call 0
        assert [c.call_index for c in front.captures.calls("r")] == [0] and front.stats()["late_calls"] == 1


@pytest.fixture
async def sampler():
    async with ServiceClient("mock://") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


HOSTILE = [
    # OpenAI's function-name rule ^[a-zA-Z0-9_-]{1,64}$: a 10 MB name was tokenized into the prompt
    ({"tools": [_tool("a b")]}, "tools.0.function.name"),
    ({"tools": [_tool("f" * 65)]}, "tools.0.function.name"),
    ({"tools": [_tool("f" * 10_000_000)]}, "tools.0.function.name"),
    ({"tools": [_tool("<tool_call>")]}, "tools.0.function.name"),
    ({"tools": [_tool(f"f{i}") for i in range(10_000)]}, "tools"),
    ({"tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the legacy form
    ({"extra_body": {"guided_json": {}}}, "guided_json"),  # what the official client merges into the body
    ({"messages": [*HI, {"role": "tool", "tool_call_id": "nothing", "content": "4"}]}, "messages.1.role"),
    # both budgets: max_tokens was silently ignored
    ({"max_tokens": 5, "max_completion_tokens": 3}, "max_tokens"),
    # a prompt the sampler refuses (mock's context is 512) was named 'prompt', which chat requests lack
    ({"tools": [_tool("f", {"type": "string", "enum": [str(i) for i in range(2000)]})]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}]}, "messages"),
]


@pytest.mark.parametrize(("change", "param"), HOSTILE, ids=[f"{next(iter(c))}-{p}-{i}" for i, (c, p) in enumerate(HOSTILE)])
async def test_hostile_requests_are_a_400_naming_the_param_for_the_official_client(sampler, change, param):
    front = OpenAIFront(sampler)
    async with front.openai_client("h") as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**{"model": "policy", "messages": HI, **change})
        assert err.value.param == param, err.value.body
        ok = await client.chat.completions.create(model="policy", messages=HI, max_tokens=3, max_completion_tokens=3)
    assert [c.call_index for c in front.captures.calls("h")] == [0] and ok.usage.completion_tokens <= 3


async def test_a_prompt_the_sampler_refuses_is_still_named_prompt_by_completions(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="policy", prompt="x" * 600, max_tokens=2)
    assert err.value.param == "prompt"


CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
NO_CONTENT = [  # each was a 200 that sampled from an empty turn
    ([{"role": "user"}], "messages.0.content", "missing_required_parameter"),
    ([{"role": "user", "content": None}], "messages.0.content", "invalid_value"),
    ([{"role": "user", "content": []}], "messages.0.content", "empty_array"),
    ([{"role": "system", "content": None}, *HI], "messages.0.content", "invalid_value"),
    ([{"role": "developer"}, *HI], "messages.0.content", "missing_required_parameter"),
    ([*HI, {"role": "assistant"}, *HI], "messages.1.content", "invalid_value"),
    ([*HI, {"role": "assistant", "content": "", "tool_calls": []}, *HI], "messages.1.tool_calls", "empty_array"),
    ([*HI, CALL, {"role": "tool", "tool_call_id": "c1"}], "messages.2.content", "missing_required_parameter"),
    ([*HI, CALL, {"role": "tool", "tool_call_id": "c1", "content": None}], "messages.2.content", "invalid_value"),
]
SERVED = [  # what OpenAI serves: empty text, and an assistant message that is only tool calls
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": [{"type": "text", "text": ""}]}, *HI],
    [*HI, CALL, {"role": "tool", "tool_call_id": "c1", "content": ""}],
    [*HI, {**CALL, "content": None}, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "4"}]}],
]


async def test_a_message_without_content_is_a_400_naming_it_as_openai_answers(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client("h") as client:
        for messages, param, code in NO_CONTENT:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            assert (err.value.param, err.value.code) == (param, code), (messages, err.value.body)
        for messages in SERVED:
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length"), messages
    assert len(front.captures.calls("h")) == len(SERVED)  # the refused ones were never sampled


class _Counted:
    """A tokenizer that counts the calls that tokenize text (``calls``) and those that decode tokens (``decodes``)."""

    def __init__(self, real) -> None:
        self.real, self.calls, self.decodes = real, 0, 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.real.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __len__(self) -> int:
        return len(self.real)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.real.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.real.apply_chat_template(*args, **kwargs)


class _CountingSampler:
    def __init__(self, real) -> None:
        self.real, self.tok = real, _Counted(real.get_tokenizer())
        self.sampler_id, self.base_model = real.sampler_id, real.base_model

    def __getattr__(self, name):
        return getattr(self.real, name)

    def get_tokenizer(self):
        return self.tok


ARGS = json.dumps({"x": "a" * 900_000})
CALLS = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(1000)]
TOO_LONG = [
    ("chat", {"messages": [{"role": "user", "content": "a" * 1_000_000}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "a" * 100_000}] * 40}, "messages"),
    ("chat", {"tools": [_tool("f", {"type": "string", "enum": [str(i) for i in range(100_000)]})]}, "messages"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 1_000_000}}]}, "messages"),
    ("completions", {"prompt": "a" * 1_000_000}, "prompt"),
    # an assistant turn's text and tool calls were not counted: 256 MB of them were tokenized on the event loop
    ("chat", {"messages": [*HI, {"role": "assistant", "content": "a" * 1_000_000}, {"role": "user", "content": "go"}]}, "messages"),
    ("chat", {"messages": [*HI, {"role": "assistant", "content": [{"type": "text", "text": "a" * 500_000}] * 2}, *HI]}, "messages"),
    (
        "chat",
        {
            "messages": [
                *HI,
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": "c", "content": "4"},
            ]
        },
        "messages",
    ),
    # 3 characters of name and arguments a call were counted, of the 50 the front writes per call (175,000 calls fit)
    (
        "chat",
        {
            "messages": [
                *HI,
                {"role": "assistant", "tool_calls": CALLS},
                *({"role": "tool", "tool_call_id": c["id"], "content": "4"} for c in CALLS),
            ]
        },
        "messages",
    ),
]


@pytest.mark.parametrize(("route", "change", "param"), TOO_LONG, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(TOO_LONG)])
async def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(sampler, route, change, param):
    """A few MB of text (a worker takes 256 MB bodies) were tokenized before the context check refused them: seconds
    on the event loop that serves every tenant's calls. A token spells at most as many characters as the
    vocabulary's longest entry, so such text is refused untokenized."""
    counting = _CountingSampler(sampler)
    front = OpenAIFront(counting, context_window=64)
    async with front.openai_client() as client:
        await client.chat.completions.create(model="policy", messages=HI, max_tokens=2)  # (renders the template once)
        counting.tok.calls = 0
        with pytest.raises(openai.BadRequestError) as err:
            if route == "chat":
                await client.chat.completions.create(**{"model": "policy", "messages": HI, "max_tokens": 2, **change})
            else:
                await client.completions.create(**{"model": "policy", "max_tokens": 2, **change})
        assert err.value.param == param and "context" in err.value.message, err.value.body
        assert counting.tok.calls == 0
        ok = await client.chat.completions.create(model="policy", messages=HI, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_a_prompt_of_more_ids_than_any_context_is_refused_by_its_length_first(sampler):
    """A completions prompt of token ids had no cap: a 256 MB body's 85 M ids were validated one by one holding the
    GIL (about 20 s of every tenant's event loop), then scanned against the vocabulary on the loop, before the context
    check refused them. Now the count is checked first: past MAX_TEXT_CHARS at validation, past the context before the
    scan (the ids here are all outside the vocabulary, which the scan would have named)."""
    front = OpenAIFront(sampler, context_window=64)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as client:  # (openai's own encoding is slow)
        for ids, says in (([-1] * (MAX_TEXT_CHARS + 1), "more than any context holds"), ([-1] * 100, "the prompt has 100 tokens")):
            r = await client.post("/v1/completions", json={"model": "policy", "prompt": ids, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and says in r.json()["error"]["message"], r.text


async def test_distinct_tool_sets_do_not_grow_the_servers_memory(sampler):
    """The renderer remembered, for every distinct tool set it was sent, whether the template shows tools, keyed
    by the tool set's whole JSON: a client that varies a description (a nonce, a timestamp) grew the server's
    memory by each set's size, for good. (The calls here are refused by mock's 512-token context after rendering,
    so no capture holds them either.)"""
    import gc
    import tracemalloc

    front = OpenAIFront(sampler)

    async def calls(client, first: int, n: int) -> None:
        for i in range(first, first + n):
            tool = {"type": "function", "function": {"name": "f", "description": f"{i} " + "d" * 20_000}}
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="policy", messages=HI, max_tokens=2, tools=[tool])

    async with front.openai_client() as client:
        await calls(client, 0, 20)  # (warm caches up)
        tracemalloc.start()
        try:
            gc.collect()  # (refused calls leave tracebacks in reference cycles)
            before = tracemalloc.get_traced_memory()[0]
            await calls(client, 20, 200)  # 4 MB of descriptions
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert grown < 1_000_000, grown


async def test_schemas_with_ref_cycles_and_parallel_tool_calls_are_served(sampler):
    """A ``$ref`` cycle is JSON like any other (the front never resolves it) and ``parallel_tool_calls=true`` is
    what the front does anyway."""
    cyclic = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a", "type": "object"}
    front = OpenAIFront(sampler)
    async with front.openai_client() as client:
        r = await client.chat.completions.create(
            model="policy", messages=HI, max_tokens=2, tools=[_tool("f", cyclic)], parallel_tool_calls=True
        )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_log_prob_entries_decode_each_token_once_and_long_choices_let_other_calls_run(sampler, route, stream):
    """Every log-prob entry and each of its 20 alternatives decoded its token afresh, twice (text and bytes), all on the
    event loop: one call with n=64 × 2,000 tokens held every other tenant's calls for 45 s (55 s streamed). Entries
    now decode each token id once per reply, a long reply's JSON is made in a worker thread, and the loop runs other
    calls between choices and every few stream chunks."""
    counting = _CountingSampler(sampler)
    front = OpenAIFront(counting)
    ticks, seen = 0, []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    chat_choice = front._chat_choice
    front._chat_choice = lambda *a, **k: seen.append(ticks) or chat_choice(*a, **k)  # type: ignore[method-assign]
    kwargs = {"model": "policy", "n": 8, "max_tokens": 40, "seed": 3, "temperature": 2.0, "stream": stream}
    async with front.openai_client("r") as client, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await client.chat.completions.create(model="policy", messages=HI, max_tokens=2)  # (renders the template once)
        counting.tok.decodes, ticks = 0, 0
        if route == "chat":
            reply = await client.chat.completions.create(**kwargs, messages=HI, logprobs=True, top_logprobs=20)
        else:
            reply = await client.completions.create(**kwargs, prompt="Q: 2+2=", logprobs=20)
        if stream:
            [c async for c in reply]
        tg.cancel_scope.cancel()
    entries = sum(len(c.tokens) for c in front.captures.calls("r")[-1].choices)
    assert entries > 100 and counting.tok.decodes < entries * 10  # (was over entries * 42: 2 per entry and alternative)
    if route == "chat":
        assert len(seen) == 9 and seen[-1] - seen[1] >= 4  # the loop ran other tasks between the choices (trio: most)


class _Rendered(CapturedCall):
    """A captured call that notes the threads it is rendered on."""

    threads: ClassVar[set[int]] = set()

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        self.threads.add(threading.get_ident())
        return super().model_dump(**kwargs)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_large_rollout_is_rendered_off_the_event_loop_a_call_at_a_time(sampler, method):
    """A key's 4,000,000 captured tokens were rendered in one ``json.dumps`` on the event loop (36 MB, 0.75 s of every
    tenant's calls on each read of the rollout); they are now made in a worker thread, one call per ``json.dumps``."""
    front = OpenAIFront(sampler)
    choice = CapturedChoice(index=0, tokens=list(range(500)), logprobs=[-1.0] * 500, finish_reason="length")
    common = dict(rollout_id="r", endpoint="completions", model="policy", sampler_id="s", weight_version=0, usage={})
    calls = [_Rendered(call_index=i, prompt_tokens=list(range(2000)), choices=[choice], **common) for i in range(20)]
    for call in calls:
        front.captures.add(call)
    _Rendered.threads.clear()
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        r = await http.request(method, "/v1/asyncsess/rollouts/r")
    rendered_on = set(_Rendered.threads)
    assert rendered_on and threading.get_ident() not in rendered_on
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:200]
    assert r.json() == {"rollout_id": "r", "calls": [c.model_dump(mode="json") for c in calls]}
    assert (front.captures.calls("r") == []) == (method == "DELETE")


@pytest.mark.parametrize(
    ("door", "path"), [(False, "/v1/chat/completions"), (True, "/v1/chat/completions"), (True, "/api/v1/create_session")]
)
async def test_a_client_that_hangs_up_while_its_body_arrives_is_no_server_error(sampler, door, path):
    """A client that closed its connection with half its body sent was an "Exception in ASGI application" (a 500 and a
    traceback in the log, once per such connection, on every route of ``asyncsess serve`` and of the worker). The front
    answers 499 (to no one), as to a client that hangs up while its call samples; the servers' body limit, nothing."""
    if door:
        from asyncsess.backends import load_backend
        from asyncsess.serve.tinker_api import create_app

        app = create_app(load_backend("mock://"), {"k"}, poll_timeout=5.0)
        headers = [(b"x-api-key", b"k")]
    else:
        app, headers = OpenAIFront(sampler).app(), []
    messages = [{"type": "http.request", "body": b'{"model": "pol', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    async with contextlib.AsyncExitStack() as stack:
        if door:
            await stack.enter_async_context(app.router.lifespan_context(app))
        await app(post_scope(path, headers), receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == ([] if door else [499])


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_long_prompt_is_tokenized_off_the_event_loop(sampler, route, monkeypatch):
    """A chat's messages and a completion's prompt were tokenized on the event loop every tenant's calls wait on: with a
    context that takes 1,000,000 characters (32k tokens) one call held it 0.7 s. Past 64 KB they are tokenized in a
    worker thread (a tokenizer hands the GIL back as it works); a short one still on the loop (no thread hop)."""
    from asyncsess.serve import openai_front

    front, threads = OpenAIFront(sampler), []
    renderer = front._renderer(sampler)
    tokens, encode = renderer.tokens, getattr(openai_front, "_tokens", None)
    monkeypatch.setattr(renderer, "tokens", lambda *a, **k: threads.append(threading.get_ident()) or tokens(*a, **k))
    monkeypatch.setattr(openai_front, "_tokens", lambda *a: threads.append(threading.get_ident()) or encode(*a), raising=False)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        for text in ("Say hi.", "hi " * 30_000):
            if route == "chat":
                body = {"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
                r = await http.post("/v1/chat/completions", json=body)
            else:
                r = await http.post("/v1/completions", json={"model": "policy", "prompt": text, "max_tokens": 2})
            assert r.status_code in (200, 400), r.text  # (the long one may be past the mock's context)
    assert len(threads) == 2 and threads[0] == threading.get_ident() != threads[1]
