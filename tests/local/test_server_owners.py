"""The worker's owner table (``tenants.Owners``) stays bounded: a stopped sampler, and a stopped session that left no
checkpoint, are forgotten, and the journal ``.owners.jsonl`` is rewritten once forgotten sessions make up most of it.
Before, the table kept every session, sampler and weights path ever made, and the journal a line per session ever
made. A stopped session with a checkpoint is kept, journal and restart included: its tenant still owns the files."""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")

from .server_helpers import KEY, MINE, OTHER  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]


@pytest.fixture
async def worker(tiny: str, tmp_path):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import create_app

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "ckpt"))
    app = create_app(backend, [KEY, OTHER], session_timeout=None)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as c:
            yield app, c, backend


async def _new(c: httpx.AsyncClient, path: str, body: dict, key: str | None = None) -> str:
    r = await c.post(path, json=body, headers={**MINE, **({"Idempotency-Key": key} if key else {})})
    assert r.status_code == 200, r.text
    return r.json().get("model_id") or r.json()["sampler_id"]


async def test_a_thousand_create_and_delete_cycles_leave_the_owner_table_and_its_journal_bounded(worker, tiny, monkeypatch):
    from asyncsess_local import tenants
    from asyncsess_local.server import create_app
    from asyncsess_local.tenants import Owners

    monkeypatch.setattr(tenants, "COMPACT_SLACK", 8)  # compacted within the 50 sessions made here (64 by default)

    app, c, backend = worker
    owners, journal = app.state.owners, backend.engine.store.root / ".owners.jsonl"
    session = {"base_model": tiny, "rank": 1, "seed": 0, "train_mlp": False, "train_unembed": False}  # a cheap adapter
    kept = await _new(c, "/v1/sessions", session)
    op = {"kind": "save_state", "seq": 1, "idempotency_key": "s1", "name": "keep"}
    assert (await c.post(f"/v1/sessions/{kept}/ops", json=op, headers=MINE)).status_code == 200
    assert (await c.delete(f"/v1/sessions/{kept}", headers=MINE)).status_code == 204
    for i in range(1000):  # one session in 20 (a session costs ~10 ms, a sampler ~2 ms here)
        path, body = ("/v1/sessions", session) if i % 20 == 0 else ("/v1/samplers", {"base_model": tiny})
        made = await _new(c, path, body, key=f"cycle-{i}")
        assert (await c.delete(f"/v1/sessions/{made}", headers=MINE)).status_code == 204
        assert len(owners.by_id) <= 2
    assert set(owners.by_id) == {kept} and owners.durable == {kept}
    lines = journal.read_text().splitlines()
    assert len(lines) <= 2 + 8 and json.loads(lines[0])["id"] == kept  # 51 lines before
    assert Owners(journal).by_id[kept] == owners.by_id[kept]  # a restarted worker knows whose checkpoint it is
    listed = (await c.get("/v1/checkpoints", headers=MINE)).json()
    assert len(listed) == 1 and kept in str(listed[0]), listed  # still its tenant's

    with journal.open("a") as f:  # a journal of an older worker: a line for a session that left nothing
        f.write(json.dumps({"id": "lora-000000000000", "tenant": "t"}) + "\n")
    restarted = create_app(backend, [KEY])  # it forgets the journal's sessions that left nothing, and compacts it
    assert set(restarted.state.owners.by_id) == {kept} and len(journal.read_text().splitlines()) == 1


def test_a_sessions_saves_are_one_entry_that_tells_each_save_apart_and_goes_with_the_session(tmp_path):
    """The weights a session's OpenAI ``model`` serves: its latest save, told apart from the one before even when both
    have one path (a save over one name); one entry per session, whatever the number of saves."""
    from asyncsess_local.tenants import Owners

    owners = Owners(tmp_path / ".owners.jsonl")
    for step in range(1000):
        owners.saved_weights("s", f"local://ephemeral/s/{step}")
    before = owners.latest_weights["s"]
    owners.saved_weights("s", "local://ephemeral/s/999")
    assert owners.latest_weights == {"s": ("local://ephemeral/s/999", 1001)} and before != owners.latest_weights["s"]
    owners.forget("s")
    assert owners.latest_weights == {}
