"""rl/off_policy.py against hand-computed numbers and edge values (torch-free)."""

import math

import numpy as np
import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.rl import RLConfig, rl_datum
from asyncsess.rl.off_policy import correct_datums, importance_weights, off_policy_metrics

LN2 = math.log(2.0)
# one datum: a prompt position (mask 0) and three sampled tokens with log-ratios p - q = ln 3, 0, -ln 4
Q = [[0.0, -1.0, -2.0, -0.5]]
P = [[-7.0, -1.0 + math.log(3.0), -2.0, -0.5 - math.log(4.0)]]
M = [[0.0, 1.0, 1.0, 1.0]]


def weights(mode: str, **kw) -> list[float]:
    return importance_weights(Q, P, M, mode, **kw).weights[0].tolist()


def test_token_tis_truncates_each_ratio_at_the_cap():
    c = importance_weights(Q, P, M, "tis", cap=2.0)
    assert c.weights[0].tolist() == pytest.approx([0.0, 2.0, 1.0, 0.25])
    assert c.truncated[0].tolist() == [False, True, False, False] and not c.dropped[0].any()


def test_token_mis_drops_tokens_outside_the_bounds():
    c = importance_weights(Q, P, M, "mis", low=0.5, high=2.0)
    assert c.weights[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert c.dropped[0].tolist() == [False, True, False, True]
    assert weights("mis", low=0.2, high=4.0) == [0.0, 1.0, 1.0, 1.0]


def test_sequence_tis_uses_the_product_of_ratios():
    # Σ(p - q) = ln 3 - ln 4: w = 3/4 on every sampled token, below the cap
    assert weights("seq_tis", cap=2.0) == pytest.approx([0.0, 0.75, 0.75, 0.75])
    c = importance_weights(Q, [[0.0, -1.0 + 5.0, -2.0, -0.5]], M, "seq_tis", cap=2.0)  # e^5 capped
    assert c.weights[0].tolist() == pytest.approx([0.0, 2.0, 2.0, 2.0]) and c.truncated[0].tolist() == [False, True, True, True]


def test_sequence_masks_drop_the_whole_datum():
    assert weights("seq_mis", low=0.5, high=2.0) == [0.0, 1.0, 1.0, 1.0]  # 3/4 is inside
    assert weights("seq_mis", low=0.8, high=2.0) == [0.0, 0.0, 0.0, 0.0]
    # geometric: exp(mean) = (3/4)^(1/3) = 0.9086
    assert weights("geo_mask", low=0.9, high=1.1) == [0.0, 1.0, 1.0, 1.0]
    assert weights("geo_mask", low=0.95, high=1.05) == [0.0, 0.0, 0.0, 0.0]


def test_none_is_the_loss_mask():
    assert weights("none") == [0.0, 1.0, 1.0, 1.0]


def test_huge_log_ratios_do_not_overflow():
    q, p, m = [[-800.0, -1e-300, -5e-324]], [[0.0, -900.0, 0.0]], [[1.0, 1.0, 1.0]]  # subnormal log-probs too
    for mode in ("tis", "seq_tis", "mis", "seq_mis", "geo_mask"):
        w = importance_weights(q, p, m, mode).weights[0]
        assert np.isfinite(w).all() and (w >= 0).all(), mode
    assert importance_weights(q, p, m, "tis").weights[0].tolist() == pytest.approx([2.0, 0.0, 1.0])
    assert math.isfinite(off_policy_metrics(q, p, m)["off_policy/kl"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["behaviour", "proximal"])
def test_non_finite_log_probs_on_sampled_tokens_are_an_error(bad, which):
    q, p = [[0.0, -1.0, -1.0]], [[0.0, -1.0, -1.0]]
    (q if which == "behaviour" else p)[0][2] = bad
    with pytest.raises(InvalidInputError, match=rf"{which}\[0\]\[2\].*not finite"):
        importance_weights(q, p, [[0.0, 1.0, 1.0]], "tis")
    # off the loss mask (a prompt position) it is not used, so it is no error
    (q if which == "behaviour" else p)[0][0] = bad
    (q if which == "behaviour" else p)[0][2] = -1.0
    assert importance_weights(q, p, [[0.0, 1.0, 1.0]], "tis").weights[0].tolist() == [0.0, 1.0, 1.0]


def test_mismatched_shapes_and_unknown_modes_are_errors():
    with pytest.raises(InvalidInputError, match=r"proximal\[0\]"):
        importance_weights([[0.0, -1.0]], [[0.0]], [[0.0, 1.0]], "tis")
    with pytest.raises(InvalidInputError, match="proximal"):
        importance_weights([[0.0]], [], [[1.0]], "tis")
    with pytest.raises(InvalidInputError, match="off_policy"):
        importance_weights(Q, P, M, "vtrace")  # type: ignore[arg-type]


def test_empty_and_all_masked_batches():
    empty = importance_weights([], [], [], "tis")
    assert empty.weights == [] and off_policy_metrics([], [], [], empty) == {}
    masked = importance_weights([[0.0, -1.0]], [[-3.0, -2.0]], [[0.0, 0.0]], "geo_mask")
    assert masked.weights[0].tolist() == [0.0, 0.0] and not masked.dropped[0].any()
    assert off_policy_metrics([[0.0, -1.0]], [[-3.0, -2.0]], [[0.0, 0.0]], masked) == {}
    assert importance_weights([[]], [[]], [[]], "seq_tis").weights[0].tolist() == []


def test_metrics_by_hand():
    c = importance_weights(Q, P, M, "tis", cap=2.0)
    m = off_policy_metrics(Q, P, M, c)
    # k3 = (r - 1) - log r over r = 3, 1, 1/4
    k3 = [(3 - 1) - math.log(3), 0.0, (0.25 - 1) - math.log(0.25)]
    assert m["off_policy/kl"] == pytest.approx(sum(k3) / 3)
    assert m["off_policy/is_weight_mean"] == pytest.approx((2 + 1 + 0.25) / 3)
    assert m["off_policy/is_weight_max"] == pytest.approx(2.0)
    assert m["off_policy/clip_frac"] == pytest.approx(1 / 3) and m["off_policy/mask_frac"] == 0.0
    mis = off_policy_metrics(Q, P, M, importance_weights(Q, P, M, "mis"))
    assert mis["off_policy/mask_frac"] == pytest.approx(2 / 3) and mis["off_policy/is_weight_mean"] == pytest.approx(1 / 3)
    assert m["off_policy/ratio_max"] == pytest.approx(3.0)
    assert set(off_policy_metrics(Q, P, M)) == {"off_policy/kl", "off_policy/ratio_max"}
    assert off_policy_metrics(Q, Q, M)["off_policy/kl"] == 0.0  # on-policy


def test_correct_datums_anchors_on_the_proximal_log_probs_and_scales_advantages():
    d = rl_datum([5, 6], [7, 8, 9], [-1.0, -2.0, -0.5], advantage=-0.5)
    c = importance_weights(Q, P, M, "tis", cap=2.0)
    (out,) = correct_datums([d], P, c)
    assert out.loss_fn_inputs["logprobs"].data == pytest.approx(P[0])
    assert out.loss_fn_inputs["advantages"].data == pytest.approx([0.0, -1.0, -0.5, -0.125])
    assert out.loss_fn_inputs["target_tokens"].data == d.loss_fn_inputs["target_tokens"].data
    assert d.loss_fn_inputs["advantages"].data == [0.0, -0.5, -0.5, -0.5]  # the input is not changed


def test_config_fields_are_validated():
    assert RLConfig().off_policy == "tis" and RLConfig().is_cap == 2.0
    for bad in (
        {"off_policy": "vtrace"},
        {"is_cap": 0.5},
        {"is_cap": math.inf},
        {"is_cap": math.nan},
        {"is_mask_low": 1.5},
        {"is_mask_low": -0.1},
        {"is_mask_high": 0.9},
        {"is_mask_high": math.inf},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RLConfig(**bad)


@pytest.mark.anyio
async def test_correct_batch_takes_the_proximal_log_probs_from_one_forward():
    from asyncsess import ServiceClient
    from asyncsess.rl.off_policy import correct_batch

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client(base_model="mock/bigram-tiny", rank=4)
        d = rl_datum([5, 6], [7, 8, 9], [-9.0, -0.1, -3.0], advantage=1.0)
        mask = [0.0, 1.0, 1.0, 1.0]
        truth = (await tc.forward([d], "importance_sampling")).loss_fn_outputs[0]["logprobs"].data
        ((out, m),), c = await correct_batch(tc, [(d, mask)], "tis", cap=2.0, low=0.5, high=2.0)
        assert m == mask and out.loss_fn_inputs["logprobs"].data == pytest.approx(truth)
        q = d.loss_fn_inputs["logprobs"].data
        want = [0.0] + [min(math.exp(p - x), 2.0) for p, x in zip(truth[1:], q[1:])]
        assert c.weights[0].tolist() == pytest.approx(want) and out.loss_fn_inputs["advantages"].data == pytest.approx(want)
        bad = rl_datum([5, 6], [7, 8, 9], [-1.0, math.nan, -1.0], advantage=1.0)
        with pytest.raises(InvalidInputError, match=r"behaviour\[0\]\[2\]"):
            await correct_batch(tc, [(bad, mask)], "tis", cap=2.0, low=0.5, high=2.0)
