"""Every hand-derived worked number for the losses of docs/losses.md, value and per-token g, to 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

from asyncsess.errors import InvalidInputError, UnsupportedError
from asyncsess_mock.losses import compute_loss, parse_config

P = np.array([-0.5, -1.2, -2.0])
Q = np.array([-0.7, -1.1, -2.6])
A = np.array([1.0, 0.5, -2.0])
W = np.array([1.0, 1.0, 0.0])
R = np.exp(P - Q)

ROWS = [
    ("cross_entropy", None, 1.700000, [1, 1, 0]),
    ("importance_sampling", None, 1.970416, [1.221403, 0.452419, -3.644238]),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 1.991819, [0, 0.452419, -3.644238]),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -3.657098, [1.2, 0.452419, -2.4]),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, -6.134871, [1.221403, 0.452419, -3.644238]),
    ("dro", {"beta": 0.1}, -2.879500, [0.98, 0.51, -2.06]),
    ("dro", {"beta": 0.05}, -2.889750, [0.99, 0.505, -2.03]),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 0.725605, [0, 0, -2.525605]),
]


def _inputs(loss_fn: str) -> dict[str, np.ndarray]:
    if loss_fn == "cross_entropy":
        return {"weights": W}
    out = {"logprobs": Q, "advantages": A}
    if loss_fn == "gspo":
        out["sequence_ratio_mask"] = np.ones(3)
    return out


@pytest.mark.parametrize(("loss_fn", "config", "value", "g"), ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_worked_numbers(loss_fn, config, value, g):
    loss, grad = compute_loss(loss_fn, P, _inputs(loss_fn), config)
    assert loss == pytest.approx(value, abs=1e-6)
    np.testing.assert_allclose(grad, g, atol=1e-6)


def test_ratio_column_and_gspo_sequence_ratio():
    np.testing.assert_allclose(R, [1.221403, 0.904837, 1.822119], atol=1e-6)
    assert np.exp(np.mean(P - Q)) == pytest.approx(1.262802, abs=1e-6)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_clip_defaults_are_0_8_and_1_2(loss_fn):
    explicit = compute_loss(loss_fn, P, _inputs(loss_fn), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    default = compute_loss(loss_fn, P, _inputs(loss_fn), None)
    assert default[0] == explicit[0]
    np.testing.assert_array_equal(default[1], explicit[1])


def test_dro_default_beta_is_0_1():
    assert compute_loss("dro", P, _inputs("dro"))[0] == pytest.approx(-2.879500, abs=1e-6)


def test_custom_loss_lowering_of_is_gives_cispo_unbounded_surrogate():
    _, g_is = compute_loss("importance_sampling", P, _inputs("importance_sampling"))
    surrogate, g_ce = compute_loss("cross_entropy", P, {"weights": g_is})
    assert surrogate == pytest.approx(-6.134871, abs=1e-6)
    np.testing.assert_allclose(g_ce, g_is)


# ---- two datums: sums over datums, masking and caller-side normalization ----------------------------

P2 = [np.array([-2.0, -0.4, -0.9]), np.array([-1.5, -0.2, -0.3, -1.1])]
Q2 = [np.array([-2.0, -0.5, -0.8]), np.array([-1.5, -0.2, -0.5, -1.0])]
W2 = [np.array([0.0, 1, 1]), np.array([0.0, 0, 1, 1])]
A2 = [np.array([0.0, 0.5, 0.5]), np.array([0.0, 0, -0.5, -0.5])]
SEG = np.repeat([0, 1], [3, 4])


def _cat(parts):
    return np.concatenate(parts)


def test_two_datum_cross_entropy_and_normalizations():
    p = _cat(P2)
    assert compute_loss("cross_entropy", p, {"weights": _cat(W2)}, seg=SEG)[0] == pytest.approx(2.7, abs=1e-6)
    assert compute_loss("cross_entropy", p, {"weights": _cat(W2) / 4}, seg=SEG)[0] == pytest.approx(0.675, abs=1e-6)
    per_seq = _cat([w / w.sum() for w in W2])
    assert compute_loss("cross_entropy", p, {"weights": per_seq}, seg=SEG)[0] == pytest.approx(1.35, abs=1e-6)
    per_datum = [compute_loss("cross_entropy", p_, {"weights": w})[0] for p_, w in zip(P2, W2)]
    assert per_datum == pytest.approx([1.3, 1.4], abs=1e-6)


@pytest.mark.parametrize("with_weights", [False, True], ids=["tinker-no-weights", "sagemaker-weights-mask"])
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_two_datum_rl_losses(loss_fn, with_weights):
    inputs = {"logprobs": _cat(Q2), "advantages": _cat(A2)}
    if with_weights:
        inputs["weights"] = _cat(W2)  # a mask equal to A != 0 changes nothing
    assert compute_loss(loss_fn, _cat(P2), inputs, seg=SEG)[0] == pytest.approx(0.058116, abs=1e-6)
    per_datum = [compute_loss(loss_fn, p, {"logprobs": q, "advantages": a})[0] for p, q, a in zip(P2, Q2, A2)]
    assert per_datum == pytest.approx([-1.005004, 1.063120], abs=1e-6)


def test_rl_weights_multiply_per_token_terms():
    w = np.array([0.0, 2.0, 1.0])
    for loss_fn in ["importance_sampling", "ppo", "cispo", "dro", "gspo"]:
        base_loss, base_g = compute_loss(loss_fn, P, _inputs(loss_fn))
        loss, g = compute_loss(loss_fn, P, {**_inputs(loss_fn), "weights": w})
        np.testing.assert_allclose(g, w * base_g, err_msg=loss_fn)
        assert loss != pytest.approx(base_loss), loss_fn


def test_dro_penalty_does_not_vanish_where_advantage_is_zero():
    loss, g = compute_loss("dro", np.array([-1.0]), {"logprobs": np.array([-2.0]), "advantages": np.array([0.0])}, {"beta": 0.1})
    assert loss == pytest.approx(0.05)
    assert g[0] == pytest.approx(-0.1)


def test_gspo_is_per_sequence_and_respects_the_mask():
    # datum 0: the table's case; datum 1: same tokens but only t0 in the ratio mask -> s = exp(0.2)
    p, q, a = np.tile(P, 2), np.tile(Q, 2), np.tile(A, 2)
    mask = np.array([1, 1, 1, 1, 0, 0.0])
    loss, g = compute_loss("gspo", p, {"logprobs": q, "advantages": a, "sequence_ratio_mask": mask}, seg=np.repeat([0, 1], 3))
    np.testing.assert_allclose(g[:3], [0, 0, -2.525605], atol=1e-6)
    s1 = np.exp(0.2)  # 1.2214 > 1.2: positive advantages clipped, negative one flows
    np.testing.assert_allclose(g[3:], [0, 0, -2 * s1], atol=1e-6)
    assert loss == pytest.approx(0.725605 - (1.2 + 0.6 - 2 * s1), abs=1e-6)


def test_per_token_clip_thresholds_override_config():
    inputs = {**_inputs("ppo"), "clip_high_threshold": np.array([1.3, 1.2, 1.2])}
    _, g = compute_loss("ppo", P, inputs)
    np.testing.assert_allclose(g, [1.221403, 0.452419, -3.644238], atol=1e-6)  # t0 no longer clipped


def test_config_is_validated():
    with pytest.raises(UnsupportedError) as err:
        parse_config("stable_reinforce", None)
    assert err.value.field == "loss_fn"
    with pytest.raises(InvalidInputError) as err:
        parse_config("ppo", {"beta": 0.1})
    assert err.value.field == "loss_fn_config"
    with pytest.raises(InvalidInputError) as err:
        parse_config("cross_entropy", {"clip_low_threshold": 0.8})
    assert err.value.field == "loss_fn_config"
    with pytest.raises(InvalidInputError) as err:
        parse_config("dro", {"beta": "x"})
    assert "beta" in err.value.field


EXTREME_Q = np.array([-80.0, -1e6, -0.7, -90.0])  # legal sampler log-probs: a bf16 sampler's -80, the -1e6 floor


@pytest.mark.parametrize(("loss_fn", "config"), [(r[0], r[1]) for r in ROWS if r[0] != "cross_entropy"])
def test_very_negative_sampler_logprobs_never_overflow(loss_fn, config):
    """exp(p − q) overflowed to inf (q = −1e6), inf·0 gave NaN where A = 0: the log-ratio is capped at 20."""
    p = np.array([-0.5, -0.5, -0.5, -0.5])
    inputs = {"logprobs": EXTREME_Q, "advantages": np.array([1.0, -1.0, 0.5, 0.0])}
    with np.errstate(over="raise", invalid="raise"):
        loss, g = compute_loss(loss_fn, p, inputs, config)
    assert np.isfinite(loss) and np.isfinite(g).all()
    if loss_fn in ("importance_sampling", "ppo"):  # past the cap the ratio is constant: no gradient through it
        assert g[0] == g[1] == 0.0 and g[3] == 0.0
    if loss_fn == "importance_sampling":
        assert loss == pytest.approx(-(np.exp(20.0) * (1 - 1) + 0.5 * np.exp(0.2)))
