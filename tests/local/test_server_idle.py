"""Idle expiry: a client that crashed or was killed never stops what it opened; the worker stops the sessions and
samplers no request (heartbeats included) touched for ``session_timeout`` seconds, freeing its key's places. Before,
they stayed loaded for good. The worker's clock is a fake one the test moves; the reaper is called directly."""

from __future__ import annotations

import httpx
import pytest

from .server_helpers import KEY, MINE, OTHER, THEIRS, assert_refused

pytestmark = [pytest.mark.local, pytest.mark.anyio]
TTL = 600.0


@pytest.fixture
async def worker(tiny: str, tmp_path):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import create_app

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "ckpt"))
    app = create_app(backend, [KEY, OTHER], session_timeout=TTL, max_live_per_key=2)
    now = [0.0]
    app.state.idle.clock = lambda: now[0]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as c:
            yield app, c, now


def _op(seq: int) -> dict:
    datum = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}}
    return {"kind": "forward_backward", "seq": seq, "idempotency_key": f"k{seq}", "loss_fn": "cross_entropy", "data": [datum]}


async def _new(c: httpx.AsyncClient, path: str, body: dict, headers: dict) -> str:
    r = await c.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json().get("model_id") or r.json()["sampler_id"]


async def test_what_a_gone_client_left_is_stopped_after_the_ttl_and_a_live_one_is_kept(worker, tiny):
    app, c, now = worker
    dead = await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE)
    dead_sampler = await _new(c, "/v1/samplers", {"base_model": tiny}, MINE)
    live = await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, THEIRS)
    assert (await c.post(f"/v1/sessions/{live}/ops", json=_op(1), headers=THEIRS)).status_code == 200
    now[0] = TTL - 1
    assert await app.state.reap_idle() == []  # nothing is idle for the whole ttl yet
    assert (await c.post(f"/v1/sessions/{live}/heartbeat", headers=THEIRS)).status_code == 204
    stranger = await c.post(f"/v1/sessions/{dead}/heartbeat", headers=THEIRS)  # another key cannot keep it alive
    assert stranger.status_code == 404 and stranger.json()["error"]["type"] == "SessionGoneError", stranger.text
    now[0] = TTL + 100
    assert sorted(await app.state.reap_idle()) == sorted([dead, dead_sampler])
    for r in (
        await c.post(f"/v1/sessions/{dead}/ops", json=_op(1), headers=MINE),
        await c.post(f"/v1/sessions/{dead}/heartbeat", headers=MINE),
        await c.post(f"/v1/samplers/{dead_sampler}/sample", json={"prompt": [5, 6], "sampling_params": {"max_tokens": 2}}, headers=MINE),
    ):
        assert r.status_code == 404 and r.json()["error"]["type"] == "SessionGoneError", r.text
    assert (await c.post(f"/v1/sessions/{live}/ops", json=_op(2), headers=THEIRS)).status_code == 200  # untouched
    assert await app.state.reap_idle() == []  # each is stopped once


async def test_an_expired_session_frees_its_keys_place(worker, tiny):
    app, c, now = worker
    await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE)
    await _new(c, "/v1/samplers", {"base_model": tiny}, MINE)
    r = await c.post("/v1/sessions", json={"base_model": tiny, "rank": 2, "seed": 0}, headers=MINE)
    assert_refused(r, "base_model")  # max_live_per_key=2
    now[0] = TTL
    assert len(await app.state.reap_idle()) == 2
    await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE)


async def test_openai_calls_on_a_sampler_or_session_keep_it_alive(worker, tiny):
    """An agent that samples a key's sampler or session only through the OpenAI routes (``model`` = its id) is using
    it: those calls touched no idle clock, so the reaper stopped the sampler the agent was calling every
    ``session_timeout`` seconds. Another key naming the id keeps nothing alive."""
    app, c, now = worker
    smp = await _new(c, "/v1/samplers", {"base_model": tiny}, MINE)
    sid = await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE)
    now[0] = TTL - 1
    for model in (smp, sid):
        r = await c.post("/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 2}, headers=MINE)
        assert r.status_code == 200, r.text
    now[0] = TTL + 100
    assert await app.state.reap_idle() == []  # each was used TTL - 1 s in
    now[0] = 2 * TTL - 2
    for model in (smp, sid):
        r = await c.post("/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 2}, headers=THEIRS)
        assert r.status_code == 404, r.text
    now[0] = 2 * TTL
    assert sorted(await app.state.reap_idle()) == sorted([smp, sid])


def test_a_request_in_flight_keeps_its_object_alive_past_the_ttl():
    from asyncsess_local.idle import IdleClock

    now = [0.0]
    idle = IdleClock(10.0, clock=lambda: now[0])
    idle.touch("a")
    idle.touch("b")
    with idle.using("a"):  # an op that runs for longer than the ttl
        now[0] = 50.0
        assert idle.expired(["a", "b", "untracked"]) == ["b"]
    assert idle.expired(["a"]) == []  # touched when the op ended
    now[0] = 60.0
    assert idle.expired(["a"]) == ["a"]
    assert IdleClock(0).expired(["a"]) == [] and IdleClock(None).ttl is None
    for bad in (float("nan"), float("inf"), -1.0, "600"):
        with pytest.raises(ValueError, match="session_timeout"):
            IdleClock(bad)  # type: ignore[arg-type]


def test_the_worker_refuses_a_bad_ttl_before_it_starts(tiny, tmp_path):
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import create_app

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="session_timeout"):
        create_app(backend, [KEY], session_timeout=float("nan"))


async def test_what_expires_leaves_the_owner_table_and_a_retired_sampler_expires_too(tiny, tmp_path):
    """A sampler whose snapshot a newer one retired (``retain_snapshots``) is no live sampler: the reaper never saw it,
    and its owner entry stayed for good when its client never stopped it. Now it expires with the rest, and every
    expired object leaves the owner table."""
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import create_app

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "ckpt"), retain_snapshots=1)
    app = create_app(backend, [KEY], session_timeout=TTL)
    now = [0.0]
    app.state.idle.clock = lambda: now[0]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as c:
            sid = await _new(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE)
            samplers = []
            for seq in (1, 2):
                op = {"kind": "save_weights", "seq": seq, "idempotency_key": f"w{seq}", "ephemeral": True}
                r = await c.post(f"/v1/sessions/{sid}/ops", json=op, headers=MINE)
                assert r.status_code == 200, r.text
                samplers.append(await _new(c, "/v1/samplers", {"model_path": r.json()["result"]["path"]}, MINE))
            retired, live = samplers
            assert retired not in backend.engine.samplers and live in backend.engine.samplers
            now[0] = TTL
            assert sorted(await app.state.reap_idle()) == sorted([sid, retired, live])
            assert app.state.owners.by_id == {} and app.state.owners.latest_weights == {}
            r = await c.post(f"/v1/samplers/{retired}/sample", json={"prompt": [5, 6], "sampling_params": {"max_tokens": 2}}, headers=MINE)
            assert r.status_code == 404, r.text
