"""The model gradient, checked by central finite differences through every loss."""

from __future__ import annotations

import numpy as np
import pytest

from asyncsess.types import Datum
from asyncsess_mock import CharTokenizer, MockTrainer
from asyncsess_mock.batch import pack_batch
from asyncsess_mock.losses import LOSSES, parse_config
from asyncsess_mock.model import grad_from_coeffs, token_logprobs

V = CharTokenizer().vocab_size
EPS = 1e-6
CONFIGS = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
}
# Losses whose value contains stop-gradient factors: only the surrogate -sum(sg[g] * p) has g as its gradient.
STOP_GRADIENT = {"cispo", "gspo"}


def _setup(loss_fn: str):
    rng = np.random.default_rng(7)
    trainer = MockTrainer("fd-model", V)
    trainer.load(rng.normal(0, 0.3, (V, V)), None)
    seqs = [rng.integers(0, V, 6), rng.integers(0, V, 8)]
    logp = trainer.logp_table()
    data = []
    for s in seqs:
        x, y = s[:-1], s[1:]
        n = len(x)
        lfi = {"target_tokens": y.tolist(), "weights": rng.uniform(0, 1.5, n).tolist()}
        if loss_fn != "cross_entropy":
            p = logp[x, y]
            lfi["logprobs"] = (p + rng.normal(0, 0.15, n)).tolist()  # ratios straddle the clip bounds
            lfi["advantages"] = rng.normal(0, 1, n).tolist()
        if loss_fn == "gspo":
            lfi["sequence_ratio_mask"] = [0.0] + [1.0] * (n - 1)
        data.append(Datum(model_input=x.tolist(), loss_fn_inputs=lfi))
    return trainer, data


def _coefficients(trainer: MockTrainer, data, loss_fn: str):
    batch = pack_batch(data, loss_fn, V, trainer.max_context)
    p = token_logprobs(trainer.logp_table(), batch.inputs, batch.targets)
    _, g = LOSSES[loss_fn](p, batch.tensors, parse_config(loss_fn, CONFIGS[loss_fn]), batch.seg)
    return batch, g


def _probe_entries(batch, rng):
    rows = np.unique(batch.inputs)
    picks = [(int(x), int(y)) for x, y in zip(batch.inputs[:6], batch.targets[:6])]
    picks += [(int(r), int(c)) for r, c in zip(rng.choice(rows, 10), rng.integers(0, V, 10))]
    return picks


@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_model_gradient_matches_finite_differences(loss_fn):
    trainer, data = _setup(loss_fn)
    cfg = CONFIGS[loss_fn]
    d0 = trainer.delta.copy()
    trainer.forward_backward(data, loss_fn, cfg)
    analytic = trainer.grad.copy()
    batch, g = _coefficients(trainer, data, loss_fn)
    np.testing.assert_allclose(analytic, grad_from_coeffs(np.exp(trainer.logp_table()), batch.inputs, batch.targets, g))

    def surrogate(delta):
        trainer.load(delta, None)
        b = pack_batch(data, loss_fn, V, trainer.max_context)
        return -(g * token_logprobs(trainer.logp_table(), b.inputs, b.targets)).sum()

    def loss_value(delta):
        trainer.load(delta, None)
        return trainer.forward(data, loss_fn, cfg).metrics["loss:sum"]

    objectives = [surrogate] if loss_fn in STOP_GRADIENT else [surrogate, loss_value]
    rng = np.random.default_rng(1)
    for objective in objectives:
        for r, c in _probe_entries(batch, rng):
            plus, minus = d0.copy(), d0.copy()
            plus[r, c] += EPS
            minus[r, c] -= EPS
            numeric = (objective(plus) - objective(minus)) / (2 * EPS)
            assert numeric == pytest.approx(analytic[r, c], abs=1e-6), (objective.__name__, r, c)
    untouched = np.setdiff1d(np.arange(V), batch.inputs)
    assert not analytic[untouched].any()


def test_loss_coefficients_match_finite_differences_in_logprob_space():
    """g = -dL/dp for the losses without stop-gradient terms (docs/losses.md)."""
    rng = np.random.default_rng(3)
    p = rng.normal(-1.5, 0.5, 9)
    inputs = {"logprobs": p + rng.normal(0, 0.2, 9), "advantages": rng.normal(0, 1, 9), "weights": rng.uniform(0, 2, 9)}
    for loss_fn in ["cross_entropy", "importance_sampling", "ppo", "dro"]:
        cfg = parse_config(loss_fn, CONFIGS[loss_fn])
        _, g = LOSSES[loss_fn](p, inputs, cfg, None)
        for t in range(9):
            e = np.zeros(9)
            e[t] = EPS
            numeric = (LOSSES[loss_fn](p + e, inputs, cfg, None)[0] - LOSSES[loss_fn](p - e, inputs, cfg, None)[0]) / (2 * EPS)
            assert -numeric == pytest.approx(g[t], abs=1e-6), (loss_fn, t)


def test_gradients_accumulate_until_optim_step_and_forward_adds_none():
    trainer, data = _setup("ppo")
    whole = MockTrainer("fd-model", V)
    whole.load(trainer.delta, None)
    whole.forward_backward(data, "ppo", CONFIGS["ppo"])
    trainer.forward(data, "ppo", CONFIGS["ppo"])
    assert not trainer.grad.any()
    trainer.forward_backward(data[:1], "ppo", CONFIGS["ppo"])
    trainer.forward_backward(data[1:], "ppo", CONFIGS["ppo"])
    np.testing.assert_allclose(trainer.grad, whole.grad, atol=1e-12)  # chunked == unchunked
    trainer.optim_step()
    assert not trainer.grad.any()


def test_multi_target_cross_entropy_equals_the_targets_spelled_out():
    """(N, K) targets: each input position scores K targets (Tinker's multi-target form)."""
    tok = [5, 9, 14]
    targets = [[9, 20], [14, 30], [40, 41]]
    weights = [[1.0, 0.5], [1.0, 0.0], [0.25, 2.0]]
    multi = MockTrainer("m", V)
    out = multi.forward_backward([Datum(model_input=tok, loss_fn_inputs={"target_tokens": targets, "weights": weights})], "cross_entropy")
    flat = MockTrainer("m", V)
    spelled = Datum(
        model_input=np.repeat(tok, 2).tolist(),
        loss_fn_inputs={"target_tokens": np.ravel(targets).tolist(), "weights": np.ravel(weights).tolist()},
    )
    ref = flat.forward_backward([spelled], "cross_entropy")
    assert out.loss_fn_outputs[0]["logprobs"].shape == [3, 2]
    assert out.loss_fn_outputs[0]["logprobs"].data == ref.loss_fn_outputs[0]["logprobs"].data
    assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"])
    np.testing.assert_allclose(multi.grad, flat.grad)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_constant_per_token_clip_equals_the_config_clip(loss_fn):
    """Per-token ``clip_low_threshold`` / ``clip_high_threshold`` inputs replace the config's bounds."""
    config_run, data = _setup(loss_fn)
    out = config_run.forward_backward(data, loss_fn, CONFIGS[loss_fn])
    token_run, _ = _setup(loss_fn)
    per_token = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                **d.loss_fn_inputs,
                "clip_low_threshold": [0.9] * d.model_input.length,
                "clip_high_threshold": [1.1] * d.model_input.length,
            },
        )
        for d in data
    ]
    got = token_run.forward_backward(per_token, loss_fn, {"clip_low_threshold": 0.1, "clip_high_threshold": 9.0})
    assert got.metrics["loss:sum"] == out.metrics["loss:sum"]
    np.testing.assert_array_equal(token_run.grad, config_run.grad)
    tight_run, _ = _setup(loss_fn)
    tight_run.forward_backward(per_token, loss_fn, None)
    tight_run.grad[:] = 0.0
    n = [d.model_input.length for d in per_token]
    tight = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs, "clip_low_threshold": [1.0] * k, "clip_high_threshold": [1.0] * k},
        )
        for d, k in zip(per_token, n)
    ]
    tight_run.forward_backward(tight, loss_fn, None)
    assert np.abs(tight_run.grad - config_run.grad).max() > 1e-6  # the per-token bounds are really read


def test_multi_target_importance_sampling_equals_the_targets_spelled_out():
    tok = [5, 9, 14]
    targets = [[9, 20], [14, 30], [40, 41]]
    lfi = {"logprobs": [[-1.0, -3.0], [-2.0, -0.5], [-4.0, -4.5]], "advantages": [[1.0, -0.5], [0.0, 2.0], [-1.0, 0.25]]}
    multi = MockTrainer("m", V)
    out = multi.forward_backward([Datum(model_input=tok, loss_fn_inputs={"target_tokens": targets, **lfi})], "importance_sampling")
    flat = MockTrainer("m", V)
    spelled = [
        Datum(
            model_input=tok,
            loss_fn_inputs={"target_tokens": [t[k] for t in targets], **{key: [row[k] for row in v] for key, v in lfi.items()}},
        )
        for k in range(2)
    ]
    ref = flat.forward_backward(spelled, "importance_sampling")
    got = np.asarray(out.loss_fn_outputs[0]["logprobs"].data).reshape(3, 2)
    for k in range(2):
        np.testing.assert_allclose(got[:, k], ref.loss_fn_outputs[k]["logprobs"].data)
    assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"])
    np.testing.assert_allclose(multi.grad, flat.grad)
