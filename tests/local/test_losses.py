"""The torch losses against every hand-derived worked number (the math: docs/losses.md) (values and g = −dL/dp)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from asyncsess_local.losses import datum_loss  # noqa: E402

pytestmark = pytest.mark.local

P = [-0.5, -1.2, -2.0]
Q = [-0.7, -1.1, -2.6]
A = [1.0, 0.5, -2.0]
W = [1.0, 1.0, 0.0]

CASES = [
    ("cross_entropy", {}, 1.700000, [1, 1, 0]),
    ("importance_sampling", {}, 1.970416, [1.221403, 0.452419, -3.644238]),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 1.991819, [0, 0.452419, -3.644238]),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -3.657098, [1.2, 0.452419, -2.4]),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, -6.134871, [1.221403, 0.452419, -3.644238]),
    ("dro", {"beta": 0.1}, -2.879500, [0.98, 0.51, -2.06]),
    ("dro", {}, -2.879500, [0.98, 0.51, -2.06]),  # beta defaults to 0.1
    ("dro", {"beta": 0.05}, -2.889750, [0.99, 0.505, -2.03]),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 0.725605, [0, 0, -2.525605]),
]


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def _loss_and_g(loss_fn, config, p_values, inputs):
    p = _t(p_values).requires_grad_(True)
    loss = datum_loss(loss_fn, p, {k: _t(v) for k, v in inputs.items()}, config)
    loss.backward()
    return float(loss.detach()), (-p.grad).tolist()


@pytest.mark.parametrize(("loss_fn", "config", "value", "grad"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_worked_example(loss_fn, config, value, grad):
    inputs = {"weights": W} if loss_fn == "cross_entropy" else {"logprobs": Q, "advantages": A}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = [1.0, 1.0, 1.0]
    loss, g = _loss_and_g(loss_fn, config, P, inputs)
    assert loss == pytest.approx(value, abs=1e-6)
    assert g == pytest.approx(grad, abs=1e-6)


def test_gspo_mask_defaults_to_every_token():
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    loss, g = _loss_and_g("gspo", cfg, P, {"logprobs": Q, "advantages": A})
    assert loss == pytest.approx(0.725605, abs=1e-6)
    assert g == pytest.approx([0, 0, -2.525605], abs=1e-6)


def test_gspo_ratio_uses_only_masked_tokens():
    # with M = [1, 0, 0] the ratio is r_0 = 1.221403 (> 1.2): positive advantages are clipped, the negative one is not
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
    loss, g = _loss_and_g("gspo", cfg, P, {"logprobs": Q, "advantages": A, "sequence_ratio_mask": [1.0, 0.0, 0.0]})
    s = 1.2214027581601699
    assert loss == pytest.approx(-(s * 1.0 + s * 0.5 - s * 2.0), abs=1e-6)
    assert g == pytest.approx([s, s * 0.5, -2 * s], abs=1e-6)


def test_gspo_ratio_is_the_mask_weighted_mean():
    """A fractional mask weights the mean: [0.5, 0, 0] gives the ratio of [1, 0, 0] (it was divided by at least 1,
    so the ratio shrank toward 1 and differed from mock://)."""
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
    whole = _loss_and_g("gspo", cfg, P, {"logprobs": Q, "advantages": A, "sequence_ratio_mask": [1.0, 0.0, 0.0]})
    half = _loss_and_g("gspo", cfg, P, {"logprobs": Q, "advantages": A, "sequence_ratio_mask": [0.5, 0.0, 0.0]})
    assert half[0] == pytest.approx(whole[0], abs=1e-9) and half[1] == pytest.approx(whole[1], abs=1e-9)
    empty = _loss_and_g("gspo", cfg, P, {"logprobs": Q, "advantages": A, "sequence_ratio_mask": [0.0, 0.0, 0.0]})
    assert empty[0] == pytest.approx(-(1.0 + 0.5 - 2.0), abs=1e-9)  # no tokens in M: s = 1


def test_rl_weights_mask_tokens():
    loss, g = _loss_and_g("importance_sampling", {}, P, {"logprobs": Q, "advantages": A, "weights": [1.0, 0.0, 1.0]})
    assert loss == pytest.approx(-(1.221403 - 3.644238), abs=1e-6)
    assert g == pytest.approx([1.221403, 0.0, -3.644238], abs=1e-6)
    # DRO's penalty does not vanish where A = 0, but the weights mask removes it
    loss, g = _loss_and_g("dro", {"beta": 0.1}, [-0.5], {"logprobs": [-0.7], "advantages": [0.0], "weights": [0.0]})
    assert loss == 0.0 and g == [0.0]
    loss, g = _loss_and_g("dro", {"beta": 0.1}, [-0.5], {"logprobs": [-0.7], "advantages": [0.0]})
    assert loss == pytest.approx(0.5 * 0.1 * 0.04) and g == pytest.approx([-0.02])


def test_two_datums_sum_and_caller_normalisation():
    d1 = {"p": [-2.0, -0.4, -0.9], "q": [-2.0, -0.5, -0.8], "w": [0, 1, 1], "A": [0, 0.5, 0.5]}
    d2 = {"p": [-1.5, -0.2, -0.3, -1.1], "q": [-1.5, -0.2, -0.5, -1.0], "w": [0, 0, 1, 1], "A": [0, 0, -0.5, -0.5]}

    def total(loss_fn, config, weight_scale=lambda d: 1.0):
        out = 0.0
        for d in (d1, d2):
            inputs = (
                {"weights": [w * weight_scale(d) for w in d["w"]]}
                if loss_fn == "cross_entropy"
                else {"logprobs": d["q"], "advantages": d["A"]}
            )
            out += _loss_and_g(loss_fn, config, d["p"], inputs)[0]
        return out

    assert total("cross_entropy", {}) == pytest.approx(2.7)
    assert total("cross_entropy", {}, lambda d: 1 / 4) == pytest.approx(0.675)
    assert total("cross_entropy", {}, lambda d: 1 / sum(d["w"])) == pytest.approx(1.35)
    assert total("importance_sampling", {}) == pytest.approx(0.058116, abs=1e-6)
    assert total("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}) == pytest.approx(0.058116, abs=1e-6)


def test_custom_loss_lowering_of_is_gives_the_cispo_surrogate():
    # sending w = r·A to cross_entropy reproduces IS's gradient; the CE value is then −6.134871
    loss, g = _loss_and_g("cross_entropy", {}, P, {"weights": [1.221403, 0.452419, -3.644238]})
    assert loss == pytest.approx(-6.134871, abs=1e-5)
    assert g == pytest.approx([1.221403, 0.452419, -3.644238], abs=1e-6)


@pytest.mark.parametrize(("loss_fn", "config"), [(c[0], c[1]) for c in CASES if c[0] != "cross_entropy"], ids=str)
def test_very_negative_sampler_logprobs_never_overflow_in_float32(loss_fn, config):
    """exp(p − q) overflowed to inf in fp32 (q = −100 is enough) and inf·0 made NaN gradients: the log-ratio is
    capped at 20, exactly as in the mock."""
    from asyncsess_mock.losses import compute_loss

    q, adv = [-80.0, -1e6, -0.7, -100.0], [1.0, -1.0, 0.5, 0.0]
    p = torch.full((4,), -0.5, dtype=torch.float32, requires_grad=True)
    inputs = {"logprobs": torch.tensor(q), "advantages": torch.tensor(adv)}
    loss = datum_loss(loss_fn, p, inputs, config)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(p.grad).all()
    ref_loss, ref_g = compute_loss(loss_fn, p.detach().double().numpy(), {k: v.double().numpy() for k, v in inputs.items()}, config)
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert (-p.grad).tolist() == pytest.approx(ref_g.tolist(), rel=1e-5, abs=1e-5)
