"""The front served over a real socket by uvicorn (as a server would host it), used by the official client.

uvicorn runs on asyncio only, so this test runs on asyncio under both matrix backends."""

from __future__ import annotations

import socket

import anyio
import openai
import pytest
import uvicorn

from asyncsess import ServiceClient
from asyncsess.serve.openai_front import ROLLOUT_HEADER, OpenAIFront

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn serves on asyncio only
async def test_served_over_a_socket_with_streaming_and_capture(anyio_backend):
    async with ServiceClient("mock://") as svc:
        sampler = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        front = OpenAIFront(sampler)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(front.app(), log_level="warning", lifespan="off"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            while not server.started:
                await anyio.sleep(0.01)
            try:
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
                        await client.chat.completions.create(
                            model="policy", messages=[{"role": "user", "content": "hi"}], logit_bias={"1": 1}
                        )
            finally:
                server.should_exit = True
        assert text == plain.choices[0].message.content
        a, b = front.captures.calls("net")
        assert a.model_dump(exclude={"call_index"}) == b.model_dump(exclude={"call_index"})
        scored = await sampler.compute_logprobs(a.prompt_tokens + a.choices[0].tokens)
        assert a.choices[0].logprobs == scored[len(a.prompt_tokens) :]
