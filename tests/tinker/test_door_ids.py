"""One sampling session id names one sampler. ``create_sampling_session`` and an ephemeral
``save_weights_for_sampler`` both number samplers by the session's ``sampling_session_seq_id``: a second sampler
under a used number replaced the first in the door's registry, listed it twice in its session and left it open on the
backend for good; a ``create_sampling_session`` re-sent with another body got the first sampler silently. And the SDK
numbers an ephemeral save's sampler anew each time it retries the request (same ``seq_id``), so a retry after a lost
answer was a 409, which it retried for five minutes. And a model id, once unloaded, names no model for ops."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from start_server("mock://")


class Wire:
    def __init__(self, server: Server) -> None:
        self.http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=httpx.Timeout(60.0))
        self.session = self.http.post("/create_session", json={"tags": [], "sdk_version": "t"}).json()["session_id"]
        made = self.http.post("/create_model", json={"session_id": self.session, "model_seq_id": 0, "base_model": BASE})
        self.model = made.json()["model_id"]
        assert "error" not in self.result(made)

    def result(self, resp: httpx.Response) -> Any:
        assert resp.status_code == 200, resp.text
        while True:  # a long-poll: 408 means not done yet
            got = self.http.post("/retrieve_future", json={"request_id": resp.json()["request_id"]})
            if got.status_code != 408:
                assert got.status_code == 200, got.text
                return got.json() if got.headers["content-type"].startswith("application/json") else got.content

    def sampler(self, seq: int, **source: str) -> httpx.Response:
        return self.http.post("/create_sampling_session", json={"session_id": self.session, "sampling_session_seq_id": seq, **source})

    def ephemeral(self, seq: int, sampler_seq: int) -> httpx.Response:
        body = {"model_id": self.model, "seq_id": seq, "sampling_session_seq_id": sampler_seq, "kind": "snapshot"}
        return self.http.post("/save_weights_for_sampler", json=body)

    def sample(self, sampler: str, seq: int) -> Any:
        body = {"sampling_session_id": sampler, "seq_id": seq, "prompt": PROMPT, "sampling_params": {"max_tokens": 2, "seed": 1}}
        return self.result(self.http.post("/asample", json=body))

    def step(self, seq: int) -> Any:
        return self.result(
            self.http.post("/optim_step", json={"model_id": self.model, "seq_id": seq, "adam_params": {"learning_rate": 0.01}})
        )


def _open_on_backend(server: Server) -> int:
    return len(server.backend._samplers)  # type: ignore[attr-defined]


def test_an_ephemeral_save_under_a_used_sampler_number_is_refused_and_the_model_goes_on(server: Server) -> None:
    w = Wire(server)
    first = w.sampler(5, base_model=BASE)
    assert first.status_code == 200, first.text
    sid = first.json()["sampling_session_id"]
    before = _open_on_backend(server)
    refused = w.ephemeral(1, 5)
    assert refused.status_code == 409 and refused.json()["field"] == "sampling_session_seq_id", refused.text
    assert "error" not in w.step(2)  # its turn was used up: the model's next op runs
    assert server.door.sessions[w.session].samplers == [sid] and _open_on_backend(server) == before
    assert isinstance(w.sample(sid, 0), bytes)  # the first sampler is still the one under its id


def test_create_sampling_session_under_a_number_in_use_is_a_409_and_a_resend_gets_the_same(server: Server) -> None:
    w = Wire(server)
    made = w.ephemeral(1, 7)
    sid = w.result(made)["sampling_session_id"]
    before = _open_on_backend(server)
    clash = w.sampler(7, base_model=BASE)
    assert clash.status_code == 409 and clash.json()["field"] == "sampling_session_seq_id", clash.text
    assert _open_on_backend(server) == before and server.door.sessions[w.session].samplers == [sid]
    mine = w.sampler(8, base_model=BASE)
    again = w.sampler(8, base_model=BASE)  # a re-sent request (the SDK retries after a lost answer)
    assert again.status_code == 200 and again.json() == mine.json()
    other = w.sampler(8, base_model="mock/other")
    assert other.status_code == 409 and other.json()["field"] == "sampling_session_seq_id", other.text
    assert server.door.samplers[mine.json()["sampling_session_id"]].base_model == BASE


def test_a_retried_ephemeral_save_with_a_new_sampler_number_gets_the_first_future(server: Server) -> None:
    w = Wire(server)
    before = _open_on_backend(server)
    first = w.ephemeral(1, 3)
    retry = w.ephemeral(1, 4)  # the SDK's retry of the same request: the same seq_id, the next sampler number
    assert retry.status_code == 200 and retry.json()["request_id"] == first.json()["request_id"], retry.text
    sid = w.result(retry)["sampling_session_id"]
    assert sid.endswith(":sample:3") and isinstance(w.sample(sid, 0), bytes)
    assert _open_on_backend(server) == before + 1  # the one save's sampler, no second
    assert server.door.sessions[w.session].samplers == [sid]


def test_an_op_on_an_unloaded_model_is_a_410_before_its_turn(server: Server) -> None:
    """It was queued, took its seq_id and failed when run as a ``server`` error (``SessionGoneError: session
    unloaded``); a second unload stopped the backend session again."""
    w = Wire(server)
    assert "error" not in w.step(1)
    calls = server.backend.calls["stop_session"]  # type: ignore[attr-defined]
    for _ in range(2):
        gone = w.http.post("/unload_model", json={"model_id": w.model})
        assert w.result(gone) == {"model_id": w.model, "type": "unload_model"}
    assert server.backend.calls["stop_session"] == calls + 1  # type: ignore[attr-defined]
    for resp in (
        w.http.post("/optim_step", json={"model_id": w.model, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}),
        w.http.post("/save_weights", json={"model_id": w.model, "seq_id": 2, "path": "after"}),
    ):
        assert resp.status_code == 410 and resp.json()["field"] == "model_id" and "unloaded" in resp.json()["error"], resp.text
    assert w.http.post("/get_info", json={"model_id": w.model}).status_code == 200  # its records stay readable


def test_a_snapshot_path_of_a_forgotten_session_is_a_404_not_a_500(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's finished sessions past ``max_finished_per_key`` are forgotten with their models, but the backend path
    of an ephemeral snapshot (``mock://mock-train-<n>/sampler_weights/ephemeral-<seq>``: predictable) still named the
    forgotten model: naming it in ``create_sampling_session`` or ``load_weights`` was a KeyError, a 500. It is now the
    404 of a path never issued."""
    w = Wire(server)
    assert w.result(w.ephemeral(1, 0))["sampling_session_id"]
    [path] = [p for p, m in server.door._backend_paths.items() if m == w.model]
    assert w.http.post(f"/sessions/{w.session}/finish", json={}).status_code == 200
    monkeypatch.setattr(server.door, "max_finished_per_key", 1)
    other = Wire(server)  # its create_session forgets the finished session
    assert w.session not in server.door.sessions
    load = {"session_id": other.session, "model_seq_id": 1, "path": path, "optimizer": False}
    for resp, field in ((other.sampler(0, model_path=path), "model_path"), (other.http.post("/load_weights", json=load), "path")):
        assert resp.status_code == 404 and resp.json()["field"] == field, resp.text


def test_a_samplers_resend_records_are_bounded_by_count(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler forgot its re-send record of ``seq_id`` n only at ``n + 1024``, so scattered ``seq_id`` s (1, 10**6,
    2*10**6, ...) grew it without end. It now keeps the ``keep_seqs`` most recently received, and a re-sent recent one
    (the SDK's retry, same ``seq_id`` and body) still gets its first request id."""
    monkeypatch.setattr(server.door, "keep_seqs", 4)
    w = Wire(server)
    sid = w.sampler(0, base_model=BASE).json()["sampling_session_id"]

    def send(seq: int) -> str:
        body = {"sampling_session_id": sid, "seq_id": seq, "prompt": PROMPT, "sampling_params": {"max_tokens": 2, "seed": 1}}
        resp = w.http.post("/asample", json=body)
        assert isinstance(w.result(resp), bytes)  # a sample result (protobuf)
        return str(resp.json()["request_id"])

    first = [send(1 + k * 10**6) for k in range(12)]
    assert len(server.door.samplers[sid].ids) == 4
    assert send(11 * 10**6 + 1) == first[-1]  # a retry of the newest: the same request, not a second sample


def test_the_records_of_gone_backend_paths_are_bounded_per_key(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The door remembers the backend paths of deleted checkpoints and of forgotten sessions' snapshots (so neither
    reaches the backend), but never trimmed either: a key saving, deleting and finishing without end grew both for
    good. Each now keeps a key's newest ``max_*_paths_per_key`` (the recent ones stay 404s), and a forgotten session's
    snapshots are deleted on the backend too, so an older path names nothing there: a 4xx, never a sample."""
    door, backend = server.door, server.backend
    for name, cap in (("max_finished_per_key", 1), ("max_forgotten_paths_per_key", 2), ("max_deleted_paths_per_key", 2)):
        monkeypatch.setattr(door, name, cap, raising=False)
    snapshots: list[str] = []
    for _ in range(4):
        w = Wire(server)  # its create_session forgets the previous finished session
        assert w.result(w.ephemeral(1, 0))["sampling_session_id"]
        snapshots += [p for p, m in door._backend_paths.items() if m == w.model]
        assert "path" in w.result(w.http.post("/save_weights", json={"model_id": w.model, "seq_id": 2, "path": "c"}))
        assert w.http.delete(f"/training_runs/{w.model}/checkpoints/weights/c").status_code < 300
        assert w.http.post(f"/sessions/{w.session}/finish", json={}).status_code == 200
    other = Wire(server)  # forgets the fourth
    assert len(snapshots) == 4 and not [p for p, m in door._backend_paths.items() if m not in door.models]
    assert len(door._dropped) <= 2 and len(door._forgotten) <= 2
    assert not set(snapshots) & set(backend._checkpoints)  # type: ignore[attr-defined]
    opened = len(backend._samplers)  # type: ignore[attr-defined]
    for seq, path in enumerate(snapshots, start=10):
        resp = other.sampler(seq, model_path=path)
        assert resp.status_code in (400, 404) and resp.json()["field"] == "model_path", resp.text
        if path in snapshots[-2:]:  # still remembered: the 404 of a path never issued
            assert resp.status_code == 404, resp.text
    assert len(backend._samplers) == opened  # type: ignore[attr-defined]


def test_a_gone_backend_path_stays_a_404_after_its_record_is_evicted(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a key's bound on the records of gone paths, an older one was not recognised: it reached the backend, and
    mock:// answered 400 (the SDK's ``BadRequestError``) where the official SDK expects the 404 of a path never issued.
    Now a deleted checkpoint of a model the door holds needs no record (a path naming the model that is not one of its
    live ones is a 404, the backend never asked), a forgotten session is remembered by its model's backend id (one
    record, not one per snapshot), and an evicted one reaches the backend, whose not-found is a 404 too."""
    import tinker

    door, backend = server.door, server.backend
    for name in ("max_finished_per_key", "max_forgotten_paths_per_key", "max_deleted_paths_per_key"):
        monkeypatch.setattr(door, name, 1)
    state: list[str] = []  # training-state paths of deleted checkpoints
    sampler: list[str] = []  # sampler-weights paths: snapshots of forgotten sessions, deleted sampler saves
    for _ in range(3):
        w = Wire(server)  # its create_session forgets the previous finished session
        assert w.result(w.ephemeral(1, 0))["sampling_session_id"]
        sampler += [p for p, m in door._backend_paths.items() if m == w.model]
        assert "path" in w.result(w.http.post("/save_weights", json={"model_id": w.model, "seq_id": 2, "path": "c"}))
        state.append(door.checkpoints[f"tinker://{w.model}/weights/c"].backend_path)
        assert w.http.delete(f"/training_runs/{w.model}/checkpoints/weights/c").status_code < 300
        assert w.http.post(f"/sessions/{w.session}/finish", json={}).status_code == 200
    held = Wire(server)  # forgets the third; holds a model whose saves it deletes
    for seq, name in enumerate(("d1", "d2", "d3"), start=1):
        body = {"model_id": held.model, "seq_id": seq, "path": name}
        assert "path" in held.result(held.http.post("/save_weights_for_sampler", json=body))
        sampler.append(door.checkpoints[f"tinker://{held.model}/sampler_weights/{name}"].backend_path)
        assert held.http.delete(f"/training_runs/{held.model}/checkpoints/sampler_weights/{name}").status_code < 300
    assert door._dropped.held(API_KEY) == 0 and door._forgotten.held(API_KEY) == 1  # O(1) for all of the above

    opened = backend.calls["create_sampler"]  # type: ignore[attr-defined]
    for seq, path in enumerate(sampler, start=10):  # over raw HTTP: the SDK sends only tinker:// paths here
        resp = held.sampler(seq, model_path=path)
        assert resp.status_code == 404 and resp.json()["field"] == "model_path", resp.text
    # only the two evicted snapshots were asked of the backend (which deleted them); nothing was opened
    assert backend.calls["create_sampler"] == opened + 2  # type: ignore[attr-defined]
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        tc = service.create_lora_training_client(base_model=BASE, rank=4)
        for path in state + sampler:
            with pytest.raises(tinker.NotFoundError, match="path"):
                tc.load_state(path).result()
        tc.optim_step(tinker.types.AdamParams(learning_rate=0.01)).result()  # refused loads used up their turns
    finally:
        service.holder.close()


def test_a_forgotten_session_leaves_none_of_its_ids_in_the_doors_tables(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ephemeral refresh's sampling session id was kept in a door-wide table that forgetting the session did not
    trim (a released sampler is no longer in its session's list), so a server whose clients refresh their sampler
    every step grew it for good. The ids taken now go with their session."""
    door = server.door
    monkeypatch.setattr(door, "max_samplers", 1)
    w = Wire(server)
    for k in range(4):  # the first three are released
        assert w.result(w.ephemeral(k + 1, k))["sampling_session_id"]
    assert w.http.post(f"/sessions/{w.session}/finish", json={}).status_code == 200
    monkeypatch.setattr(door, "max_finished_per_key", 1)
    Wire(server)  # its create_session forgets the finished one
    assert w.session not in door.sessions
    tables = [v for v in vars(door).values() if isinstance(v, (dict, set))]
    assert [k for t in tables for k in t if isinstance(k, str) and k.startswith(w.session)] == []


def test_a_long_run_of_sampler_refreshes_keeps_a_bounded_record_of_sampler_ids(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session refreshing its sampler every step (``save_weights_and_get_sampling_client``) kept every id it took
    for the session's life. Once a released id's record (its 410) is gone, so is its number: a key's sessions hold
    at most ``KEEP_RELEASED`` released ids plus their open samplers."""
    from asyncsess.serve import tinker_api

    monkeypatch.setattr(server.door, "max_samplers", 1)
    monkeypatch.setattr(tinker_api, "KEEP_RELEASED", 2)
    w = Wire(server)
    for k in range(8):
        assert w.result(w.ephemeral(k + 1, k))["sampling_session_id"]
    assert sorted(server.door.sessions[w.session].sampler_ids) == [f"{w.session}:sample:{k}" for k in (5, 6, 7)]
    assert isinstance(w.sample(f"{w.session}:sample:7", 0), bytes)
    assert w.http.get(f"/samplers/{w.session}:sample:6").status_code == 410  # still said why
