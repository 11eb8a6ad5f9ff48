"""The OpenAI front on mock:// through the official openai client: exact captures, streaming, bad requests."""

from __future__ import annotations

import json
import math
from random import Random

import anyio
import httpx
import openai
import pytest

from asyncsess import SamplingParams, ServiceClient
from asyncsess.errors import RateLimitError, RetriesExhaustedError
from asyncsess.serve.capture import CapturedCall
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess.serve.openai_wire import content_pieces
from asyncsess_mock import CharTokenizer

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
async def sampler():
    async with ServiceClient("mock://?latency_ms=1", max_samples_in_flight=8) as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


async def test_captured_logprobs_equal_compute_logprobs(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client("r") as client:
        reply = await client.chat.completions.create(model="policy", messages=HI, n=3, seed=7, max_tokens=24, logprobs=True)
    [call] = front.captures.calls("r")
    assert call.weight_version == 0 and call.sampler_id == sampler.sampler_id and len(call.choices) == 3
    assert call.usage == {
        "prompt_tokens": len(call.prompt_tokens),
        "completion_tokens": sum(len(c.tokens) for c in call.choices),
        "total_tokens": len(call.prompt_tokens) + sum(len(c.tokens) for c in call.choices),
    }
    assert reply.usage.prompt_tokens == len(call.prompt_tokens)
    assert call.prompt_tokens == sampler.get_tokenizer().apply_chat_template(HI, add_generation_prompt=True)
    for choice, served in zip(call.choices, reply.choices):
        scored = await sampler.compute_logprobs(call.prompt_tokens + choice.tokens)
        assert choice.logprobs == scored[len(call.prompt_tokens) :]  # exact on mock
        shown = len(choice.tokens) - (choice.finish_reason == "stop")  # the end token is captured, not served
        assert [e.logprob for e in served.logprobs.content] == choice.logprobs[:shown]
        assert served.finish_reason == choice.finish_reason


async def test_top_logprobs_relay_the_samplers_top_k(sampler):
    """``top_logprobs=k`` serves exactly what ``sample(..., topk_sample_logprobs=k)`` gives for the same seeded call
    (that those are the k largest of the full softmax is tested in tests/compat)."""
    front = OpenAIFront(sampler)
    async with front.openai_client("r") as client:
        reply = await client.chat.completions.create(model="policy", messages=HI, seed=11, max_tokens=12, logprobs=True, top_logprobs=5)
    [call] = front.captures.calls("r")
    params = SamplingParams(max_tokens=12, seed=11, temperature=1.0)
    direct = (await sampler.sample(call.prompt_tokens, 1, params, topk_sample_logprobs=5)).sequences[0]
    n = len(call.choices[0].tokens)  # the front also stops at the end of the turn
    assert direct.tokens[:n] == call.choices[0].tokens and direct.topk_logprobs is not None
    served = reply.choices[0].logprobs.content
    assert len(served) == n - (call.choices[0].finish_reason == "stop") > 0  # not the end-of-turn token
    for entry, top in zip(served, direct.topk_logprobs):
        assert top is not None and [a.logprob for a in entry.top_logprobs] == [lp for _, lp in top]
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)


async def test_streamed_and_plain_captures_are_identical(sampler):
    front = OpenAIFront(sampler)
    kwargs = dict(model="policy", messages=HI, n=2, seed=123, max_tokens=30, logprobs=True, temperature=0.8, stop=["xyz"])
    async with front.openai_client("plain") as client:
        plain = await client.chat.completions.create(**kwargs)
    async with front.openai_client("streamed") as client:
        stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    [a], [b] = front.captures.calls("plain"), front.captures.calls("streamed")
    assert a.model_dump(exclude={"rollout_id"}) == b.model_dump(exclude={"rollout_id"})
    for choice in plain.choices:  # what the stream carried adds up to the plain reply
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [e.logprob for c in mine if c.logprobs for e in c.logprobs.content] == [e.logprob for e in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump() == plain.usage.model_dump()


async def test_seed_reproduces_and_temperature_zero_is_greedy(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client() as client:
        r1 = await client.chat.completions.create(model="policy", messages=HI, seed=5, max_tokens=16)
        r2 = await client.chat.completions.create(model="mock/bigram-tiny", messages=HI, seed=5, max_tokens=16)
        g = await client.chat.completions.create(model="policy", messages=HI, temperature=0, max_tokens=16, n=2)
    assert r1.choices[0].message.content == r2.choices[0].message.content
    assert g.choices[0].message.content == g.choices[1].message.content
    calls = front.captures.calls("default")
    assert [c.call_index for c in calls] == [0, 1, 2]


async def test_stop_strings_end_the_reply_and_max_tokens_reports_length(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client("s") as client:
        long = await client.chat.completions.create(model="policy", messages=HI, seed=3, max_tokens=40, stop=[])
        text = long.choices[0].message.content
        stop = text[5:7]
        cut = await client.chat.completions.create(model="policy", messages=HI, seed=3, max_tokens=40, stop=[stop])
        short = await client.chat.completions.create(model="policy", messages=HI, seed=3, max_completion_tokens=4)
    assert stop not in cut.choices[0].message.content and text.startswith(cut.choices[0].message.content)
    assert cut.choices[0].finish_reason == "stop"
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4


async def test_completions_endpoint_captures_and_streams(sampler):
    front = OpenAIFront(sampler)
    tok = sampler.get_tokenizer()
    async with front.openai_client("c") as client:
        plain = await client.completions.create(model="policy", prompt="Q: 2+2=", max_tokens=12, seed=9, logprobs=0)
        stream = await client.completions.create(model="policy", prompt="Q: 2+2=", max_tokens=12, seed=9, logprobs=0, stream=True)
        chunks = [c async for c in stream]
        ids = await client.completions.create(model="policy", prompt=tok.encode("Q: 2+2="), max_tokens=12, seed=9)
    a, b, c = front.captures.calls("c")
    assert a.endpoint == "completions" and a.prompt_tokens == tok.encode("Q: 2+2=")
    assert a.model_dump(exclude={"call_index", "request"}) == b.model_dump(exclude={"call_index", "request"})
    assert c.choices[0].tokens == a.choices[0].tokens  # token-id prompts sample the same
    scored = await sampler.compute_logprobs(a.prompt_tokens + a.choices[0].tokens)
    assert plain.choices[0].logprobs.token_logprobs == a.choices[0].logprobs == scored[len(a.prompt_tokens) :]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text == ids.choices[0].text


async def test_models_and_stats_routes(sampler):
    front = OpenAIFront(sampler, model_name="agent-policy")
    async with front.openai_client() as client:
        models = await client.models.list()
        assert {m.id for m in models.data} == {"agent-policy", "mock/bigram-tiny"}
        await client.chat.completions.create(model="agent-policy", messages=HI, max_tokens=4)
        stats = (await client._client.get("http://asyncsess-front/v1/asyncsess/stats")).json()
    assert stats["requests"] == 1 and stats["completed"] >= 1 and stats["max_in_flight"] == 8 and stats["queued"] == 0


async def test_models_retrieve_and_routes_the_front_does_not_serve(sampler):
    """``client.models.retrieve`` was a 404, and every path or method the front does not serve (a stored response,
    say: nothing is stored) answered FastAPI's {"detail": ...}, which the openai client reads without a message, param or code."""
    front = OpenAIFront(sampler, model_name="agent-policy")
    async with front.openai_client() as client:
        for name in ("agent-policy", "mock/bigram-tiny"):
            assert (await client.models.retrieve(name)).model_dump() == {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "asyncsess",
                "shutdown_date": None,
            }
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-4o")
        assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.retrieve("resp_1")
        assert info.value.body["code"] == "not_found" and "POST /v1/responses" in info.value.message
        r = await client._client.get("http://asyncsess-front/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["param"] == "method", r.text
        assert r.headers["allow"] == "POST"  # RFC 9110: a 405 says which methods the path takes
        r = await client._client.put("http://asyncsess-front/v1/asyncsess/rollouts/x")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}, r.headers


def _tool_call(name: str = "f", call_id: str = "c1") -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}],
    }


BAD = [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"n": "two"}, 400, "n"),
    ({"n": 1000}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"n": True}, 400, "n"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": math.nan}, 400, "temperature"),
    ({"temperature": math.inf}, 400, "temperature"),
    ({"temperature": 5e-324}, 200, None),  # subnormal, but a valid temperature
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 200, None),  # capped to the context
    ({"max_tokens": 10**30}, 400, "max_tokens"),  # past a 32-bit int: it reached the backend as it came
    ({"seed": 2**80}, 400, "seed"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ({"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": "x" * 1001}, 400, "stop"),  # longer than a sampler takes (was a 500)
    ({"stop": ["a", "x" * 100_000]}, 400, "stop"),
    ({"stop": "x" * 1000}, 200, None),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages.0.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, 200, None),  # sampled unconstrained, checked after
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, 200, None),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                }
            ]
        },
        400,
        "messages.0.tool_calls.0.function.arguments",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}],
                }
            ]
        },
        400,
        "messages.0.tool_calls.0.function.arguments",  # nested past the recursion limit (was a 500)
    ),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "nul \x00 no"}]}, 400, "messages.0.content"),  # NUL is refused, as by the worker
    ({"user": "\ud800"}, 400, "user"),
    # NUL is refused wherever text reaches the template, as in content (names, descriptions and ids went through)
    ({"tools": [{"type": "function", "function": {"name": "ca\x00lc"}}]}, 400, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "a\x00"}}]}, 400, "tools.0.function.description"),
    ({"messages": [*HI, _tool_call(call_id="c\x00")]}, 400, "messages.1.tool_calls.0.id"),
    ({"messages": [*HI, _tool_call(name="f\x00")]}, 400, "messages.1.tool_calls.0.function.name"),
    ({"messages": [*HI, _tool_call(), {"role": "tool", "tool_call_id": "c1\x00", "content": "5"}]}, 400, "messages.2.tool_call_id"),
    ({"\udfff": 1}, 400, "\\udfff"),  # a parameter name that is not valid Unicode, named with an escape
    ({'qu]"x': 2**31}, 400, 'qu]"x'),  # an unknown name with a bracket (was param null: taken for a union branch)
    ({"list[int]": 1}, 400, "list[int]"),
    ({"messages": [{"role": "user", "content": "x", "a[0]": 1}]}, 400, "messages.0.a[0]"),
    ({"metadata": {"rollout_id": "r" * 513}}, 400, "metadata.rollout_id"),
    # the sampler refused the rendered prompt: named 'prompt', a parameter chat lacks
    ({"messages": [{"role": "user", "content": "long " * 20000}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0.type"),
]


@pytest.mark.parametrize(("change", "status", "param"), BAD)
async def test_bad_requests_get_4xx_naming_the_parameter_and_the_server_keeps_serving(sampler, change, status, param):
    front = OpenAIFront(sampler)
    body = {"model": "policy", "messages": HI, "max_tokens": 4, **change}
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        r = await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        if param is not None:
            err = r.json()["error"]
            assert err["param"] == param and param.split(".")[-1] in err["message"]
        ok = await http.post("/v1/chat/completions", json={"model": "policy", "messages": HI, "max_tokens": 4})
        assert ok.status_code == 200


SURROGATES = [  # a lone surrogate in a string the schema does not check itself (they were captured, then every read was a 500)
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools.0.function.description"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"enum": ["\udfff"]}}}}}]},
        "tools.0.function.parameters.properties.x.enum.0",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "\ud800"}}]},
        "tools.0.function.name",
    ),  # was named 'tools.0.function.name.\ud800'
    ({"messages": [_tool_call(name="\ud800")]}, "messages.0.tool_calls.0.function.name"),
    ({"messages": [_tool_call(call_id="\ud800")]}, "messages.0.tool_calls.0.id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "\udbff"}]}, "messages.0.tool_call_id"),
    ({"metadata": {"\ud800": "x"}}, "metadata.\\ud800"),
]


@pytest.mark.parametrize(("change", "param"), SURROGATES)
async def test_a_lone_surrogate_anywhere_is_refused_and_the_rollout_stays_readable(sampler, change, param):
    front = OpenAIFront(sampler)
    body = {"model": "policy", "messages": HI, "max_tokens": 4, **change}
    headers = {"content-type": "application/json", "x-rollout-id": "r"}
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        assert (
            await http.post("/v1/chat/completions", json={"model": "policy", "messages": HI, "max_tokens": 4}, headers=headers)
        ).status_code == 200
        content = json.dumps(body).encode()  # the surrogate as a \ud800 escape
        r = await http.post("/v1/chat/completions", content=content, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        for method in ("GET", "DELETE"):
            got = await http.request(method, "/v1/asyncsess/rollouts/r")
            assert got.status_code == 200 and len(got.json()["calls"]) == 1, got.text


NULLABLE = ["n", "stream", "stream_options", "logprobs", "top_logprobs", "temperature", "top_p", "stop", "seed", "max_tokens"]
NULLABLE += ["max_completion_tokens", "user", "metadata", "tools", "tool_choice", "parallel_tool_calls"]
NULLABLE += ["frequency_penalty", "presence_penalty", "logit_bias", "response_format", "store", "service_tier"]  # not implemented


async def test_a_null_parameter_is_one_not_sent(sampler):
    """OpenAI's parameters are nullable, and clients other than the official one send nulls: "n": null was a 400."""
    front = OpenAIFront(sampler)
    body = {"model": "policy", "messages": HI, "max_tokens": 4, "seed": 7}
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        plain = await http.post("/v1/chat/completions", json=body)
        nulls = await http.post("/v1/chat/completions", json={**dict.fromkeys(NULLABLE), **body})
        assert nulls.status_code == 200, nulls.text
        assert nulls.json()["choices"] == plain.json()["choices"]
        r = await http.post("/v1/completions", json={"model": "policy", "prompt": "hi", "n": None, "logprobs": None, "echo": None})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        r = await http.post("/v1/chat/completions", json={"model": "policy", "messages": None})
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter", r.text


async def test_broken_bodies_get_400(sampler):
    front = OpenAIFront(sampler)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
            r = await http.post("/v1/chat/completions", content=content)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await http.post("/v1/completions", json={"model": "policy", "prompt": [10**30]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await http.post("/v1/completions", json={"model": "policy", "prompt": "x", "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        for batch in (["a", "b"], [[1, 2], [3]]):  # OpenAI's batched prompts: was "'prompt.0': Input should be a valid integer"
            r = await http.post("/v1/completions", json={"model": "policy", "prompt": batch})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "batch" in r.json()["error"]["message"], r.text


async def test_a_prompt_that_fills_the_context_is_named_as_the_caller_sent_it(sampler):
    """A completion prompt that fills the context was refused naming 'messages', a parameter completions lack."""
    front = OpenAIFront(sampler, context_window=32)
    async with front.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="policy", prompt="x" * 40, max_tokens=2)
        assert info.value.param == "prompt" and "context" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 40}], max_tokens=2)
        assert info.value.param == "messages"


async def test_the_official_client_raises_typed_errors(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client() as client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="nope", messages=HI)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="policy", messages=HI, n=65)
        assert info.value.param == "n"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="policy", messages=HI, frequency_penalty=1.0)
        assert info.value.param == "frequency_penalty" and "unsupported parameter" in info.value.message


async def test_a_refused_call_shifts_neither_the_call_indices_nor_the_seeds_after_it(sampler):
    """A call the sampler refuses (a prompt past mock's 512-token context; the front has no context_window to check
    it against) took a call index and the bound rollout's seed: every later call of the rollout drew other tokens."""

    async def rollout(refused: int) -> list[tuple[int, list[int]]]:
        front = OpenAIFront(sampler)
        front.bind("r", sampler, 0, seed=100)
        async with front.openai_client("r") as client:
            for i in range(3):
                for _ in range(refused if i == 1 else 0):
                    with pytest.raises(openai.BadRequestError) as info:
                        await client.completions.create(model="policy", prompt=[5] * 600, max_tokens=8)
                    assert info.value.param == "prompt"
                await client.chat.completions.create(model="policy", messages=HI, max_tokens=8, stream=i == 2)
        return [(c.call_index, c.choices[0].tokens) for c in front.captures.calls("r")]

    plain = await rollout(0)
    assert [i for i, _ in plain] == [0, 1, 2] and len({tuple(t) for _, t in plain}) == 3  # each call its own seed
    assert await rollout(2) == plain


async def test_64_concurrent_rollouts_share_the_pool_with_visible_backpressure(sampler):
    front = OpenAIFront(sampler)

    async def agent(i: int) -> None:
        async with front.openai_client(f"r{i}") as client:
            messages = [{"role": "user", "content": f"task {i}"}]
            for _ in range(2):
                reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=i)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "again"}]

    async with anyio.create_task_group() as agents:
        for i in range(64):
            agents.start_soon(agent, i)
    s = front.stats()
    assert front.counts["errors"] == 0 and front.counts["requests"] == 128 and s["completed"] == 128
    # bounded by max_samples_in_flight, and callers waited (counted by the pool: polling for a queue raced it)
    assert s["peak_in_flight"] == 8 and s["waited"] > 0 and s["in_flight"] == s["queued"] == 0
    assert sorted(front.captures.rollout_ids()) == sorted(f"r{i}" for i in range(64))
    assert all([c.call_index for c in front.captures.calls(f"r{i}")] == [0, 1] for i in range(64))


async def test_captures_can_be_fetched_and_dropped_over_http(sampler):
    front = OpenAIFront(sampler)
    async with front.openai_client("remote") as client:
        await client.chat.completions.create(model="policy", messages=HI, max_tokens=3, seed=1)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        got = (await http.get("/v1/asyncsess/rollouts/remote")).json()
        assert [CapturedCall.model_validate(c) for c in got["calls"]] == front.captures.calls("remote")
        dropped = (await http.delete("/v1/asyncsess/rollouts/remote")).json()
        assert dropped["calls"] == got["calls"]
        assert (await http.get("/v1/asyncsess/rollouts/remote")).json()["calls"] == []
    assert front.captures.rollout_ids() == []


class _Counting:
    """A tokenizer wrapper that counts the tokens it decodes (what streaming a reply costs)."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        self.decoded += len(tokens)
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)


class _Bytes:
    """One token per byte: characters of several bytes come complete only after their last token."""

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return bytes(tokens).decode("utf-8", "replace")


@pytest.mark.parametrize("skip", [False, True])
def test_streamed_pieces_add_up_to_the_content_at_a_cost_linear_in_the_reply(skip):
    """Decoding tokens[:i + 1] afresh for every token made a 4,096-token streamed reply take seconds of the event
    loop (quadratic); the pieces now cost a few tokens each and still add up to the content exactly."""
    mock = CharTokenizer()
    rng = Random(0)
    tokens = [rng.randrange(len(mock)) for _ in range(4096)]  # special tokens among them
    text = mock.decode(tokens, skip_special_tokens=skip)
    for content in (text, text[: len(text) // 3], ""):  # the whole reply, one cut at a stop string, nothing
        tok = _Counting(mock)
        pieces = content_pieces(tok, tokens, content, skip_special_tokens=skip)
        assert "".join(pieces) == content and len(tokens) <= len(pieces) <= len(tokens) + 1
        assert tok.decoded <= 12 * len(tokens)  # was about len(tokens) ** 2 / 2
    whole = content_pieces(mock, tokens, text, skip_special_tokens=skip)
    assert sum(1 for p in whole[: len(tokens)] if p) >= len(text) // 2  # streamed as it goes, not at the end
    reply = "héllo ✓ 日本 🙂".encode() + b"\xff" * 3000 + b"!"  # multi-byte characters, then undecodable bytes
    tok = _Counting(_Bytes())
    pieces = content_pieces(tok, list(reply), reply.decode("utf-8", "replace"))
    assert "".join(pieces) == reply.decode("utf-8", "replace") and tok.decoded <= 12 * len(reply)
    assert pieces[:6] == ["h", "", "é", "l", "l", "o"]  # a character appears once its last byte arrived


class _Slow:
    """A sampler whose samples take ``delay`` seconds (everything else is the real sampler's)."""

    def __init__(self, real, delay: float) -> None:
        self.real, self.delay, self.calls = real, delay, 0
        self.sampler_id, self.base_model = real.sampler_id, real.base_model

    def __getattr__(self, name):
        return getattr(self.real, name)

    def sample(self, *args, **kwargs):
        self.calls += 1

        async def slow():
            await anyio.sleep(self.delay)
            return await self.real.sample(*args, **kwargs)

        return slow()


async def test_the_clients_timeout_holds_in_process_and_its_retries_leave_no_capture(sampler):
    """httpx's ASGI transport keeps no timeout: an in-process client's ``timeout`` was ignored and a slow call
    (or a hung backend) blocked the agent until it answered. The call is now cancelled at the read timeout, the
    client retries it as over a socket and then raises APITimeoutError; the cancelled calls capture nothing and
    take no call index."""
    slow = _Slow(sampler, delay=20.0)
    front = OpenAIFront(slow)
    async with front.openai_client("t", timeout=0.05, max_retries=2) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="policy", messages=HI, max_tokens=4)
    assert slow.calls == 3 and front.captures.calls("t") == []
    slow.delay = 0.0
    async with front.openai_client("t") as client:
        await client.chat.completions.create(model="policy", messages=HI, max_tokens=4)
    assert [c.call_index for c in front.captures.calls("t")] == [0]


class _Throttled(_Slow):
    """Samples after ``failures`` throttled attempts, each as the sampling client gives up on it."""

    def __init__(self, real, failures: int, retry_after: float) -> None:
        super().__init__(real, 0.0)
        self.failures, self.retry_after = failures, retry_after

    def sample(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.failures:
            return self.real.sample(*args, **kwargs)

        async def throttled():
            try:
                raise RateLimitError("slow down", retry_after=self.retry_after)
            except RateLimitError as err:
                raise RetriesExhaustedError("gave up", attempts=3) from err

        return throttled()


async def test_a_throttled_sampler_is_a_429_with_the_backends_retry_hint_and_the_client_waits_it_out(sampler):
    """A throttled backend was a 503 without the hint of when to retry: the openai client retried at once (0.5 s,
    1 s) into the throttle, then raised InternalServerError. It is now a 429 carrying retry-after-ms / Retry-After,
    which the client's retry logic reads; a retry that then succeeds is captured once, as call 0."""
    throttled = _Throttled(sampler, failures=1, retry_after=0.25)
    front = OpenAIFront(throttled)
    async with front.openai_client("t") as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="policy", messages=HI, max_tokens=4)
    assert info.value.response.headers["retry-after-ms"] == "250" and info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "rate_limit_exceeded"
    throttled.calls = 0
    async with front.openai_client("t", max_retries=1) as client:
        reply = await client.chat.completions.create(model="policy", messages=HI, max_tokens=4)
    assert throttled.calls == 2 and [c.call_index for c in front.captures.calls("t")] == [0]
    assert front.captures.calls("t")[0].choices[0].tokens and reply.choices[0].message.content is not None


async def test_stream_options_without_stream_is_refused_as_openai_does(sampler):
    """OpenAI answers 400 (param ``stream_options``) when it comes without ``stream: true``; it was taken silently."""
    front = OpenAIFront(sampler)
    async with front.openai_client() as client:
        for stream in ({}, {"stream": False}):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model="policy", messages=HI, max_tokens=2, stream_options={"include_usage": True}, **stream
                )
            assert err.value.body["param"] == "stream_options" and "stream" in err.value.body["message"]
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="policy", prompt="hi", max_tokens=2, stream_options={"include_usage": True}, **stream)
            assert err.value.body["param"] == "stream_options"
        await client.chat.completions.create(model="policy", messages=HI, max_tokens=2, extra_body={"stream_options": None})  # null: unset
    assert front.captures.calls("default")[0].call_index == 0  # a refused call took no index


async def test_served_logprobs_cover_the_content_not_the_end_token(sampler):
    """The reply's ``logprobs`` spelled the content plus ``<|end|>`` (not part of it); OpenAI's cover the content
    exactly. The capture keeps the end token and its log-prob (the model sampled it: it is trained)."""
    from .helpers import ScriptedSampler

    tok = sampler.get_tokenizer()
    front = OpenAIFront(ScriptedSampler(sampler, ["It is 5.", "It is 5.", "It is 5. Done", "It is 5. Done"]))
    async with front.openai_client("lp") as client:
        plain = await client.chat.completions.create(model="policy", messages=HI, logprobs=True)
        stream = await client.chat.completions.create(model="policy", messages=HI, logprobs=True, stream=True)
        streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        cut = await client.chat.completions.create(model="policy", messages=HI, logprobs=True, stop=[" Done"])
        cut_stream = await client.chat.completions.create(model="policy", messages=HI, logprobs=True, stop=[" Done"], stream=True)
        cut_streamed = [
            e for c in [c async for c in cut_stream] if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
    served = plain.choices[0].logprobs.content
    assert "".join(e.token for e in served) == plain.choices[0].message.content == "It is 5."
    assert [e.token for e in streamed] == [e.token for e in served] and [e.logprob for e in streamed] == [e.logprob for e in served]
    assert "".join(e.token for e in cut.choices[0].logprobs.content) == cut.choices[0].message.content == "It is 5."
    assert [e.token for e in cut_streamed] == [e.token for e in cut.choices[0].logprobs.content]
    first = front.captures.calls("lp")[0].choices[0]
    assert first.tokens[-1] == tok.convert_tokens_to_ids("<|end|>") and len(first.logprobs) == len(first.tokens) == len(served) + 1
    assert first.logprobs[:-1] == [e.logprob for e in served]


async def test_completion_logprobs_cover_the_text_not_the_eos(sampler):
    from .helpers import ScriptedSampler

    tok = sampler.get_tokenizer()
    scripted = ScriptedSampler(sampler, ["4 apples", "4 apples"])
    scripted.end = tok.eos_token_id
    front = OpenAIFront(scripted)
    async with front.openai_client("c") as client:
        plain = await client.completions.create(model="policy", prompt="2+2=", logprobs=0)
        chunks = [c async for c in await client.completions.create(model="policy", prompt="2+2=", logprobs=0, stream=True)]
    lp = plain.choices[0].logprobs
    assert "".join(lp.tokens) == plain.choices[0].text == "4 apples" and len(lp.token_logprobs) == len(lp.tokens) == 8
    assert lp.text_offset == list(range(8))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    captured = front.captures.calls("c")[0].choices[0]
    assert captured.tokens[-1] == tok.eos_token_id and len(captured.logprobs) == 9


@pytest.mark.parametrize("rollout", ["héllo/wörld", "日本語", "emoji-🙂", "a b?c#d%2F"])
async def test_a_unicode_rollout_id_round_trips_from_the_header_and_from_metadata(sampler, rollout):
    """The header's UTF-8 bytes were read as Latin-1: the call was captured under ``hÃ©llo/wÃ¶rld`` (unreadable by the id
    the agent set) and a rollout bound under its id was served by the default sampler; now any Unicode id round-trips."""
    from urllib.parse import quote

    bound = OpenAIFront(sampler)
    bound.bind(rollout, sampler, version=3)
    bound.publish(sampler, version=9)  # what a call under another id gets
    async with bound.openai_client(rollout) as client:  # the header, UTF-8 encoded
        reply = await client.chat.completions.with_raw_response.create(model="policy", messages=HI, max_tokens=2)
    assert reply.headers["x-weight-version"] == "3"  # the bound sampler served it
    async with httpx.AsyncClient(transport=bound.transport(), base_url="http://front") as http:
        body = {"model": "policy", "messages": HI, "max_tokens": 2, "metadata": {"rollout_id": rollout}}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        got = await http.get("/v1/asyncsess/rollouts/" + quote(rollout, safe="/"))
    assert got.status_code == 200 and got.json()["rollout_id"] == rollout
    assert [c["call_index"] for c in got.json()["calls"]] == [0, 1] and bound.captures.rollout_ids() == [rollout]


async def test_a_rollout_header_that_is_not_utf8_is_a_400_naming_it(sampler):
    front = OpenAIFront(sampler)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        body = {"model": "policy", "messages": HI, "max_tokens": 2}
        r = await http.post("/v1/chat/completions", json=body, headers={"x-rollout-id": b"caf\xe9"})  # Latin-1 bytes
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-rollout-id" and "UTF-8" in r.json()["error"]["message"]
    assert front.captures.rollout_ids() == []
