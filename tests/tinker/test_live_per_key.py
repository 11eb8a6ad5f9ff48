"""One API key holds at most ``max_live_per_key`` models plus open samplers on the Tinker door (as the worker caps
each key): each holds backend memory, and a key creating models without end took all of it from the other keys.
Past it, creating a model or a sampler is a 400 naming the field, before anything is made; finishing a session or
unloading a model makes room; other keys are not counted against it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
OTHER_KEY = "tml-asyncsess-live-other"
BURST_KEY = "tml-asyncsess-live-burst"
CAP = 4


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from start_server("mock://", api_keys={API_KEY, OTHER_KEY, BURST_KEY}, max_live_per_key=CAP)


class Key:
    def __init__(self, server: Server, key: str) -> None:
        self.http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=httpx.Timeout(60.0))
        self.seqs = iter(range(10**6))

    def session(self) -> str:
        return str(self.http.post("/create_session", json={"tags": [], "sdk_version": "t"}).json()["session_id"])

    def model(self, session: str) -> httpx.Response:
        body = {"session_id": session, "model_seq_id": next(self.seqs), "base_model": BASE, "lora_config": {"rank": 4}}
        resp = self.http.post("/create_model", json=body)
        if resp.status_code == 200:
            while (done := self.http.post("/retrieve_future", json={"request_id": resp.json()["request_id"]})).status_code == 408:
                pass
            assert done.status_code == 200 and "error" not in done.json(), done.text
        return resp

    def sampler(self, session: str, seq: int | None = None) -> httpx.Response:
        seq = next(self.seqs) if seq is None else seq
        body = {"session_id": session, "sampling_session_seq_id": seq, "base_model": BASE}
        return self.http.post("/create_sampling_session", json=body)


def _backend_objects(server: Server) -> int:
    mock = server.backend
    return len(mock._sessions) + len(mock._samplers)  # type: ignore[attr-defined]


def test_a_key_past_its_models_and_samplers_is_refused_and_others_are_not(server: Server) -> None:
    a, b = Key(server, API_KEY), Key(server, OTHER_KEY)
    first, second = a.session(), a.session()
    assert a.model(first).status_code == 200 and a.model(first).status_code == 200
    assert a.sampler(second).status_code == 200 and a.model(second).status_code == 200
    before = (len(server.door.models), len(server.door.samplers), _backend_objects(server))
    for resp, field in ((a.model(second), "model_seq_id"), (a.sampler(first), "sampling_session_seq_id")):
        assert resp.status_code == 400 and resp.json()["field"] == field and "most allowed" in resp.json()["error"], resp.text
    assert (len(server.door.models), len(server.door.samplers), _backend_objects(server)) == before
    theirs = b.session()
    assert all(b.model(theirs).status_code == 200 for _ in range(CAP))  # another key has its own places

    done = a.http.post(f"/sessions/{first}/finish", json={"reason": {"type": "success"}})
    assert done.status_code == 200  # its two models no longer count
    assert a.model(second).status_code == 200 and a.sampler(second).status_code == 200
    assert a.model(second).status_code == 400
    unloaded = a.http.post("/unload_model", json={"model_id": f"{second}:train:{3}"})
    assert unloaded.status_code == 200, unloaded.text
    assert a.model(second).status_code == 200


def test_samplers_being_opened_count(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend holds the first samplers being opened (a gate): a count taken of the samplers already open let
    every request that arrived meanwhile pass the cap."""
    a = Key(server, BURST_KEY)
    session = a.session()
    assert a.model(session).status_code == 200
    entered, gate, real = threading.Semaphore(0), threading.Event(), server.backend.create_sampler
    held = iter(range(CAP - 1))

    async def opening(spec: Any) -> str:
        if next(held, None) is not None:
            entered.release()
            await anyio.to_thread.run_sync(gate.wait)
        return await real(spec)

    monkeypatch.setattr(server.backend, "create_sampler", opening)
    with ThreadPoolExecutor(CAP - 1) as pool:
        try:
            opened = [pool.submit(a.sampler, session, 1000 + i) for i in range(CAP - 1)]
            for _ in opened:
                assert entered.acquire(timeout=60), "a sampler never reached the backend"
            late = a.sampler(session)
            assert late.status_code == 400 and late.json()["field"] == "sampling_session_seq_id", late.text
        finally:
            gate.set()
        assert [f.result().status_code for f in opened] == [200] * (CAP - 1)


def test_a_keys_sessions_are_bounded_live_and_finished():
    """A key creating sessions without end: past ``max_sessions_per_key`` unfinished ones a 429 naming the key; past
    ``max_finished_per_key`` finished ones its oldest without checkpoints are forgotten (404), those with one kept;
    another key's sessions are neither counted nor forgotten."""
    from asyncsess.serve.tinker_api import ApiError, TinkerDoor, caller
    from asyncsess_mock import MockBackend

    async def main() -> None:
        door = TinkerDoor(MockBackend(), session_timeout=0)
        door.max_sessions_per_key, door.max_finished_per_key = 3, 4
        async with door.running():
            caller.set("b")
            theirs = door.create_session({}, owner="b")["session_id"]
            caller.set("a")
            first = [door.create_session({}, owner="a")["session_id"] for _ in range(3)]
            with pytest.raises(ApiError) as err:
                door.create_session({}, owner="a")
            assert (err.value.status, err.value.field, (err.value.headers or {}).get("Retry-After")) == (429, "X-API-Key", "10")
            kept = door._register("m-kept", door.sessions[first[0]], "backend-kept", BASE, 4, {})
            kept.checkpoints.append("tinker://m-kept/weights/w")  # a session that left a checkpoint stays listed
            made = list(first)
            for sid in first:
                await door.finish_session(sid, {})
            for _ in range(12):
                made.append(door.create_session({}, owner="a")["session_id"])
                await door.finish_session(made[-1], {})
            mine = [s for s in door.sessions.values() if s.owner == "a"]
            assert first[0] in door.sessions and "m-kept" in door.models
            assert len(mine) == 5  # the one with a checkpoint and the four newest
            assert [s.id for s in mine if s.id != first[0]] == made[-4:]  # the newest finished ones
            with pytest.raises(ApiError) as gone:
                await door.finish_session(made[1], {})
            assert gone.value.status == 404
            assert door.create_session({}, owner="a")["session_id"]  # room again: every earlier one is finished
            caller.set("b")
            assert door.sessions[theirs].finished is None and door.owns(theirs)

    anyio.run(main)


def test_a_keys_session_calls_walk_only_its_own_sessions():
    """``sessions/search``, ``create_session`` and the live count (and ``GET /sessions``) compared every key's sessions with
    the caller on each call, so one key holding many made every other key's calls slower. The door now keeps each
    key's sessions (and their models being created) apart: another key's calls walk none of them (neither table of
    every key's is read), and the answers are as before."""
    from asyncsess.serve.tinker_api import TinkerDoor, caller
    from asyncsess_mock import MockBackend

    class Counted(dict[str, Any]):
        walks = 0

        def values(self) -> Any:
            Counted.walks += 1
            return super().values()

        def items(self) -> Any:
            Counted.walks += 1
            return super().items()

        def __iter__(self) -> Any:
            Counted.walks += 1
            return super().__iter__()

    async def main() -> None:
        door = TinkerDoor(MockBackend(), session_timeout=0)
        async with door.running():
            door.sessions, door._creating = Counted(), Counted()  # type: ignore[attr-defined]  # _creating: every key's model creates
            caller.set("crowd")
            for _ in range(50):
                crowd = door.create_session({}, owner="crowd")["session_id"]
            door.create_model({"session_id": crowd, "model_seq_id": 0, "base_model": BASE})
            caller.set("me")
            mine = [door.create_session({"display_name": f"run {i}"}, owner="me")["session_id"] for i in range(3)]
            door._live_room(mine[0], "model_seq_id")
            found = door.search_sessions({"display_name": "run"})
            assert [s["session_id"] for s in found["sessions"]] == mine[::-1]
            assert Counted.walks == 0
            assert [s.id for s in door.owned("me")] == mine and len(door.owned("crowd")) == 50

    anyio.run(main)
