"""One worker, many clients: health and readiness without a key, a per-key in-flight cap answered with 429
+ Retry-After (which the client's retry policy honours), and 16 clients training and sampling at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("torch")

from asyncsess import AdamParams, RetryPolicy, SamplingParams, ServiceClient
from asyncsess_local.server import tenant_of

from .helpers import sft_datum

pytestmark = [pytest.mark.local, pytest.mark.anyio]
KEYS = [f"tenant-{i}" for i in range(16)]


def _serve(tiny: str, tmp_path: Path, **options: Any):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "ckpt"), gap_timeout=2)
    w = serve_in_thread(backend, KEYS, **options)
    w.backend = backend
    return w


@pytest.fixture
def worker(tiny: str, tmp_path: Path):
    w = _serve(tiny, tmp_path, max_inflight_per_key=2)
    yield w
    w.stop()


@pytest.fixture
def roomy_worker(tiny: str, tmp_path: Path):
    w = _serve(tiny, tmp_path)
    yield w
    w.stop()


def _op(kind: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "seq": seq, "idempotency_key": f"op-{seq}", **fields}


async def test_health_and_readiness_need_no_key_and_tell_nothing(worker) -> None:
    async with httpx.AsyncClient(base_url=worker.url) as http:
        for path in ("/healthz", "/readyz"):
            r = await http.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert (await http.get("/v1/models")).status_code == 401  # everything else still needs the key


async def test_a_key_over_its_in_flight_cap_gets_429_with_retry_after_and_others_are_served(worker, tiny: str) -> None:
    """Two ops held back by a sequence gap fill key 0's cap of 2: its next request is refused with 429 while
    key 1 is served; once they are answered (the gap times out), key 0 is served again; and a client retries
    past a 429 after its Retry-After."""
    h0, h1 = {"X-API-Key": KEYS[0]}, {"X-API-Key": KEYS[1]}
    datum = sft_datum(list(range(3, 30))).model_dump(mode="json")
    async with httpx.AsyncClient(base_url=worker.url, timeout=60) as http:
        session = (await http.post("/v1/sessions", json={"base_model": tiny, "rank": 4}, headers=h0)).json()["model_id"]
        ops = f"/v1/sessions/{session}/ops"
        held: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:

            async def send(seq: int) -> None:
                held.append(await http.post(ops, json=_op("forward", seq, data=[datum], loss_fn="cross_entropy"), headers=h0))

            tg.start_soon(send, 2)
            tg.start_soon(send, 3)
            for _ in range(500):  # until both wait in the worker (the bound only guards a broken build)
                if worker.app.state.inflight[tenant_of(KEYS[0])] == 2:
                    break
                await anyio.sleep(0.01)
            refused = await http.get("/v1/models", headers=h0)
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["type"] == "RateLimitError" and refused.json()["error"]["retry_after"] == 1.0
            assert (await http.get("/v1/models", headers=h1)).status_code == 200  # another tenant is not affected
        assert [r.status_code for r in held] == [503, 503]  # the gap was never filled: a retryable answer
        assert worker.app.state.inflight[tenant_of(KEYS[0])] == 0
        assert (await http.get("/v1/models", headers=h0)).status_code == 200

    # the SDK: a RateLimitError is retried after its Retry-After, and the op goes through
    seen = []
    policy = RetryPolicy(initial_backoff=0.001, max_backoff=0.01, jitter=0.0)
    async with ServiceClient(worker.url, api_key=KEYS[2], retry=policy, on_retry=seen.append, heartbeat_interval=0) as svc:
        tc = await svc.create_lora_training_client(tiny, rank=4, seed=0)
        inflight = worker.app.state.inflight
        inflight[tenant_of(KEYS[2])] += 2  # as if two of its requests were still being served
        fut = tc.forward([sft_datum(list(range(3, 30)))], "cross_entropy")
        for _ in range(5000):  # liveness only: until the worker has answered 429 once
            if seen:
                break
            await anyio.sleep(0.002)
        inflight[tenant_of(KEYS[2])] -= 2
        assert (await fut).loss_fn_outputs
        assert seen and seen[0].sleep >= 1.0 and type(seen[0].error).__name__ == "RateLimitError"


async def test_16_clients_train_and_sample_at_once_and_none_starves(roomy_worker, tiny: str) -> None:
    worker = roomy_worker
    steps = 3
    done: dict[int, list[int]] = {i: [] for i in range(16)}  # client -> the global order in which its steps finished
    order = iter(range(10_000))

    async def client(i: int) -> None:
        async with ServiceClient(worker.url, api_key=KEYS[i], heartbeat_interval=0) as svc:
            tc = await svc.create_lora_training_client(tiny, rank=4, seed=i)
            datum = sft_datum(list(range(3 + i, 30 + i)))
            for _ in range(steps):
                fb = tc.forward_backward([datum], "cross_entropy")
                opt = tc.optim_step(AdamParams(learning_rate=1e-2))
                sampler = await tc.save_weights_and_get_sampling_client()
                out = await sampler.sample(datum.model_input.to_ints()[:8], 2, SamplingParams(max_tokens=4, seed=i))
                assert len(out.sequences) == 2
                await fb
                await opt
                done[i].append(next(order))
            await tc.stop()

    async with anyio.create_task_group() as tg:
        for i in range(16):
            tg.start_soon(client, i)
    assert all(len(d) == steps for d in done.values())
    # no client starves: by the time the fastest finished all its steps, every client had finished one
    fastest_end = min(d[-1] for d in done.values())
    assert all(d[0] < fastest_end for d in done.values())
    engine = worker.backend.engine
    assert not engine.sessions and not engine.samplers  # everything those clients opened is released


async def test_a_key_whose_bodies_in_flight_would_pass_its_bytes_gets_429_and_others_are_served(tiny: str, tmp_path: Path) -> None:
    """The bodies of a key's requests in flight were bounded only by count (1,024) × size (256 MB): an op waiting for an
    earlier one, or a body still arriving, holds its bytes (decoded, several times more), so one key could take the
    worker's memory from every tenant. Past ``max_body_bytes_in_flight_per_key`` a request gets a 429 with Retry-After."""
    import socket

    w = _serve(tiny, tmp_path, max_body_bytes_in_flight_per_key=1000)
    try:
        h0, h1 = {"X-API-Key": KEYS[0]}, {"X-API-Key": KEYS[1]}
        body = {"base_model": tiny, "rank": 1, "user_metadata": {"k": "v" * 200}}
        async with httpx.AsyncClient(base_url=w.url, timeout=60) as http:
            with socket.create_connection(("127.0.0.1", w.port)) as slow:  # 800 bytes announced, 10 sent: held in flight
                head = f"POST /v1/sessions HTTP/1.1\r\nHost: w\r\nX-API-Key: {KEYS[0]}\r\nContent-Type: application/json\r\n"
                slow.sendall(head.encode() + b"Content-Length: 800\r\n\r\n" + b'{"rank": 1')
                for _ in range(500):  # until it is in (the bound only guards a broken build)
                    if w.app.state.inflight[tenant_of(KEYS[0])] == 1:
                        break
                    await anyio.sleep(0.01)
                refused = await http.post("/v1/sessions", json=body, headers=h0)
                assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
                assert refused.json()["error"]["type"] == "RateLimitError" and "bytes of request bodies" in refused.text
                assert (await http.get("/v1/models", headers=h0)).status_code == 200  # a request without a body still goes
                assert (await http.post("/v1/sessions", json=body, headers=h1)).status_code == 200  # another key's too
            for _ in range(500):  # the slow client hung up: its bytes are free again
                if w.app.state.inflight[tenant_of(KEYS[0])] == 0:
                    break
                await anyio.sleep(0.01)
            assert (await http.post("/v1/sessions", json=body, headers=h0)).status_code == 200
            alone = {**body, "user_metadata": {"k": "v" * 1000, "l": "v" * 200}}  # past the bytes, but alone: it goes
            assert (await http.post("/v1/sessions", json=alone, headers=h0)).status_code == 200
    finally:
        w.stop()
