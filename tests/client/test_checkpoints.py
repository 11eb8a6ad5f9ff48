"""save_state / resume: with the optimizer, bit-exact; weights-only, a fresh optimizer."""

import numpy as np
import pytest

from asyncsess import AdamParams, ServiceClient

from .helpers import sft_datum

pytestmark = pytest.mark.anyio

BATCHES = [[sft_datum([1, 40 + i, 41 + i, 42, 43 + (i % 3)])] for i in range(6)]
ADAM = AdamParams(learning_rate=0.05, weight_decay=0.01, grad_clip_norm=1.0)


async def _steps(tc, batches):
    for batch in batches:
        tc.forward_backward(batch, "cross_entropy")
        await tc.optim_step(ADAM)


async def test_resume_with_optimizer_is_bit_exact_and_weights_only_resets_moments():
    async with ServiceClient("mock://") as svc:
        straight = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await _steps(straight, BATCHES)

        first = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await _steps(first, BATCHES[:3])
        saved = await first.save_state("mid")
        assert saved.path.startswith("mock://") and saved.model_package_arn == saved.path
        await first.stop()

        exact = await svc.create_training_client_from_state_with_optimizer(saved.path)
        fresh = await svc.create_training_client_from_state(saved.path)
        assert np.array_equal(svc.backend.weights(fresh.model_id), svc.backend.weights(exact.model_id))
        m_fresh, v_fresh, _ = svc.backend.optimizer_state(fresh.model_id)
        m_exact, v_exact, _ = svc.backend.optimizer_state(exact.model_id)
        assert not np.any(m_fresh) and not np.any(v_fresh), "weights-only resume starts a fresh optimizer"
        assert np.any(m_exact) and np.any(v_exact), "with-optimizer resume restores the moments"
        await _steps(exact, BATCHES[3:])
        await _steps(fresh, BATCHES[3:])

        w_straight = svc.backend.weights(straight.model_id)
        assert np.array_equal(svc.backend.weights(exact.model_id), w_straight), "with-optimizer resume must be bit-exact"
        m1, v1, s1 = svc.backend.optimizer_state(exact.model_id)
        m0, v0, s0 = svc.backend.optimizer_state(straight.model_id)
        assert np.array_equal(m1, m0) and np.array_equal(v1, v0) and s1 == s0
        assert not np.array_equal(svc.backend.weights(fresh.model_id), w_straight), "weights-only resume must differ"
        listed = await svc.list_checkpoints(first.model_id)
        assert saved.path in [c.path for c in listed]


async def test_sampler_snapshot_does_not_follow_later_training():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        before = await tc.save_weights_and_get_sampling_client()
        lp_before = await before.compute_logprobs([1, 40, 41, 42])
        await _steps(tc, BATCHES)
        assert await before.compute_logprobs([1, 40, 41, 42]) == lp_before
        after = await tc.save_weights_and_get_sampling_client()
        lp_after = await after.compute_logprobs([1, 40, 41, 42])
        assert lp_after[0] is None and lp_after[1:] != lp_before[1:]
