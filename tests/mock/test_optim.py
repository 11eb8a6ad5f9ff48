"""AdamW against a hand-written scalar reference, through the trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.errors import InvalidInputError, NonFiniteGradientError
from asyncsess.types import AdamParams, Datum
from asyncsess_mock import CharTokenizer, MockTrainer
from asyncsess_mock.optim import AdamState, adamw_step


def reference_adamw(params, grads_per_step, hp: AdamParams):
    """Plain-Python AdamW (PyTorch's formulas) over a list of floats, one step per grads entry."""
    params = list(params)
    m = [0.0] * len(params)
    v = [0.0] * len(params)
    norms = []
    for t, grads in enumerate(grads_per_step, start=1):
        norm = math.sqrt(sum(g * g for g in grads))
        norms.append(norm)
        if hp.grad_clip_norm > 0 and hp.grad_clip_norm / (norm + 1e-6) < 1:
            grads = [g * hp.grad_clip_norm / (norm + 1e-6) for g in grads]
        for i, g in enumerate(grads):
            m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * g
            v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * g * g
            params[i] *= 1 - hp.learning_rate * hp.weight_decay
            m_hat = m[i] / (1 - hp.beta1**t)
            v_hat = v[i] / (1 - hp.beta2**t)
            params[i] -= hp.learning_rate * m_hat / (math.sqrt(v_hat) + hp.eps)
    return params, m, v, norms


HPS = [
    AdamParams(learning_rate=1e-2),
    AdamParams(learning_rate=3e-2, beta1=0.8, beta2=0.999, eps=1e-8, weight_decay=0.1),
    AdamParams(learning_rate=1e-2, grad_clip_norm=0.5),
]


@pytest.mark.parametrize("hp", HPS, ids=["tinker-defaults", "decay", "clip"])
def test_adamw_matches_reference(hp):
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=12)
    grads = [rng.normal(size=12) for _ in range(5)]
    param, state = p0.copy(), AdamState.zeros((12,))
    metrics = [adamw_step(param, g, state, hp) for g in grads]
    ref_p, ref_m, ref_v, ref_norms = reference_adamw(p0.tolist(), [g.tolist() for g in grads], hp)
    np.testing.assert_allclose(param, ref_p, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.m, ref_m, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(state.v, ref_v, rtol=1e-10, atol=1e-14)
    assert state.step == 5
    assert [mt["grad_norm"] for mt in metrics] == pytest.approx(ref_norms)
    assert all(mt["learning_rate"] == hp.learning_rate for mt in metrics)


def test_clipping_changes_the_update_only_when_the_norm_is_above_the_limit():
    g = np.array([3.0, 4.0])  # norm 5
    for clip, changed in [(10.0, False), (1.0, True)]:
        a, b = np.zeros(2), np.zeros(2)
        sa, sb = AdamState.zeros((2,)), AdamState.zeros((2,))
        adamw_step(a, g, sa, AdamParams(learning_rate=0.1, grad_clip_norm=clip))
        adamw_step(b, g, sb, AdamParams(learning_rate=0.1))
        assert (not np.allclose(sa.m, sb.m)) is changed


def test_trainer_optim_step_uses_accumulated_gradient_and_reports_metrics():
    v = CharTokenizer().vocab_size
    trainer = MockTrainer("opt", v)
    datum = Datum(model_input=[1, 40, 41], loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0, 1.0, 1.0]})
    trainer.forward_backward([datum], "cross_entropy")
    trainer.forward_backward([datum], "cross_entropy")
    grad = trainer.grad.copy()
    hp = AdamParams(learning_rate=0.05, weight_decay=0.01)
    expected, state = np.zeros((v, v)), AdamState.zeros((v, v))
    adamw_step(expected, grad, state, hp)
    before = trainer.forward([datum], "cross_entropy").metrics["loss:sum"]
    out = trainer.optim_step(hp)
    np.testing.assert_array_equal(trainer.delta, expected)
    assert out.step == 1
    assert out.metrics == {"grad_norm": pytest.approx(np.linalg.norm(grad)), "learning_rate": 0.05}
    assert trainer.forward([datum], "cross_entropy").metrics["loss:sum"] < before


@pytest.mark.anyio
async def test_a_non_finite_gradient_is_not_applied_and_the_session_lives_on():
    """The NaN gradient of a bad batch was applied: the weights became NaN for good. Now optim_step refuses it with
    a typed error, changes nothing, clears the gradient, and neither the backend nor the client is poisoned: the
    op queued behind it runs, and the run ends exactly as one that never saw the bad batch."""
    good = [{"model_input": [1, 40, 41], "loss_fn_inputs": {"target_tokens": [40, 41, 2], "weights": [1.0] * 3}}]
    hp = AdamParams(learning_rate=0.05)
    async with ServiceClient("mock://") as svc:
        bad_run, ref = [await svc.create_lora_training_client("mock/bigram-tiny", rank=4) for _ in range(2)]
        for tc in (bad_run, ref):
            await tc.forward_backward(good, "cross_entropy")
            await tc.optim_step(hp)
        backend = svc.backend
        await bad_run.forward_backward(good, "cross_entropy")
        backend.trainer(bad_run.model_id).grad[3, 4] = math.nan  # what an overflowing loss left behind
        weights, (m, v, step) = backend.weights(bad_run.model_id), backend.optimizer_state(bad_run.model_id)
        skipped = bad_run.optim_step(hp)
        after = bad_run.forward_backward(good, "cross_entropy")  # already queued behind the step
        with pytest.raises(NonFiniteGradientError) as info:
            await skipped
        err = info.value
        assert err.field == "gradient" and err.seq == skipped.seq and "nan" in str(err) and "not applied" in str(err)
        assert isinstance(err, InvalidInputError) and err.status_code == 400
        np.testing.assert_array_equal(backend.weights(bad_run.model_id), weights)
        m2, v2, step2 = backend.optimizer_state(bad_run.model_id)
        assert step2 == step == 1 and np.array_equal(m2, m) and np.array_equal(v2, v)
        await after
        assert (await bad_run.optim_step(hp)).step == 2
        await ref.forward_backward(good, "cross_entropy")
        await ref.optim_step(hp)
        np.testing.assert_array_equal(backend.weights(bad_run.model_id), backend.weights(ref.model_id))
        assert np.isfinite(backend.weights(bad_run.model_id)).all()
