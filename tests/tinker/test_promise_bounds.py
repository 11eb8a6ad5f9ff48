"""The door's futures are bounded per API key. Kept results were one table for every key, trimmed to its newest
4,096 by creation order: one key's flood of samples forgot another key's finished results (its re-poll, as after a
lost answer, was a 404), an unfinished promise at the head held every finished one after it in memory, and a
result's bytes were not counted at all. And a key could hold any number of unfinished requests (a promise and a task
each, every other key's requests queued behind them): past ``max_pending`` it now gets a 429 that takes nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from asyncsess.serve.promises import PromiseTable

from .conftest import API_KEY, Counted, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
OTHER_KEY = "tml-asyncsess-promises-other"
KEEP = 20


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://", api_keys={API_KEY, OTHER_KEY}):
        srv.door.promises = PromiseTable(keep=KEEP)
        yield srv


def _client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=httpx.Timeout(60.0))


def _poll(http: httpx.Client, request_id: str) -> httpx.Response:
    while True:  # a long-poll: 408 means not done yet
        got = http.post("/retrieve_future", json={"request_id": request_id})
        if got.status_code != 408:
            return got


def _session(http: httpx.Client) -> str:
    return str(http.post("/create_session", json={"tags": [], "sdk_version": "t"}).json()["session_id"])


def test_one_keys_flood_does_not_forget_another_keys_results(server: Server) -> None:
    a, b = _client(server, API_KEY), _client(server, OTHER_KEY)
    sb = _session(b)
    made = b.post("/create_model", json={"session_id": sb, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}})
    assert _poll(b, made.json()["request_id"]).status_code == 200
    step = b.post("/optim_step", json={"model_id": made.json()["model_id"], "seq_id": 1, "adam_params": {"learning_rate": 0.01}})
    theirs = step.json()["request_id"]
    first = _poll(b, theirs)
    assert first.status_code == 200 and first.json()["type"] == "optim_step", first.text

    sa = _session(a)
    sampler = a.post("/create_sampling_session", json={"session_id": sa, "sampling_session_seq_id": 0, "base_model": BASE})
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
    mine = []
    for seq in range(3 * KEEP):  # A samples and retrieves three times what a key keeps
        body = {"sampling_session_id": sampler.json()["sampling_session_id"], "seq_id": seq, "prompt": prompt}
        sent = a.post("/asample", json=body | {"sampling_params": {"max_tokens": 2, "seed": seq}})
        assert sent.status_code == 200, sent.text
        assert _poll(a, sent.json()["request_id"]).status_code == 200
        mine.append(sent.json()["request_id"])

    again = _poll(b, theirs)  # B's re-poll (a lost answer) still finds its result
    assert again.status_code == 200 and again.json() == first.json(), again.text
    # A's own oldest results were forgotten (404, as for an id never issued): its share stays bounded
    gone = _poll(a, mine[0])
    assert gone.status_code == 404 and gone.json()["field"] == "request_id", gone.text
    assert _poll(a, mine[-1]).status_code == 200
    kept = [p for p in server.door.promises._items.values() if p.owner == API_KEY and p.done.is_set()]
    assert len(kept) == KEEP


@pytest.mark.anyio
async def test_an_unfinished_promise_does_not_hold_the_finished_ones() -> None:
    table = PromiseTable(keep=3)
    stuck = table.new("sample", "s", owner="k")
    done = [table.new("sample", "s", owner="k") for _ in range(10)]
    for p in done:
        p.resolve(proto=b"x" * 100)
    assert set(table._items) == {stuck.request_id, *(p.request_id for p in done[-3:])}
    assert all(p.forgotten and p.proto is None for p in done[:-3])  # their results are freed, not just unlisted
    assert done[-1].proto == b"x" * 100 and not stuck.done.is_set()


@pytest.mark.anyio
async def test_results_are_bounded_in_bytes_per_key() -> None:
    table = PromiseTable(keep=1000, keep_bytes=10_000)
    big = [table.new("forward_backward", "s", owner="a") for _ in range(8)]
    small = table.new("optim_step", "t", owner="b")
    small.resolve(json={"type": "optim_step"})
    for p in big:
        p.resolve(proto=b"\0" * 3000)
    assert [p.request_id in table._items for p in big] == [False] * 5 + [True] * 3  # 3 x ~3 KB fit in 10 KB
    assert table.get(small.request_id) is small  # the other key's result stays
    huge = table.new("forward_backward", "s", owner="a")
    huge.resolve(proto=b"\0" * 50_000)  # one result over the share is kept (alone) until it can be retrieved
    assert table.get(huge.request_id) is huge and not any(p.request_id in table._items for p in big)


def test_a_key_past_its_unfinished_requests_gets_a_429_that_takes_nothing(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend holds A's samples (a gate), so they stay unfinished: A's next sample, training op and model are a
    429 with Retry-After, B's requests run, and once A's samples finish A's refused op runs under the same seq_id."""
    a, b = _client(server, API_KEY), _client(server, OTHER_KEY)
    sa, sb = _session(a), _session(b)
    made = {}
    for http, sid in ((a, sa), (b, sb)):
        sent = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}})
        assert _poll(http, sent.json()["request_id"]).status_code == 200
        made[sid] = sent.json()["model_id"]
    sampler = a.post("/create_sampling_session", json={"session_id": sa, "sampling_session_seq_id": 0, "base_model": BASE})
    backend_id = server.door.samplers[sampler.json()["sampling_session_id"]].backend_id
    entered, gate, real = threading.Semaphore(0), threading.Event(), server.backend.sample

    async def held(sampler_id: str, request: Any) -> Any:
        if sampler_id == backend_id:
            entered.release()
            await anyio.to_thread.run_sync(gate.wait)
        return await real(sampler_id, request)

    monkeypatch.setattr(server.backend, "sample", held)
    monkeypatch.setattr(server.door, "max_pending", 3)
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}

    def sample(seq: int) -> httpx.Response:
        body = {"sampling_session_id": sampler.json()["sampling_session_id"], "seq_id": seq, "prompt": prompt}
        return a.post("/asample", json=body | {"sampling_params": {"max_tokens": 2, "seed": seq}})

    def step(http: httpx.Client, model_id: str, seq: int) -> httpx.Response:
        return http.post("/optim_step", json={"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": 0.01}})

    try:
        held_ids = [sample(seq).json()["request_id"] for seq in range(3)]
        for _ in range(3):
            assert entered.acquire(timeout=60), "a sample never reached the backend"
        refused = [
            sample(3),
            step(a, made[sa], 1),
            a.post("/create_model", json={"session_id": sa, "model_seq_id": 1, "base_model": BASE, "lora_config": {"rank": 4}}),
        ]
        for resp in refused:
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1", resp.text
            assert resp.json()["field"] == "X-API-Key", resp.text
        theirs = step(b, made[sb], 1)  # another key is not held back
        assert theirs.status_code == 200 and "error" not in _poll(b, theirs.json()["request_id"]).json()
    finally:
        gate.set()
    for rid in held_ids:
        assert _poll(a, rid).status_code == 200
    again = step(a, made[sa], 1)  # the refused seq_id was not taken: it runs now
    assert again.status_code == 200 and "error" not in _poll(a, again.json()["request_id"]).json(), again.text
    assert server.door.promises.pending(API_KEY) == 0


def test_forgetting_a_sessions_promises_reads_only_that_sessions_ids() -> None:
    """``forget`` (a session expiring, or forgotten by its key's next ``create_session``) walked every promise of
    every key: one key holding 10,000 made each other key's create_session read them all. It now reads the ids
    under the session's own id."""

    async def main() -> None:
        table = PromiseTable()
        theirs = [table.new("sample", f"big-{i % 100}:sample:0", owner="big") for i in range(10_000)]
        mine = [table.new("optim_step", "mine:train:0", owner=API_KEY), table.new("sample", "mine:sample:1", owner=API_KEY)]
        items = table._items = Counted(table._items)
        assert table.forget("mine", RuntimeError("session mine is finished")) == 2
        assert items.touched <= 4 and all(p.error is not None for p in mine)
        assert all(table.get(p.request_id) is p for p in theirs[:10])
        assert table.forget("big-7", RuntimeError("gone")) == 100 and table.get(theirs[7].request_id) is None

    anyio.run(main)
