"""The front served over a real socket by uvicorn (as a server would host it), used by the official client.

uvicorn runs on asyncio only, so this test runs on asyncio under both matrix backends."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import anyio
import openai
import pytest
import uvicorn

from asyncsess import ServiceClient
from asyncsess.serve.capture import CaptureStore
from asyncsess.serve.openai_front import ROLLOUT_HEADER, OpenAIFront

from .test_openai_front import HI, _Slow

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def _served(front: OpenAIFront) -> AsyncIterator[int]:
    """The front's app served by uvicorn on a free port of 127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(front.app(), log_level="warning", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn serves on asyncio only
async def test_served_over_a_socket_with_streaming_and_capture(anyio_backend):
    async with ServiceClient("mock://") as svc:
        sampler = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        front = OpenAIFront(sampler)
        async with _served(front) as port:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", default_headers={ROLLOUT_HEADER: "net"})
            async with client:
                plain = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], seed=4, max_tokens=12
                )
                stream = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], seed=4, max_tokens=12, stream=True
                )
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                with pytest.raises(openai.BadRequestError):
                    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], logit_bias={"1": 1})
        assert text == plain.choices[0].message.content
        a, b = front.captures.calls("net")
        assert a.model_dump(exclude={"call_index"}) == b.model_dump(exclude={"call_index"})
        scored = await sampler.compute_logprobs(a.prompt_tokens + a.choices[0].tokens)
        assert a.choices[0].logprobs == scored[len(a.prompt_tokens) :]


class _Ended(CaptureStore):
    """Counts the calls that ended, captured or given back."""

    ended = 0

    def add(self, call) -> None:
        super().add(call)
        self.ended += 1

    def release(self, rollout_id: str, index: int) -> bool:
        self.ended += 1
        return super().release(rollout_id, index)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_call_whose_client_timed_out_is_not_captured(anyio_backend):
    """Over a socket the server samples on after the client gives up; the calls of a client that timed out and
    retried were captured in its rollout (calls 0 and 1) though the agent saw neither, and the trajectory trained on
    them. A call whose client hung up before the samples were ready is now given back, as a refused one is."""
    async with ServiceClient("mock://") as svc:
        slow = _Slow(await svc.create_sampling_client(base_model="mock/bigram-tiny"), delay=2.0)
        front = OpenAIFront(slow, captures=_Ended())
        async with _served(front) as port:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=0.3, max_retries=1)
            async with client:
                with pytest.raises(openai.APITimeoutError):
                    await client.chat.completions.create(model="policy", messages=HI, max_tokens=4, user="gone")
                while front.captures.ended < 2:  # both attempts sampled on and ended
                    await anyio.sleep(0.05)
                slow.delay = 0.0
                await client.chat.completions.create(model="policy", messages=HI, max_tokens=4, user="gone")
    [call] = front.captures.calls("gone")  # the answered call only (its index may follow the ones given back)
    assert slow.calls == 3 and front.captures.ended == 3 and call.choices[0].tokens


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_streaming_client_that_hangs_up_frees_its_slot_at_once(anyio_backend):
    """Over a socket, a streaming agent that gave up (closed its connection) held its sampler slot until the whole
    reply was sampled (minutes for a long one), for no one. uvicorn's disconnect now withdraws the sample."""
    async with ServiceClient("mock://?latency_ms=30000") as svc:  # each sample holds its slot for 30 s
        front = OpenAIFront(await svc.create_sampling_client(base_model="mock/bigram-tiny"), captures=_Ended())
        async with _served(front) as port:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            async with client, anyio.create_task_group() as tg:

                async def agent() -> None:
                    stream = await client.chat.completions.create(model="policy", messages=HI, max_tokens=4, stream=True, user="gone")
                    async for _ in stream:
                        pass

                tg.start_soon(agent)
                while front.stats()["in_flight"] == 0:  # the call holds its slot (for 30 s)
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()  # the agent hangs up
            while front.captures.ended == 0:  # the server saw it
                await anyio.sleep(0.01)
            s = front.stats()
    assert s["in_flight"] == 0 and front.counts["sampled_tokens"] == 0 and front.captures.calls("gone") == [], s
