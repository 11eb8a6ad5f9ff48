"""The door's kept results (``retrieve_future``'s promises) are bounded per API key. They were one table for every
key, trimmed to its newest 4,096 by creation order: one key's flood of samples forgot another key's finished
results (its re-poll, as after a lost answer, was a 404), an unfinished promise at the head held every finished one
after it in memory, and a result's bytes were not counted at all."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from asyncsess.serve.promises import PromiseTable

from .conftest import API_KEY, Server, start_server

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
