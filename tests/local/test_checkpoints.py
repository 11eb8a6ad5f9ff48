"""Checkpoints: bit-exact resume with the optimizer, weights-only resume, PEFT and merged exports that the
real peft/transformers loaders read, listing, and paths outside the storage root refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import SamplerSpec, SaveStateOp, SaveWeightsOp, TrainingSessionSpec  # noqa: E402
from asyncsess.errors import ConflictError, InvalidInputError  # noqa: E402
from asyncsess.types import AdamParams  # noqa: E402

from .helpers import DEVICE_KW, TOL, Ops, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]

TEXTS = ["what is 2 plus 3? the answer is 5.", "hello world the cat and the dog", "one two three four"]


async def _steps(b, model_id, ops, data, n):
    for i in range(n):
        await b.execute_training(model_id, ops("forward_backward", data=(data[i % len(data)],), loss_fn="cross_entropy"))
        await b.execute_training(model_id, ops("optim_step", adam_params=AdamParams(learning_rate=2e-2, weight_decay=0.01)))


def _params(b, model_id):
    return {k: p.detach().clone() for k, p in b.engine.sessions[model_id].params.items()}


def _path(uri: str) -> Path:
    assert uri.startswith("local:///")
    return Path(uri[len("local://") :])


async def test_resume_with_optimizer_is_bit_exact_and_weights_only_is_not(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        data = [sft_datum(tok.encode(t)) for t in TEXTS]
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=7))
        ops = Ops()
        await _steps(b, a.model_id, ops, data, 3)
        saved = await b.execute_training(a.model_id, ops("save_state", name="mid"))
        assert saved.step == 3 and saved.kind == "state"
        at_save = _params(b, a.model_id)
        await _steps(b, a.model_id, ops, data[1:] + data[:1], 3)
        continued = _params(b, a.model_id)

        r = await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=saved.path, with_optimizer=True))
        assert r.step == 3 and r.lora_rank == 4
        assert all(torch.equal(at_save[k], v) for k, v in _params(b, r.model_id).items())
        await _steps(b, r.model_id, Ops(), data[1:] + data[:1], 3)
        resumed = _params(b, r.model_id)
        assert all(torch.equal(continued[k], resumed[k]) for k in continued)

        w = await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=saved.path, with_optimizer=False))
        assert all(torch.equal(at_save[k], v) for k, v in _params(b, w.model_id).items())
        assert not b.engine.sessions[w.model_id].optimizer.state  # a fresh optimizer
        await _steps(b, w.model_id, Ops(), data[1:] + data[:1], 3)
        assert any(not torch.equal(continued[k], v) for k, v in _params(b, w.model_id).items())

        files = sorted(p.name for p in _path(saved.path).iterdir())
        assert files == ["adapter.safetensors", "asyncsess.json", "optimizer.safetensors"]
    finally:
        await b.aclose()


async def test_load_state_op_restores_weights_and_optimizer(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        data = [sft_datum(tok.encode(t)) for t in TEXTS]
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=1))
        ops = Ops()
        await _steps(b, a.model_id, ops, data, 2)
        saved = await b.execute_training(a.model_id, ops("save_state", name="two"))
        before = _params(b, a.model_id)
        await _steps(b, a.model_id, ops, data, 2)
        loaded = await b.execute_training(a.model_id, ops("load_state", path=saved.path, with_optimizer=True))
        assert loaded.step == 2
        assert all(torch.equal(before[k], v) for k, v in _params(b, a.model_id).items())
        other = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=8, seed=1))
        o = Ops()
        with pytest.raises(InvalidInputError, match="rank") as err:  # refused before anything ran: void, the next op runs
            await b.execute_training(other.model_id, o("load_state", path=saved.path, with_optimizer=True))
        assert err.value.void
        assert (await b.execute_training(other.model_id, o("optim_step", adam_params=AdamParams()))).step == 1
    finally:
        await b.aclose()


async def test_sampler_export_is_a_peft_dir_and_merged_export_is_a_transformers_dir(backend_factory, tiny, tiny_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        data = [sft_datum(tok.encode(t)) for t in TEXTS]
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=2))
        ops = Ops()
        await _steps(b, a.model_id, ops, data, 3)
        peft_ckpt = await b.execute_training(a.model_id, ops("save_weights", name="for-peft"))
        merged_ckpt = await b.execute_training(a.model_id, ops("save_weights", name="merged", merge_weights=True))
        assert (peft_ckpt.kind, merged_ckpt.kind) == ("sampler", "merged")

        probe = tok.encode("the answer is 5. hello world")
        sampler = await b.create_sampler(SamplerSpec(model_path=peft_ckpt.path))
        engine_lp = await b.compute_logprobs(sampler, probe)
        assert engine_lp[0] is None and len(engine_lp) == len(probe)

        def logprobs(model):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([probe])).logits[0].float()
            return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(probe[1:])[:, None])[:, 0].tolist()

        d = _path(peft_ckpt.path)
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), str(d)).eval()
        assert logprobs(peft_model) == pytest.approx(engine_lp[1:], abs=1e-4)

        merged = AutoModelForCausalLM.from_pretrained(str(_path(merged_ckpt.path))).eval()
        assert logprobs(merged) == pytest.approx(engine_lp[1:], abs=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
        assert logprobs(base) != pytest.approx(engine_lp[1:], abs=1e-4)  # the adapter really changed the model

        listed = {c.checkpoint_id.split("/")[-1]: c for c in await b.list_checkpoints(a.model_id)}
        assert {k: c.checkpoint_type for k, c in listed.items()} == {"for-peft": "sampler", "merged": "merged"}
        assert listed["merged"].path == merged_ckpt.path and listed["for-peft"].step == 3
        assert listed["merged"].size_bytes > listed["for-peft"].size_bytes > 0
    finally:
        await b.aclose()


async def test_paths_outside_the_root_and_bad_names_are_refused(backend_factory, tiny, tmp_path):
    b = backend_factory()
    try:
        await b.open()
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "asyncsess.json").write_text('{"kind": "sampler", "base_model": "x"}')
        root = b.engine.store.root
        for bad in [
            f"local://{outside}",
            "local://../outside",
            f"local://{root}/../outside",
            "/etc",
            "s3://bucket/x",
            "local://nothing/here",
        ]:
            with pytest.raises(InvalidInputError, match="path"):
                await b.create_sampler(SamplerSpec(model_path=bad))
            with pytest.raises(InvalidInputError):
                await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=bad))
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=2))
        with pytest.raises(InvalidInputError, match="name"):
            await b.execute_training(a.model_id, Ops()("save_state", name="../escape"))
    finally:
        await b.aclose()


async def test_merged_export_of_a_tied_embedding_model_keeps_the_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.testing import build_tiny_llama

    tied = str(build_tiny_llama(tmp_path / "tied", tie_embeddings=True))
    b = LocalBackend(model=tied, **DEVICE_KW, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        await b.open()
        tok = b.get_tokenizer(tied)
        a = await b.create_training_session(TrainingSessionSpec(base_model=tied, rank=4, seed=2))
        ops = Ops()
        await _steps(b, a.model_id, ops, [sft_datum(tok.encode(t)) for t in TEXTS], 3)
        merged_ckpt = await b.execute_training(a.model_id, ops("save_weights", name="merged", merge_weights=True))
        sampler = await b.create_sampler(SamplerSpec(model_path=merged_ckpt.path))
        probe = tok.encode("the answer is 5. hello world")
        engine_lp = await b.compute_logprobs(sampler, probe)
        merged = AutoModelForCausalLM.from_pretrained(str(_path(merged_ckpt.path))).eval()
        with torch.no_grad():
            logits = merged(input_ids=torch.tensor([probe])).logits[0].float()
        got = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(probe[1:])[:, None])[:, 0].tolist()
        assert got == pytest.approx(engine_lp[1:], abs=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tied)
        assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)
    finally:
        await b.aclose()


async def test_a_taken_name_is_refused_before_numbering_and_overwrite_replaces_it_whole(backend_factory, tiny, monkeypatch):
    """A save under a name that holds a checkpoint is refused by ``precheck`` (the client's call while numbering)
    unless overwrite=True; a replacement that fails part-way leaves the older checkpoint whole under the name."""
    b = backend_factory()
    try:
        await b.open()
        data = [sft_datum(b.get_tokenizer(tiny).encode(t)) for t in TEXTS]
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=3))
        ops = Ops()
        first = await b.execute_training(a.model_id, ops("save_state", name="ckpt"))
        await b.execute_training(a.model_id, ops("save_weights", name="w"))
        await _steps(b, a.model_id, ops, data, 1)
        final = _path(first.path)
        for taken in (
            SaveStateOp(seq=ops.seq + 1, idempotency_key="k", name="ckpt"),
            SaveWeightsOp(seq=ops.seq + 1, idempotency_key="k", name="w"),
        ):
            with pytest.raises(ConflictError) as err:
                b.precheck(a.model_id, taken)
            assert err.value.field == "overwrite" and "overwrite=True" in (err.value.fix or "")
        assert json.loads((final / "asyncsess.json").read_text())["step"] == 0

        replaced = await b.execute_training(a.model_id, ops("save_state", name="ckpt", overwrite=True))
        assert replaced.path == first.path and replaced.step == 1
        assert json.loads((final / "asyncsess.json").read_text())["step"] == 1
        resumed = await b.create_training_session(TrainingSessionSpec(base_model=tiny, from_path=first.path, with_optimizer=True))
        assert resumed.step == 1

        real_rename = Path.rename

        def rename(self, target):  # the new checkpoint never gets into place (a full disk, a crash)
            if Path(target) == final and self.parent == final.parent:
                raise OSError("injected: rename failed")
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", rename)
        await _steps(b, a.model_id, ops, data, 1)
        with pytest.raises(Exception, match="injected"):
            await b.execute_training(a.model_id, ops("save_state", name="ckpt", overwrite=True))
        monkeypatch.undo()
        assert json.loads((final / "asyncsess.json").read_text())["step"] == 1  # the older one, whole
        assert sorted(p.name for p in final.parent.iterdir()) == ["ckpt"]  # no scratch or replaced copy left

        shutil.copytree(final, final.parent / ".ckpt.crashed")  # what a killed worker leaves mid-save
        assert sorted(c.checkpoint_id.split("/")[-1] for c in await b.list_checkpoints(a.model_id)) == ["ckpt", "w"]
    finally:
        await b.aclose()


async def test_an_unnamed_save_never_clashes_with_a_name_the_user_chose(backend_factory, tiny):
    """An unnamed save is named ``step-<step>-<seq>``; when the user already saved under that name, the backend
    picks a free one instead of refusing the numbered op (which would poison the session)."""
    b = backend_factory()
    try:
        await b.open()
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=3))
        ops = Ops()
        mine = await b.execute_training(a.model_id, ops("save_state", name=f"step-000000-{ops.seq + 2}"))
        auto = await b.execute_training(a.model_id, ops("save_state"))
        assert _path(auto.path).name == f"{_path(mine.path).name}-2"
        assert json.loads((_path(mine.path) / "asyncsess.json").read_text())["step"] == 0  # untouched
    finally:
        await b.aclose()


async def test_a_save_whose_name_an_op_queued_before_it_takes_is_void_and_poisons_nothing(backend_factory, tiny):
    """Two saves of one name sent together both pass the check on arrival (neither has run yet); the second then
    found the name taken when it ran, and that failure poisoned the session: every later op was a PoisonedError.
    It is void (nothing was written), and the session goes on."""
    import threading

    import anyio
    from anyio import wait_all_tasks_blocked

    b = backend_factory()
    try:
        await b.open()
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=3))
        ops = Ops()
        first, second = ops("save_state", name="same"), ops("save_state", name="same")
        gate = threading.Event()
        b.engine.call_soon(gate.wait)  # the engine thread waits: both saves are checked and queued before either runs
        got: dict[int, object] = {}

        async def run(op):
            try:
                got[op.seq] = await b.execute_training(a.model_id, op)
            except Exception as err:
                got[op.seq] = err

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, first)
            tg.start_soon(run, second)
            await wait_all_tasks_blocked()
            gate.set()
        assert _path(got[1].path).name == "same", got  # type: ignore[attr-defined]
        err = got[2]
        assert isinstance(err, ConflictError) and err.void and err.field == "overwrite", err
        step = await b.execute_training(a.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-3)))
        assert step.step == 1  # not poisoned
        assert [c.checkpoint_id.split("/")[-1] for c in await b.list_checkpoints(a.model_id)] == ["same"]
    finally:
        gate.set()
        await b.aclose()


async def test_a_sampler_on_a_rewritten_or_deleted_path_loads_what_is_there(backend_factory, tiny):
    """Samplers opened on a checkpoint path shared one cached snapshot: after the path was saved over
    (``overwrite=True``), or deleted and saved again, a new sampler on it still sampled the old weights while an
    old one was open. Now each new sampler loads what the path holds; the open one keeps its weights."""
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        data = [sft_datum(tok.encode(t)) for t in TEXTS]
        ids = tok.encode(TEXTS[0])
        a = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=3))
        ops = Ops()

        async def saved_and_live() -> tuple[str, list[float | None]]:
            path = (await b.execute_training(a.model_id, ops("save_weights", name="s", overwrite=True))).path
            live = await b.execute_training(a.model_id, ops("save_weights", ephemeral=True))
            return path, await b.compute_logprobs(await b.create_sampler(SamplerSpec(model_path=live.path)), ids)

        async def on_path() -> list[float | None]:
            return await b.compute_logprobs(await b.create_sampler(SamplerSpec(model_path=path)), ids)

        path, first = await saved_and_live()
        old = await b.create_sampler(SamplerSpec(model_path=path))
        assert await b.compute_logprobs(old, ids) == pytest.approx(first, abs=TOL)
        await _steps(b, a.model_id, ops, data, 2)
        again, second = await saved_and_live()
        assert again == path and second != pytest.approx(first, abs=0.1)
        assert await on_path() == pytest.approx(second, abs=TOL)
        assert await b.compute_logprobs(old, ids) == pytest.approx(first, abs=TOL)  # the open sampler keeps its weights

        await _steps(b, a.model_id, ops, data, 2)
        await b.delete_checkpoint(path)
        again, third = await saved_and_live()
        assert await on_path() == pytest.approx(third, abs=TOL) and third != pytest.approx(second, abs=0.1)
        kept = b.engine.state.samplers[old].path
        assert kept != path and kept in b.engine.state._snapshots
        await b.stop_session(old)  # its private snapshot goes with it
        assert kept not in b.engine.state._snapshots
    finally:
        await b.aclose()
