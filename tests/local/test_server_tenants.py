"""Two API keys on one worker (issue 11): on every route, one key cannot see, use, stop or probe the other's
sessions, samplers and checkpoints, and an answer never tells whether another tenant's object exists.
One key's bad requests, sent at the same time as the other's good ones, fail only themselves."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

torch = pytest.importorskip("torch")

from .server_helpers import KEY, MINE, THEIRS, assert_refused, new_sampler, new_session, send, start_worker  # noqa: E402

pytestmark = pytest.mark.local

GHOST_SESSION, GHOST_SAMPLER = "lora-000000000000", "sampler-000000000000"


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("tenants-ckpt")))
    yield w
    w.stop()


def _op(kind: str, seq: int, **kw):
    return {"kind": kind, "seq": seq, "idempotency_key": f"{kind}-{seq}", **kw}


@pytest.fixture(scope="module")
def mine(c, tiny):
    """Everything the first key owns: a session, each kind of checkpoint, and a sampler."""
    sid = new_session(c, tiny, MINE)
    paths = {}
    for seq, (kind, extra) in enumerate(
        [("save_state", {}), ("save_weights", {}), ("save_weights", {"merge_weights": True}), ("save_weights", {"ephemeral": True})],
        start=1,
    ):
        r = c.post(f"/v1/sessions/{sid}/ops", json=_op(kind, seq, **extra), headers=MINE)
        assert r.status_code == 200, r.text
        paths[r.json()["result"]["kind"] if not extra.get("ephemeral") else "ephemeral"] = r.json()["result"]["path"]
    assert set(paths) == {"state", "sampler", "merged", "ephemeral"}
    smp = new_sampler(c, MINE, model_path=paths["sampler"])
    return {"sid": sid, "smp": smp, "paths": paths}


def _same_answer(a: httpx.Response, b: httpx.Response, secret: str, ghost: str) -> None:
    """``a`` (about another tenant's real object) and ``b`` (about one that never existed) say the same."""
    assert a.status_code == b.status_code and 400 <= a.status_code < 500, (a.text, b.text)
    ea, eb = a.json()["error"], b.json()["error"]
    assert {k: _mask(str(v), secret) for k, v in ea.items()} == {k: _mask(str(v), ghost) for k, v in eb.items()}


def _mask(text: str, ident: str) -> str:
    """``text`` with ``ident`` masked, also where the message cut it short (where it is cut depends on the length
    of the checkpoint root: under pytest-xdist the temporary directory is longer)."""
    while k := next((k for k in range(len(ident), 7, -1) if ident[:k] in text), 0):
        text = text.replace(ident[:k], "X")
    return text


def _their_calls(ids: dict[str, str], tiny: str) -> list[tuple[str, str, object]]:
    """Every route that takes a session id, a sampler id or a checkpoint path, aimed at ``ids``."""
    sid, smp = ids["sid"], ids["smp"]
    return [
        ("POST", f"/v1/sessions/{sid}/heartbeat", None),
        ("POST", f"/v1/sessions/{sid}/ops", _op("optim_step", 5, adam_params={})),
        ("POST", f"/v1/sessions/{sid}/ops", _op("save_state", 5)),
        ("POST", f"/v1/samplers/{smp}/sample", {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 2}}),
        ("POST", f"/v1/samplers/{smp}/logprobs", {"tokens": [5, 6, 7]}),
        ("GET", f"/v1/checkpoints?session_id={sid}", None),
        ("POST", "/v1/chat/completions", {"model": sid, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": smp, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("POST", "/v1/responses", {"model": sid, "input": "hi", "max_output_tokens": 2}),
        ("POST", "/v1/responses", {"model": smp, "input": "hi", "max_output_tokens": 2}),
        *[("POST", "/v1/samplers", {"model_path": p}) for p in ids["paths"]],
        *[("POST", "/v1/sessions", {"base_model": tiny, "from_path": p}) for p in ids["paths"]],
        *[("POST", "/v1/sessions", {"base_model": p.removeprefix("local://")}) for p in ids["paths"]],
        *[("POST", "/v1/samplers", {"base_model": p.removeprefix("local://")}) for p in ids["paths"]],
        *[("GET", f"/v1/tokenizer?base_model={p.removeprefix('local://')}", None) for p in ids["paths"]],
        *[("POST", "/v1/chat/completions", {"model": p, "messages": [{"role": "user", "content": "hi"}]}) for p in ids["paths"]],
        *[("POST", "/v1/responses", {"model": p, "input": "hi"}) for p in ids["paths"]],
    ]


def test_the_other_key_can_use_nothing_and_learns_nothing(c, tiny, mine, worker):
    ghost = {"sid": GHOST_SESSION, "smp": GHOST_SAMPLER, "paths": [p.replace(mine["sid"], GHOST_SESSION) for p in mine["paths"].values()]}
    real = {**mine, "paths": list(mine["paths"].values())}
    theirs_sid, theirs_ghost_sid = new_session(c, tiny, THEIRS), new_session(c, tiny, THEIRS)  # a refused load uses up its seq
    calls = _their_calls(real, tiny) + [
        ("POST", f"/v1/sessions/{theirs_sid}/ops", _op("load_state", i, path=p)) for i, p in enumerate(real["paths"], 1)
    ]
    ghost_calls = _their_calls(ghost, tiny) + [
        ("POST", f"/v1/sessions/{theirs_ghost_sid}/ops", _op("load_state", i, path=p)) for i, p in enumerate(ghost["paths"], 1)
    ]
    slots = set(worker.backend.engine.slots)
    for (method, path, body), (gm, gpath, gbody) in zip(calls, ghost_calls):
        r = send(c, method, path, body, THEIRS)
        assert_refused(r, status=r.status_code)
        assert r.status_code in (400, 404), (path, body, r.text)
        g = send(c, gm, gpath, gbody, THEIRS)
        _same_answer(
            r,
            g,
            mine["sid"] if mine["sid"] in str((path, body)) else mine["smp"],
            GHOST_SESSION if mine["sid"] in str((path, body)) else GHOST_SAMPLER,
        )
    assert set(worker.backend.engine.slots) == slots  # no checkpoint was loaded as a base model
    # the lists show the other key nothing of the first key's
    listed = str(c.get("/v1/checkpoints", headers=THEIRS).json()) + str(c.get("/v1/models", headers=THEIRS).json())
    assert mine["sid"] not in listed and mine["smp"] not in listed
    # a stranger's stop is a no-op
    assert c.delete(f"/v1/sessions/{mine['sid']}", headers=THEIRS).status_code == 204
    assert c.delete(f"/v1/sessions/{mine['smp']}", headers=THEIRS).status_code == 204
    # and everything still works for its owner
    assert c.post(f"/v1/sessions/{mine['sid']}/heartbeat", headers=MINE).status_code == 204
    r = c.post(
        f"/v1/samplers/{mine['smp']}/sample", json={"prompt": [5], "num_samples": 1, "sampling_params": {"max_tokens": 2}}, headers=MINE
    )
    assert r.status_code == 200, r.text
    assert mine["sid"] in str(c.get("/v1/models", headers=MINE).json())
    for p in mine["paths"].values():
        assert new_sampler(c, MINE, model_path=p)
    assert c.post("/v1/sessions", json={"base_model": tiny, "from_path": mine["paths"]["state"]}, headers=MINE).status_code == 200


def test_a_missing_checkpoint_of_the_other_key_reads_like_an_existing_one(c, mine):
    """Probing names under another tenant's session gives one answer whether or not the checkpoint exists."""
    real = mine["paths"]["state"]
    absent = real.rsplit("/", 1)[0] + "/no-such-name"
    a, b = send(c, "POST", "/v1/samplers", {"model_path": real}, THEIRS), send(c, "POST", "/v1/samplers", {"model_path": absent}, THEIRS)
    _same_answer(a, b, real, absent)
    # the owner, and only the owner, is told that a name of theirs does not exist
    assert "no checkpoint" in assert_refused(send(c, "POST", "/v1/samplers", {"model_path": absent}, MINE), "model_path")["message"]


def test_one_keys_bad_requests_do_not_fail_the_other_keys_batch(c, tiny):
    """Sent together, so they share the engine's sampling batches: the bad ones fail alone."""
    smp_mine, smp_theirs = new_sampler(c, MINE, base_model=tiny), new_sampler(c, THEIRS, base_model=tiny)
    good = {"prompt": [5, 6], "num_samples": 2, "sampling_params": {"max_tokens": 3, "seed": 7}}
    bads = [
        {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 3, "seed": 2**64}},
        {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 3, "seed": -1}},
        {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 3, "temperature": 1e-300}},  # fine: greedy
        {"prompt": [5, 6], "num_samples": 1, "sampling_params": {"max_tokens": 3, "stop": [""]}},
        {"prompt": [5, 999], "num_samples": 1, "sampling_params": {"max_tokens": 3}},
        {"prompt": [5, 6], "num_samples": 100000, "sampling_params": {"max_tokens": 3}},
    ]

    def call(args):
        sampler, body, headers = args
        with httpx.Client(base_url=c.base_url, timeout=120) as own:
            return own.post(f"/v1/samplers/{sampler}/sample", json=body, headers=headers)

    jobs = [(smp_mine, good, MINE)] * 8 + [(smp_theirs, b, THEIRS) for b in bads] * 2
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(call, jobs))
    mine_out, theirs_out = out[:8], out[8:]
    assert all(r.status_code == 200 for r in mine_out), [r.text for r in mine_out if r.status_code != 200]
    tokens = [[s["tokens"] for s in r.json()["sequences"]] for r in mine_out]
    assert all(t == tokens[0] for t in tokens)  # same seed, same tokens, whatever it was batched with
    assert [r.status_code for r in theirs_out] == [400, 400, 200, 400, 400, 400] * 2


def test_a_snapshot_path_of_ones_own_does_not_lead_into_the_other_keys_checkpoints(c, tiny, mine, worker):
    """``local://ephemeral/<own session>/../../<their session>/state/<name>`` passed the ownership check (the
    owner was read from the text after the prefix) and then resolved on disk: load_state and from_path loaded
    the other key's weights. A snapshot path is never a path on disk, and must have the form a save gives."""
    theirs_sid = new_session(c, tiny, THEIRS)
    rel = mine["paths"]["state"].removeprefix(f"local://{worker.backend.engine.store.root}/")
    evil = [
        f"local://ephemeral/{theirs_sid}/../../{rel}",
        f"local://ephemeral/{theirs_sid}/1/../../../{rel}",
        f"local://ephemeral/{theirs_sid}/..%2F..%2F{rel}",
        f"local://ephemeral/{theirs_sid}\\..\\..\\{rel.replace('/', chr(92))}",
        f"local://ephemeral/{theirs_sid}/1/",
        f"local://ephemeral/{theirs_sid}",
    ]
    for path in evil:
        r = send(c, "POST", f"/v1/sessions/{theirs_sid}/ops", _op("load_state", worker.backend.next_seq(theirs_sid), path=path), THEIRS)
        assert_refused(r, "path")
        assert_refused(send(c, "POST", "/v1/sessions", {"base_model": tiny, "from_path": path}, THEIRS), "from_path")
        assert_refused(send(c, "POST", "/v1/samplers", {"model_path": path}, THEIRS), "model_path")
    # the refusals name the snapshot path as such, and the owner's own snapshot still opens a sampler
    r = send(
        c,
        "POST",
        f"/v1/sessions/{mine['sid']}/ops",
        _op("load_state", worker.backend.next_seq(mine["sid"]), path=mine["paths"]["ephemeral"]),
        MINE,
    )
    assert "sampler snapshot" in assert_refused(r, "path")["message"]
    assert new_sampler(c, MINE, model_path=mine["paths"]["ephemeral"])


def test_a_keys_checkpoint_bytes_are_capped_before_a_save_and_freed_by_deletes_and_overwrites(tiny, tiny_dir, tmp_path):
    """Only the number of checkpoints was capped: a key could fill the disk with merged saves (each a full model), and
    then every tenant's saves failed. Past ``max_checkpoint_bytes_per_key`` a save (its size estimated before it is
    written) is refused naming ``name`` and the fix, void: the next op runs. A save over a name frees what it replaces,
    a delete frees its bytes, and the other key saves as before."""
    base = (tiny_dir / "model.safetensors").stat().st_size
    w = start_worker(tiny, str(tmp_path), max_checkpoint_bytes_per_key=base * 3 // 2)  # one merged model, not two
    merged = {"merge_weights": True}
    try:
        with httpx.Client(base_url=w.url, timeout=120) as c:
            sid = new_session(c, tiny, MINE)
            ops = f"/v1/sessions/{sid}/ops"
            first = c.post(ops, json=_op("save_weights", 1, name="m1", **merged), headers=MINE)
            assert first.status_code == 200, first.text
            err = assert_refused(c.post(ops, json=_op("save_weights", 2, name="m2", **merged), headers=MINE), "name")
            assert err.get("void") is True and "max_checkpoint_bytes_per_key" in err["message"], err
            assert "DELETE /v1/checkpoints" in err["fix"] and "merge_weights=false" in err["fix"], err
            assert not (tmp_path / sid / "merged" / "m2").exists()
            assert c.post(ops, json=_op("save_weights", 3, name="a"), headers=MINE).status_code == 200  # not poisoned
            again = c.post(ops, json=_op("save_weights", 4, name="m1", overwrite=True, **merged), headers=MINE)
            assert again.status_code == 200, again.text  # it replaces m1: its bytes are freed
            theirs = new_session(c, tiny, THEIRS)
            r = c.post(f"/v1/sessions/{theirs}/ops", json=_op("save_weights", 1, name="m", **merged), headers=THEIRS)
            assert r.status_code == 200, r.text
            assert c.delete("/v1/checkpoints", params={"path": first.json()["result"]["path"]}, headers=MINE).status_code == 204
            r = c.post(ops, json=_op("save_weights", 5, name="m2", **merged), headers=MINE)
            assert r.status_code == 200, r.text  # the delete freed room
    finally:
        w.stop()


def test_a_keys_durable_checkpoints_are_capped_and_the_other_key_keeps_its_own(tiny, tmp_path):
    """A key could save checkpoints without limit (disk unbounded: no route deletes one). Past
    ``max_checkpoints_per_key`` a save is refused (void: its seq passes, the next op runs), a stopped session's
    checkpoints still count, a save over one of its names and an ephemeral one still go, and the other key saves
    as before; each key lists only its own."""
    w = start_worker(tiny, str(tmp_path), max_checkpoints_per_key=2)
    try:
        with httpx.Client(base_url=w.url, timeout=120) as c:
            first = new_session(c, tiny, MINE)
            ops = f"/v1/sessions/{first}/ops"
            assert c.post(ops, json=_op("save_state", 1, name="a"), headers=MINE).status_code == 200
            c.delete(f"/v1/sessions/{first}", headers=MINE)
            sid = new_session(c, tiny, MINE)
            ops = f"/v1/sessions/{sid}/ops"
            assert c.post(ops, json=_op("save_weights", 1, name="b"), headers=MINE).status_code == 200
            err = assert_refused(c.post(ops, json=_op("save_state", 2, name="c"), headers=MINE), "name")
            assert err.get("void") is True and "2 checkpoints" in err["message"], err
            assert c.post(ops, json=_op("save_weights", 3, name="b", overwrite=True), headers=MINE).status_code == 200
            assert c.post(ops, json=_op("save_weights", 4, ephemeral=True), headers=MINE).status_code == 200
            assert_refused(c.post(ops, json=_op("save_weights", 5), headers=MINE), "name")  # an unnamed one too
            theirs = new_session(c, tiny, THEIRS)
            r = c.post(f"/v1/sessions/{theirs}/ops", json=_op("save_state", 1, name="c"), headers=THEIRS)
            assert r.status_code == 200, r.text
            mine = c.get("/v1/checkpoints", headers=MINE).json()
            assert sorted(x["checkpoint_id"] for x in mine) == sorted([f"{first}/state/a", f"{sid}/sampler/b"])
            assert [x["checkpoint_id"] for x in c.get("/v1/checkpoints", headers=THEIRS).json()] == [f"{theirs}/state/c"]
            # a checkpoint is freed by deleting it (no route did): only by its owner, and a save then goes
            path = next(x["path"] for x in mine if x["checkpoint_id"].endswith("/state/a"))
            foreign = c.delete("/v1/checkpoints", params={"path": path}, headers=THEIRS)
            assert foreign.status_code == 400 and "for this API key" in foreign.json()["error"]["message"]
            assert c.delete("/v1/checkpoints", params={"path": path}, headers=MINE).status_code == 204
            assert c.post(ops, json=_op("save_state", 6, name="c"), headers=MINE).status_code == 200
        import anyio

        from asyncsess import ServiceClient

        async def by_client() -> list[str]:  # the http:// client deletes too (it raised UnsupportedError)
            async with ServiceClient(w.url, api_key=KEY, heartbeat_interval=0) as svc:
                await svc.delete_checkpoint(path.replace(first, sid).replace("/state/a", "/state/c"))  # the save at seq 6
                return [x.checkpoint_id for x in await svc.list_checkpoints()]

        assert anyio.run(by_client) == [f"{sid}/sampler/b"]
    finally:
        w.stop()


def test_a_save_counts_again_only_its_own_sessions_checkpoints(c, tiny, worker, monkeypatch):
    """Each durable save counted the checkpoints of every session its key ever saved from, on the event loop (a key
    of 4,096 sessions: ~8,000 directory scans, ~0.1 s of every tenant's calls per save). A session's count is kept, and
    taken again only after it saves or one of its checkpoints is deleted."""
    import os

    sessions = [new_session(c, tiny, MINE) for _ in range(3)]
    for sid in sessions:
        assert c.post(f"/v1/sessions/{sid}/ops", json=_op("save_state", 1, name="x"), headers=MINE).status_code == 200
    scanned: list[str] = []
    scandir = os.scandir

    def counting(path):  # (the worker's thread calls it too)
        scanned.extend(s for s in sessions if s in str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counting)
    r = c.post(f"/v1/sessions/{sessions[0]}/ops", json=_op("save_state", 2, name="y"), headers=MINE)
    assert r.status_code == 200, r.text
    assert set(scanned) == {sessions[2]}  # the one whose checkpoints changed since the last count; the others' are kept
    ids = {x["checkpoint_id"] for x in c.get("/v1/checkpoints", headers=MINE).json()}
    assert {f"{s}/state/x" for s in sessions} | {f"{sessions[0]}/state/y"} <= ids
