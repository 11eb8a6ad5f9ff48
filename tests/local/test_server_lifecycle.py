"""Lifecycle races over HTTP: a stop while ops wait in the session answers each of them with a typed 404,
and the stopped id stays gone for ops, heartbeats and a second stop; the other tenant's session is untouched."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("torch")

from .server_helpers import KEY, MINE, OTHER, THEIRS, new_session

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    # a long gap timeout: the held ops below are answered by the stop, never by the gap giving up
    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path_factory.mktemp("life-ckpt")), gap_timeout=600)
    w = serve_in_thread(backend, [KEY, OTHER])
    w.backend = backend
    yield w
    w.stop()


def _optim(seq: int) -> dict[str, object]:
    return {"kind": "optim_step", "seq": seq, "idempotency_key": f"o{seq}", "adam_params": {"learning_rate": 1e-3}}


def test_a_stop_answers_the_ops_waiting_in_the_session_and_the_id_stays_gone(worker, c, tiny, monkeypatch):
    sid, theirs = new_session(c, tiny, MINE), new_session(c, tiny, THEIRS)
    entered = threading.Semaphore(0)
    real = worker.backend.execute_training

    async def counted(session_id, op):
        entered.release()
        return await real(session_id, op)

    monkeypatch.setattr(worker.backend, "execute_training", counted)

    def post(seq: int) -> httpx.Response:
        with httpx.Client(base_url=worker.url, timeout=900) as own:
            return own.post(f"/v1/sessions/{sid}/ops", json=_optim(seq), headers=MINE)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(post, seq) for seq in (2, 3)]  # seq 1 never comes: both wait in the session
        for _ in futures:
            assert entered.acquire(timeout=600)  # (a guard against a broken build, not a timing)
        assert c.delete(f"/v1/sessions/{sid}", headers=MINE).status_code == 204
        answers = [f.result() for f in futures]
    for r in answers:
        assert r.status_code == 404 and r.json()["error"]["type"] == "SessionGoneError", r.text
    assert c.post(f"/v1/sessions/{sid}/ops", json=_optim(1), headers=MINE).status_code == 404
    assert c.post(f"/v1/sessions/{sid}/heartbeat", headers=MINE).status_code == 404
    assert c.delete(f"/v1/sessions/{sid}", headers=MINE).status_code == 204
    r = c.post(f"/v1/sessions/{theirs}/ops", json=_optim(1), headers=THEIRS)
    assert r.status_code == 200 and r.json()["result"]["step"] == 1, r.text
