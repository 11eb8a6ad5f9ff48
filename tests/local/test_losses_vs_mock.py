"""Differential: the torch losses (local) and the numpy losses (mock) agree on random datums,
values and per-token gradients g = −dL/dp, for every loss and config."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
mock_losses = pytest.importorskip("asyncsess_mock.losses")

from asyncsess_local.losses import datum_loss  # noqa: E402

pytestmark = pytest.mark.local

CONFIGS = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {}),
    ("dro", {"beta": 0.3}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.6}),
]


def _datums(rng, loss_fn, with_weights):
    out = []
    for n in rng.integers(1, 9, size=4):
        d = {"p": -rng.exponential(1.5, n), "q": -rng.exponential(1.5, n), "A": rng.normal(0, 1, n) * (rng.random(n) > 0.2)}
        if loss_fn == "cross_entropy" or with_weights:
            d["weights"] = rng.normal(0.5, 1.0, n) * (rng.random(n) > 0.3)  # real-valued, negative allowed
        if loss_fn == "gspo":
            d["sequence_ratio_mask"] = (rng.random(n) > 0.3).astype(float)
        out.append(d)
    return out


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize(("loss_fn", "config"), CONFIGS, ids=[f"{c[0]}-{c[1]}" for c in CONFIGS])
@pytest.mark.parametrize("seed", range(5))
def test_torch_and_numpy_losses_agree(loss_fn, config, with_weights, seed):
    rng = np.random.default_rng(seed)
    data = _datums(rng, loss_fn, with_weights)
    keys = {"logprobs": "q", "advantages": "A"}

    def inputs_of(d):
        out = {} if loss_fn == "cross_entropy" else {k: d[v] for k, v in keys.items()}
        for k in ("weights", "sequence_ratio_mask"):
            if k in d:
                out[k] = d[k]
        return out

    # numpy: one flat batch with a segment index per token
    flat = {k: np.concatenate([inputs_of(d)[k] for d in data]) for k in inputs_of(data[0])}
    seg = np.concatenate([np.full(len(d["p"]), i) for i, d in enumerate(data)])
    ref_loss, ref_g = mock_losses.compute_loss(loss_fn, np.concatenate([d["p"] for d in data]), flat, config, seg)

    total, grads = 0.0, []
    for d in data:
        p = torch.tensor(d["p"], dtype=torch.float64, requires_grad=True)
        loss = datum_loss(loss_fn, p, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs_of(d).items()}, config)
        loss.backward()
        total += float(loss.detach())
        grads.append(-p.grad.numpy())
    assert total == pytest.approx(ref_loss, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(np.concatenate(grads), ref_g, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_per_token_clip_bounds_agree(loss_fn):
    """Hand-made: ratios on both sides of bounds that differ per token."""
    p = np.array([-0.5, -1.2, -2.0, -0.3, -0.9])
    inputs = {
        "logprobs": np.array([-0.7, -1.1, -2.6, -0.3, -1.4]),
        "advantages": np.array([1.0, 0.5, -2.0, 0.7, -1.0]),
        "clip_low_threshold": np.array([0.8, 0.95, 0.0, 0.5, 0.9]),
        "clip_high_threshold": np.array([1.1, 1.5, 4.0, 1.0, 1.2]),
    }
    config = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}  # overridden token by token
    ref_loss, ref_g = mock_losses.compute_loss(loss_fn, p, inputs, config, np.zeros(5, dtype=np.int64))
    pt = torch.tensor(p, dtype=torch.float64, requires_grad=True)
    loss = datum_loss(loss_fn, pt, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, config)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(-pt.grad.numpy(), ref_g, rtol=1e-12, atol=1e-12)
    scalar, _ = mock_losses.compute_loss(
        loss_fn, p, {k: inputs[k] for k in ("logprobs", "advantages")}, config, np.zeros(5, dtype=np.int64)
    )
    assert scalar != pytest.approx(ref_loss)  # the per-token bounds changed the loss


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_multi_target_losses_agree(loss_fn):
    """Hand-made (N, K) = (3, 2) case: every entry is one term; mock (flat) and local ((N, K) tensors) agree."""
    p = np.array([[-0.5, -2.5], [-1.2, -0.1], [-2.0, -3.0]])
    inputs = {"weights": np.array([[1.0, 0.5], [-1.0, 0.0], [0.25, 2.0]])}
    if loss_fn == "importance_sampling":
        inputs |= {
            "logprobs": np.array([[-0.7, -2.0], [-1.1, -0.3], [-2.6, -2.9]]),
            "advantages": np.array([[1.0, -1.0], [0.5, 2.0], [-2.0, 0.0]]),
        }
    ref_loss, ref_g = mock_losses.compute_loss(
        loss_fn, p.ravel(), {k: v.ravel() for k, v in inputs.items()}, None, np.zeros(6, dtype=np.int64)
    )
    pt = torch.tensor(p, dtype=torch.float64, requires_grad=True)
    loss = datum_loss(loss_fn, pt, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()})
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(-pt.grad.numpy().ravel(), ref_g, rtol=1e-12, atol=1e-12)
