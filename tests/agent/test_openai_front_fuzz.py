"""Random bodies (valid keys with wild values, unknown keys, wrong shapes) never get a 5xx from the front,
every 4xx names what is wrong, and the front keeps serving."""

from __future__ import annotations

import json
import os

import anyio
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsess import ServiceClient
from asyncsess.serve.openai_front import OpenAIFront

WILD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=40),
    st.lists(st.integers(-5, 500), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
KEYS = [
    "model",
    "messages",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "metadata",
    "user",
    "prompt",
    "echo",
    "best_of",
    "frequency_penalty",
]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
    optional={"content": st.one_of(st.text(max_size=60), st.none(), st.integers()), "tool_call_id": st.text(max_size=5)},
)
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "policy", "prompt": "hi", "max_tokens": 4}
# (changes to a valid body, replacement messages or None)
BODY = st.tuples(st.dictionaries(st.sampled_from(KEYS), WILD, max_size=4), st.one_of(st.none(), st.lists(MESSAGE, max_size=3)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(BODY, min_size=4, max_size=8))
def test_random_bodies_never_get_5xx(bodies):
    async def main() -> None:
        async with ServiceClient("mock://") as svc:
            front = OpenAIFront(await svc.create_sampling_client(base_model="mock/bigram-tiny"), max_n=4)
            async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
                for changes, messages in bodies:
                    for route, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
                        body = {**base, **changes, **({"messages": messages} if messages is not None else {})}
                        content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
                        r = await http.post(route, content=content)
                        assert r.status_code in (200, 400, 404), (route, body, r.status_code, r.text)
                        if r.status_code != 200:
                            err = r.json()["error"]
                            assert err["message"] and (err["param"] is not None or err["code"] == "invalid_json"), (body, err)
                ok = await http.post("/v1/chat/completions", json=CHAT)
                assert ok.status_code == 200

    anyio.run(main, backend=os.environ.get("ASYNCSESS_ANYIO_BACKEND", "asyncio"))


def test_a_body_nested_past_the_recursion_limit_is_a_400_not_a_500():
    """``json.loads`` raises RecursionError (not ValueError) on deep nesting; it was a 500 on every OpenAI route."""

    async def main() -> None:
        async with ServiceClient("mock://") as svc:
            front = OpenAIFront(await svc.create_sampling_client(base_model="mock/bigram-tiny"), max_n=4)
            async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
                for route in ("/v1/chat/completions", "/v1/completions"):
                    for raw in (b'{"messages":' * 100_000, b"[" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
                        r = await http.post(route, content=raw, headers={"content-type": "application/json"})
                        assert r.status_code == 400, (route, r.status_code, r.text[:200])
                        assert r.json()["error"]["code"] == "invalid_json" and "deep" in r.json()["error"]["message"]
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200

    anyio.run(main, backend=os.environ.get("ASYNCSESS_ANYIO_BACKEND", "asyncio"))
