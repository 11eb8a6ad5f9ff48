"""Sampler refresh on local://: in memory (no file under the checkpoint root), versioned adapter names, the
refresh probe within the local tolerance across real refreshes, and ``retain_snapshots`` bounding the live
adapter versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncsess import ServiceClient
from asyncsess.errors import InvalidInputError, SessionGoneError
from asyncsess.rl.data import sft_datum
from asyncsess.rl.refresh import RefreshProbe, default_tolerance, probe_tokens

from .helpers import DEVICE_KW

pytestmark = [pytest.mark.local, pytest.mark.torch, pytest.mark.anyio]


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


async def test_refreshes_are_in_memory_versioned_verified_and_retained(tiny, tmp_path):
    root = tmp_path / "ckpt"
    async with ServiceClient("local://", model=tiny, checkpoint_dir=str(root), retain_snapshots=3, **DEVICE_KW) as svc:
        tc = await svc.create_lora_training_client(base_model=tiny, rank=4, seed=0)
        sessions = svc.backend.engine.state
        tokens = probe_tokens(tc.get_tokenizer())
        probe = RefreshProbe(tokens, default_tolerance("local://"))
        await probe.check(0, probe.submit(tc), await tc.save_weights_and_get_sampling_client())
        datum = sft_datum(tokens[:2], tokens[2:])
        samplers, results = [], []
        for version in range(1, 7):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step({"learning_rate": 2e-2})
            fut = probe.submit(tc)
            sampler = await tc.save_weights_and_get_sampling_client()
            results.append(await probe.check(version, fut, sampler))
            samplers.append(sampler)  # kept open: only retain_snapshots bounds the live versions
            live = sessions.snapshot_adapters(tc.model_id)
            assert len(live) <= 3 and live[-1].startswith(f"{tc.model_id}-v{version}-")
        # every refresh took, and each step moved the probe more than the tolerance (so "took" was provable)
        assert [r.status for r in results] == ["ok"] * 6
        assert all(r.max_abs_diff <= default_tolerance("local://") for r in results)
        assert all(r.step_change is not None and r.step_change > default_tolerance("local://") for r in results)
        assert files_under(root) == []  # no refresh wrote to disk
        live = sessions.snapshot_adapters(tc.model_id)
        assert [name.split("-v")[1].split("-")[0] for name in live] == ["4", "5", "6"]
        slot = next(iter(sessions.slots.values()))
        assert sum(name in live for name in slot.host.info) == 3  # the dropped versions left the LoRA host too
        await samplers[-1].compute_logprobs(tokens)  # the newest still serves
        with pytest.raises(SessionGoneError, match="retain_snapshots=3"):
            await samplers[0].compute_logprobs(tokens)


async def test_refreshes_reuse_the_adapters_dropped_snapshots_release(tiny, tmp_path):
    """Adding a peft adapter walks every module of the model (most of a refresh's time on CPU): a new snapshot
    takes the adapter a dropped one released and copies the new weights into it, which every refresh's probe
    proves (a stale copy would fail it), and the model holds a bounded number of adapters however long the run."""
    from asyncsess_local.adapters import POOL_PER_SHAPE

    async with ServiceClient("local://", model=tiny, checkpoint_dir=str(tmp_path / "ckpt"), retain_snapshots=2, **DEVICE_KW) as svc:
        tc = await svc.create_lora_training_client(base_model=tiny, rank=4, seed=0)
        host = next(iter(svc.backend.engine.state.slots.values())).host
        added: list[str] = []
        real_add = host.add
        host.add = lambda name, **kw: added.append(name) or real_add(name, **kw)  # type: ignore[method-assign]
        tokens = probe_tokens(tc.get_tokenizer())
        probe = RefreshProbe(tokens, default_tolerance("local://"))
        await probe.check(0, probe.submit(tc), await tc.save_weights_and_get_sampling_client())
        datum = sft_datum(tokens[:2], tokens[2:])
        results = []
        for version in range(1, 9):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step({"learning_rate": 2e-2})
            fut = probe.submit(tc)
            results.append(await probe.check(version, fut, await tc.save_weights_and_get_sampling_client()))
        assert [r.status for r in results] == ["ok"] * 8
        assert all(r.step_change is not None and r.step_change > default_tolerance("local://") for r in results)
        assert 1 <= len(added) <= 2  # nine snapshots, at most two peft adapters added for them
        assert len(host.peft.peft_config) <= 2 + 2 + POOL_PER_SHAPE  # anchor, session, live snapshots, pool


async def test_without_a_bound_unused_versions_are_dropped_when_their_sampler_stops(tiny, tmp_path):
    async with ServiceClient("local://", model=tiny, checkpoint_dir=str(tmp_path / "ckpt"), **DEVICE_KW) as svc:
        tc = await svc.create_lora_training_client(base_model=tiny, rank=4, seed=0)
        tokens = probe_tokens(tc.get_tokenizer())
        old = None
        for _ in range(4):
            tc.forward_backward([sft_datum(tokens[:2], tokens[2:])], "cross_entropy")
            tc.optim_step({"learning_rate": 1e-2})
            new = await tc.save_weights_and_get_sampling_client()
            if old is not None:
                await old.stop()
            old = new
            assert len(svc.backend.engine.state.snapshot_adapters(tc.model_id)) == 1


async def test_retain_snapshots_is_validated(tiny):
    for bad in (-1, 2**31):
        with pytest.raises(InvalidInputError, match="retain_snapshots"):
            async with ServiceClient("local://", model=tiny, retain_snapshots=bad, **DEVICE_KW):
                pass
