"""Save / resume: bit-exact with the optimizer, fresh moments without it, across backend instances."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.backends import SamplerSpec, TrainingSessionSpec
from asyncsess.errors import ConflictError, InvalidInputError
from asyncsess.types import AdamParams
from asyncsess_mock import MockBackend

HP = AdamParams(learning_rate=0.05, weight_decay=0.01)


def _batches(tok, datum):
    texts = ["abc abc abd", "the cat sat", "xyz xyz", "hello there"]
    return [(datum(tok.encode(t)),) for t in texts]


async def _train(session, batches):
    for data in batches:
        await session.run("forward_backward", data=data, loss_fn="cross_entropy")
        await session.run("optim_step", adam_params=HP)


@pytest.mark.anyio
async def test_resume_with_optimizer_is_bit_exact_and_weights_only_starts_fresh(open_session, datum):
    b = MockBackend()
    batches = _batches(b.tokenizer, datum)
    straight = await open_session(b)
    await _train(straight, batches)

    first = await open_session(b)
    await _train(first, batches[:2])
    saved = await first.run("save_state", name="half")
    assert saved.path == f"mock://{first.id}/weights/half" and saved.kind == "state" and saved.step == 2

    other = MockBackend()  # another ServiceClient in the same process
    resumed = await other.create_training_session(TrainingSessionSpec("", from_path=saved.path, with_optimizer=True))
    assert resumed.step == 2 and resumed.base_model == "mock/bigram-tiny"
    m, v, step = other.optimizer_state(resumed.model_id)
    m0, v0, _ = b.optimizer_state(first.id)
    assert step == 2 and np.array_equal(m, m0) and np.array_equal(v, v0)
    r = await open_session(other, from_path=saved.path, with_optimizer=True)
    await _train(r, batches[2:])
    np.testing.assert_array_equal(other.weights(r.id), b.weights(straight.id))
    assert other.optimizer_state(r.id)[2] == 4

    w = await open_session(other, from_path=saved.path)  # weights only
    m, v, step = other.optimizer_state(w.id)
    assert step == 0 and not m.any() and not v.any()
    np.testing.assert_array_equal(other.weights(w.id), b.weights(first.id))
    await _train(w, batches[2:])
    assert not np.array_equal(other.weights(w.id), b.weights(straight.id))

    for backend, sid in [(b, straight.id), (b, first.id), (other, resumed.model_id), (other, r.id), (other, w.id)]:
        await backend.stop_session(sid)


@pytest.mark.anyio
async def test_load_state_op_with_and_without_optimizer(open_session, datum):
    b = MockBackend()
    batches = _batches(b.tokenizer, datum)
    s = await open_session(b)
    await _train(s, batches[:1])
    saved = await s.run("save_state")
    assert saved.path == f"mock://{s.id}/weights/000003"  # default name: the op's seq
    snapshot = b.weights(s.id), b.optimizer_state(s.id)
    await _train(s, batches[1:])
    loaded = await s.run("load_state", path=saved.path, with_optimizer=True)
    assert loaded.step == 1
    np.testing.assert_array_equal(b.weights(s.id), snapshot[0])
    np.testing.assert_array_equal(b.optimizer_state(s.id)[0], snapshot[1][0])
    loaded = await s.run("load_state", path=saved.path, with_optimizer=False)
    assert loaded.step == 0 and not b.optimizer_state(s.id)[0].any()
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_sampler_weights_list_checkpoints_and_errors(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    await _train(s, _batches(b.tokenizer, datum)[:1])
    named = await s.run("save_weights", name="for-eval")
    merged = await s.run("save_weights", name="merged", merge_weights=True)
    eph = await s.run("save_weights", ephemeral=True)
    state = await s.run("save_state", name="ckpt")
    assert named.path == f"mock://{s.id}/sampler_weights/for-eval" and named.kind == "sampler"
    assert merged.kind == "merged"
    listed = await b.list_checkpoints(s.id)
    assert sorted((c.checkpoint_id, c.checkpoint_type) for c in listed) == [
        ("sampler_weights/for-eval", "sampler"),
        ("sampler_weights/merged", "merged"),
        ("weights/ckpt", "training"),
    ]
    assert eph.path not in {c.path for c in await b.list_checkpoints()}
    assert all(c.step == 1 and c.size_bytes for c in listed)

    sampler = await b.create_sampler(SamplerSpec(model_path=state.path))  # state paths sample too
    await b.stop_session(sampler)
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec("mock/bigram-tiny", from_path=named.path))
    assert err.value.field == "from_path"
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec("mock/bigram-tiny", from_path="mock://nope/weights/x"))
    assert err.value.field == "from_path"
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec("other-model", from_path=state.path))
    assert err.value.field == "base_model"
    with pytest.raises(InvalidInputError) as err:
        await b.create_sampler(SamplerSpec(model_path="mock://nope/sampler_weights/x"))
    assert err.value.field == "model_path"
    with pytest.raises(ConflictError) as err:
        await s.run("save_state", name="ckpt")
    assert err.value.field == "overwrite"
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_a_taken_name_is_refused_before_numbering_even_one_the_backend_chose():
    """The backend judges a save's name while the client numbers it (``precheck``): a name that holds a checkpoint
    is refused naming ``overwrite`` and takes no seq, though this client never saved that name itself."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        auto = await tc.save_state()  # named by the backend
        name = auto.path.rsplit("/", 1)[1]
        before = tc.current_sequence_number
        with pytest.raises(ConflictError) as err:
            tc.save_state(name)
        assert err.value.field == "overwrite" and "overwrite=True" in (err.value.fix or "")
        assert tc.current_sequence_number == before
        await tc.optim_step(HP)
        replaced = await tc.save_state(name, overwrite=True)
        assert (replaced.path, replaced.step) == (auto.path, 1)


@pytest.mark.anyio
async def test_an_unnamed_save_never_clashes_with_a_name_the_user_chose():
    """The backend names an unnamed save by its seq; a user who already saved under that name (a cookbook loop's
    ``f"{step:06d}"``) gets a fresh name for the unnamed save, not a refusal after numbering that poisons the client."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        taken = f"{tc.current_sequence_number + 2:06d}"  # the name the backend gives the op after this save
        mine = await tc.save_state(taken)
        auto = await tc.save_state()
        assert auto.path.rsplit("/", 1)[1] == f"{taken}-2" and auto.path != mine.path
        await tc.optim_step(HP)  # not poisoned
        assert {c.path for c in await svc.list_checkpoints(tc.model_id)} >= {mine.path, auto.path}


@pytest.mark.anyio
async def test_bad_checkpoint_name(open_session):
    b = MockBackend()
    s = await open_session(b)
    with pytest.raises(InvalidInputError) as err:
        await s.run("save_state", name="a/b")
    assert err.value.field == "name"
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_checkpoint_dir_keeps_checkpoints_for_another_process(open_session, datum, tmp_path):
    """``?checkpoint_dir=``: what one process saved, a backend that never saw it (another process) loads exactly."""
    from asyncsess.backends.base import parse_url

    b = MockBackend.from_url(parse_url(f"mock://?checkpoint_dir={tmp_path}"))
    s = await open_session(b)
    await _train(s, _batches(b.tokenizer, datum)[:2])
    state = await s.run("save_state", name="half")
    weights = await s.run("save_weights", name="half")
    assert (tmp_path / s.id / "weights" / "half.npz").is_file() and not list(tmp_path.rglob("*.tmp"))
    m0, v0, _ = b.optimizer_state(s.id)
    for path in (state.path, weights.path):  # forget them in this process: as a fresh process would
        del MockBackend._checkpoints[path]

    other = MockBackend.from_url(parse_url(f"mock://?checkpoint_dir={tmp_path}"))
    assert other._id_prefix != b._id_prefix  # session ids, hence paths, never repeat across processes
    r = await open_session(other, from_path=state.path, with_optimizer=True)
    np.testing.assert_array_equal(other.weights(r.id), b.weights(s.id))
    m, v, step = other.optimizer_state(r.id)
    assert step == 2 and np.array_equal(m, m0) and np.array_equal(v, v0)
    assert {c.path for c in await other.list_checkpoints(s.id)} == {state.path, weights.path}
    sampler = await other.create_sampler(SamplerSpec(model_path=weights.path))
    await other.stop_session(sampler)
    with pytest.raises(InvalidInputError) as err:  # sampler weights are no training state, on disk as in memory
        await other.create_training_session(TrainingSessionSpec("", from_path=weights.path))
    assert err.value.field == "from_path"
    for bad in ("mock://../weights/half", f"mock://{s.id}/weights/..", "mock://x/other/half"):
        with pytest.raises(InvalidInputError) as err:
            await other.create_training_session(TrainingSessionSpec("", from_path=bad))
        assert err.value.field == "from_path"
    await other.delete_checkpoint(state.path)
    assert not (tmp_path / s.id / "weights" / "half.npz").exists()
    with pytest.raises(InvalidInputError):
        await other.create_training_session(TrainingSessionSpec("", from_path=state.path))
    with pytest.raises(InvalidInputError) as err:  # no checkpoint_dir: the process-wide store only
        await MockBackend().create_sampler(SamplerSpec(model_path=weights.path))
    assert err.value.field == "model_path"
    for backend, sid in [(b, s.id), (other, r.id)]:
        await backend.stop_session(sid)


@pytest.mark.anyio
async def test_a_refresh_every_step_keeps_no_old_weights():
    """Each refresh's snapshot, and each stopped sampler's tables, stayed in memory for good (~170 KB a step on
    mock/bigram-tiny: gigabytes over a long CI run). Now a snapshot no open sampler was made from goes, except the
    session's newest, and a stopped sampler keeps only its id (it still answers SessionGoneError)."""
    from asyncsess.errors import SessionGoneError
    from asyncsess.rl.data import sft_datum

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        b = svc.backend
        datum = sft_datum(tc.get_tokenizer().encode("ab"), tc.get_tokenizer().encode("cd"))
        samplers = []
        for step in range(12):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(HP)
            samplers.append(await tc.save_weights_and_get_sampling_client())
            if step >= 2:
                await samplers[step - 2].stop()  # the loop keeps the last two open (staleness 1)
        mine = [p for p, c in b._checkpoints.items() if c.ephemeral and c.session_id == tc.model_id]
        assert len(mine) == 2  # the snapshots the two open samplers were made from
        assert len([s for s in b._samplers.values() if s.path in mine]) == 2 and len(b._stopped_samplers) == 10
        await samplers[-1].compute_logprobs([1, 2, 3])
        with pytest.raises(SessionGoneError):
            await samplers[0].compute_logprobs([1, 2, 3])
        with pytest.raises(InvalidInputError):  # a dropped snapshot's path is no checkpoint now
            await svc.create_sampling_client(model_path=samplers[0]._spec.model_path)


@pytest.mark.anyio
async def test_a_save_or_load_refused_at_its_turn_is_void_and_the_ops_after_it_run(open_session, datum):
    """A server (the Tinker door, the emulator) numbers ops after :meth:`precheck`; a save whose name another save
    queued before it takes, or a load whose checkpoint is deleted before its turn, is refused at the turn. Nothing
    of it ran: the refusal is void and the ops numbered after it run (it poisoned the session)."""
    b = MockBackend()
    s = await open_session(b)
    tok_datum = datum([1, 40, 41])
    first, second = s.op("save_state", name="same"), s.op("save_state", name="same")
    for op in (first, second):
        b.precheck(s.id, op)  # both pass: the name is free when they are numbered
    after = s.op("forward_backward", data=(tok_datum,), loss_fn="cross_entropy")
    saved = await b.execute_training(s.id, first)
    with pytest.raises(ConflictError, match="overwrite") as err:
        await b.execute_training(s.id, second)
    assert err.value.void
    assert (await b.execute_training(s.id, after)).loss_fn_outputs

    load = s.op("load_state", path=saved.path)
    b.precheck(s.id, load)
    await b.delete_checkpoint(saved.path)
    with pytest.raises(InvalidInputError, match="no checkpoint") as err:
        await b.execute_training(s.id, load)
    assert err.value.void
    await s.run("optim_step", adam_params=HP)
    assert [seq for _, seq, _ in b.applied_log] == [1, 3, 5]
    await b.stop_session(s.id)


def _npz(file, **change):
    """Rewrite a stored ``.npz`` with some arrays changed (``None``: removed)."""
    with np.load(file) as z:
        arrays = {k: z[k] for k in z.files}
    for k, v in change.items():
        if v is None:
            arrays.pop(k, None)
        else:
            arrays[k] = v
    with open(file, "wb") as f:
        np.savez(f, **arrays)


def _meta(file, **change):
    with np.load(file) as z:
        meta = json.loads(str(z["meta"]))
    _npz(file, meta=np.array(json.dumps({**meta, **change})))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "tamper",
    [
        "truncated",
        "empty",
        "pickle",
        "object array",
        "wrong shape",
        "int dtype",
        "NaN delta",
        "inf moment",
        "huge delta",
        "no meta",
        "unknown meta field",
        "step as string",
        "rank 10**9",
        "another path",
        "link out of the root",
        "extra array",
    ],
)
async def test_a_damaged_checkpoint_file_is_a_typed_error_and_the_listing_survives(open_session, datum, tmp_path, tamper):
    """What another process finds in ``?checkpoint_dir=`` after a full disk, a kill or a careless edit: each is an
    InvalidInputError naming the field, never a numpy/zipfile/pickle traceback or a wrong-sized model."""
    import pickle

    from asyncsess.backends.base import parse_url

    store = tmp_path / "store"
    b = MockBackend.from_url(parse_url(f"mock://?checkpoint_dir={store}"))
    s = await open_session(b)
    await _train(s, _batches(b.tokenizer, datum)[:1])
    state = await s.run("save_state", name="half")
    del MockBackend._checkpoints[state.path]  # as a fresh process finds it: on disk only
    file = store / s.id / "weights" / "half.npz"
    v = b.tokenizer.vocab_size
    edits = {
        "truncated": lambda: os.truncate(file, file.stat().st_size // 2),
        "empty": lambda: file.write_bytes(b""),
        "pickle": lambda: file.write_bytes(pickle.dumps({"delta": 1})),
        "object array": lambda: _npz(file, delta=np.array([{"x": 1}], dtype=object)),
        "wrong shape": lambda: _npz(file, delta=np.zeros((v + 1, v))),
        "int dtype": lambda: _npz(file, delta=np.zeros((v, v), dtype=np.int64)),
        "NaN delta": lambda: _npz(file, delta=np.full((v, v), np.nan)),
        "inf moment": lambda: _npz(file, adam_v=np.full((v, v), np.inf)),
        "huge delta": lambda: _npz(file, delta=np.zeros((4 * v, 4 * v))),
        "no meta": lambda: _npz(file, meta=None),
        "unknown meta field": lambda: _meta(file, evil=1),
        "step as string": lambda: _meta(file, step="3"),
        "rank 10**9": lambda: _meta(file, rank=10**9),
        "another path": lambda: _meta(file, path="mock://someone-else/weights/half"),
        "link out of the root": lambda: (shutil.move(file, tmp_path / "outside.npz"), file.symlink_to(tmp_path / "outside.npz")),
        "extra array": lambda: _npz(file, evil=np.zeros(3)),
    }
    edits[tamper]()
    other = MockBackend.from_url(parse_url(f"mock://?checkpoint_dir={store}"))
    with pytest.raises(InvalidInputError) as err:
        await other.create_training_session(TrainingSessionSpec("", from_path=state.path, with_optimizer=True))
    assert err.value.field == "from_path" and state.path in str(err.value)
    with pytest.raises(InvalidInputError) as err:
        await other.create_sampler(SamplerSpec(model_path=state.path))
    assert err.value.field == "model_path"
    assert state.path not in {c.path for c in await other.list_checkpoints()}
    await b.stop_session(s.id)
