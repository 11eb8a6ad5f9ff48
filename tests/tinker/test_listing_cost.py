"""A key's listings cost only its own records. ``training_runs``, ``list_checkpoints`` and ``list_user_checkpoints``
walked every key's models or checkpoints, and ``forget_expired`` (run by every listing, load and sample by path) every
checkpoint of every key, and the session reaper (every few seconds, on the event loop) every session of every key,
so one key holding many sessions made each other key's call slow. Each now walks the caller's own (a per-key index
of its models), expiry pops only what is due from a heap of deadlines, and the reaper looks only at the sessions
least recently heard from. Counted here as the entries of the door's tables a call touches, or the sessions it
reads, with another key holding 10,000 sessions, models and checkpoints."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import tinker

from asyncsess.backends.base import SaveStateOp
from asyncsess.serve.tinker_api import _Session
from asyncsess.types import CheckpointResponse

from .conftest import API_KEY, Counted, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
BIG_KEY = "tml-asyncsess-listing-big"
N = 10_000


class Watched(_Session):
    """A session that counts the reads of its ``seen`` and ``finished``."""

    reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name in ("seen", "finished"):
            Watched.reads += 1
        return super().__getattribute__(name)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    for srv in start_server("mock://", api_keys={API_KEY, BIG_KEY}, session_timeout=0):  # no reaper walking the tables
        _fill(srv.door, BIG_KEY, N)
        yield srv


def _fill(door: Any, owner: str, n: int) -> None:
    """``n`` sessions of ``owner``'s, each with a model and a checkpoint due in an hour (built in place: fast)."""
    now = time.time()
    for i in range(n):
        s = Watched(f"big-{i}", [], {}, now, now, owner=owner, project_id="p")
        door.add_session(s)
        m = door._register(f"{s.id}:train:0", s, f"big-train-{i}", BASE, 4, {})
        save = functools.partial(SaveStateOp, name="c", ttl_seconds=3600, user_metadata=None)
        door._record(m, CheckpointResponse.model_construct(path=f"mock://big-train-{i}/weights/c", step=0), save, "weights", "training")


def test_a_keys_listings_touch_only_its_own_records(server: Server) -> None:
    door = server.door
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    tables: dict[str, Counted] = {}
    try:
        tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
        saved = [tc.save_state(name).result().path for name in ("one", "two")]
        sampler = tc.save_weights_for_sampler("s").result().path
        tables = {name: Counted(getattr(door, name)) for name in ("sessions", "models", "checkpoints")}
        for name, table in tables.items():
            setattr(door, name, table)
        session_id = tc.model_id.split(":")[0]
        calls = {
            "list_training_runs": lambda: [r.training_run_id for r in rest.list_training_runs().result().training_runs],
            "list_checkpoints": lambda: [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints],
            "list_checkpoints (session)": lambda: [c.tinker_path for c in rest.list_checkpoints(session_id).result().checkpoints],
            "list_user_checkpoints": lambda: sorted(c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints),
            "get_weights_info_by_tinker_path": lambda: rest.get_weights_info_by_tinker_path(saved[0]).result().lora_rank,
            "GET /v1/models (OpenAI)": lambda: [
                m["id"] for m in httpx.get(f"{server.url}/v1/models", headers={"X-API-Key": API_KEY}, timeout=60).json()["data"]
            ],
        }
        want = {
            "list_training_runs": [tc.model_id],
            "list_checkpoints": [*saved, sampler],
            "list_checkpoints (session)": [*saved, sampler],
            "list_user_checkpoints": sorted([*saved, sampler]),
            "get_weights_info_by_tinker_path": 4,
            "GET /v1/models (OpenAI)": [BASE, sampler],
        }
        for name, call in calls.items():
            before = sum(t.touched for t in tables.values())
            assert call() == want[name], name
            touched = sum(t.touched for t in tables.values()) - before
            assert touched < 50, f"{name} touched {touched} entries of the door's tables (the other key holds {3 * N})"
    finally:
        service.holder.close()
        for name, table in tables.items():
            setattr(door, name, dict(table))


def test_expiry_pops_only_what_is_due_and_its_heap_stays_bounded(server: Server) -> None:
    door = server.door
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    due = [ck for ck in door.checkpoints.values() if ck.model_id.startswith("big-")][:5]
    for ck in due:  # their time passes
        ck.expires_at = time.time() - 1
    checkpoints = door.checkpoints = Counted(door.checkpoints)
    try:
        for expect in (5, 0):  # then nothing is due: nothing is walked
            checkpoints.touched = 0
            rest.list_user_checkpoints().result()  # the other key's call expires what is due, and only that
            assert checkpoints.touched <= expect + 10 and not [ck for ck in due if ck.tinker_path in checkpoints]
    finally:
        door.checkpoints = dict(checkpoints)
    ck = door.checkpoints[f"tinker://big-{N - 1}:train:0/weights/c"]
    for _ in range(3 * len(door.checkpoints)):  # a TTL reset again and again leaves stale entries behind
        ck.expires_at = time.time() + 3600
    assert len(door._ttl) <= 2 * len(door.checkpoints) + 64


def test_the_reaper_reads_only_the_sessions_least_recently_heard_from(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.door, "session_timeout", 300.0)  # none is stale
    Watched.reads = 0
    assert anyio.run(server.door.reap) == []
    assert Watched.reads <= 2, f"the reaper read {Watched.reads} of the other key's {N} sessions"
