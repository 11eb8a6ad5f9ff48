"""DPO and KTO as custom losses: hand-derived worked numbers (docs/losses.md), and the recipes on mock:// (need torch)."""

import pytest
import torch

from asyncsess.supervised.preference import dpo_loss, kto_loss
from asyncsess.types import Datum, ModelInput
from examples import dpo, kto

from .helpers import check_metrics_file

pytestmark = [pytest.mark.anyio, pytest.mark.torch]


def datum(weights: list[float]) -> Datum:
    n = len(weights)
    return Datum(model_input=ModelInput.from_ints([1] * n), loss_fn_inputs={"target_tokens": [1] * n, "weights": weights})


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_dpo_matches_the_worked_example():
    # Σp_c = -12, Σp_r = -15 over the completion tokens (weight 1); the prompt token (weight 0) is ignored
    data, lps = [datum([0, 1, 1]), datum([0, 1, 1])], [leaf([-50.0, -5.0, -7.0]), leaf([-50.0, -9.0, -6.0])]
    loss, metrics = dpo_loss([-13.0, -14.5], beta=0.1)(data, lps)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.620957, abs=1e-6)
    assert metrics["chosen_reward"] == pytest.approx(0.1, abs=1e-6) and metrics["rejected_reward"] == pytest.approx(-0.05, abs=1e-6)
    assert metrics["margin"] == pytest.approx(0.15, abs=1e-6) and metrics["accuracy"] == 1.0
    assert (-lps[0].grad).tolist() == pytest.approx([0, 0.046257, 0.046257], abs=1e-6)
    assert (-lps[1].grad).tolist() == pytest.approx([0, -0.046257, -0.046257], abs=1e-6)


def test_kto_matches_the_worked_example():
    # r = Σ(p - ref) = 1.0 for both; a third example at r = -1.4 puts the batch mean, z0, at 0.2
    data = [datum([1, 1]), datum([1, 1]), datum([1, 1])]
    lps = [leaf([-1.0, -2.0]), leaf([-1.0, -2.0]), leaf([-2.0, -2.4])]
    loss, metrics = kto_loss([-4.0, -4.0, -3.0], [True, False, True], beta=0.1)(data, lps)
    assert metrics["kl_ref_point"] == pytest.approx(0.2, abs=1e-6)
    desirable, undesirable = 0.480011, 0.519989
    third = 1 - torch.sigmoid(torch.tensor(0.1 * (-1.4 - 0.2))).item()
    assert float(loss.detach()) == pytest.approx((desirable + undesirable + third) / 3, abs=1e-6)
    loss.backward()
    assert (-lps[0].grad)[0] > 0 > (-lps[1].grad)[0]  # push desirable up, undesirable down


def test_kto_reference_point_is_clipped_at_zero():
    _, metrics = kto_loss([0.0], [True])([datum([1])], [leaf([-1.0])])
    assert metrics["kl_ref_point"] == 0.0


async def test_dpo_recipe(tmp_path):
    summary = await dpo.main(["learning_rate=0.05", "num_epochs=4", f"run_dir={tmp_path}"])
    records = check_metrics_file(tmp_path, {"dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "test/accuracy"})
    losses = [r["dpo_loss"] for r in records if "dpo_loss" in r]
    assert summary["steps"] == len(losses) == 12
    assert losses[0] == pytest.approx(0.693147, abs=1e-4)  # log 2: the policy starts as its reference
    assert sum(losses[-3:]) < sum(losses[:3]) and summary["test/accuracy_before"] == 0.5


async def test_kto_recipe(tmp_path):
    summary = await kto.main(["learning_rate=0.05", "num_epochs=4", f"run_dir={tmp_path}"])
    records = check_metrics_file(tmp_path, {"kto_loss", "kl_ref_point", "reward_desirable", "reward_undesirable", "test/accuracy"})
    losses = [r["kto_loss"] for r in records if "kto_loss" in r]
    assert summary["steps"] == len(losses) == 12 and losses[0] == pytest.approx(0.5, abs=1e-4)
    assert sum(losses[-3:]) < sum(losses[:3]) and summary["test/accuracy_before"] == 0.5


def test_one_loop_config_keeps_dpo_pairs_whole_and_names_the_field():
    from pydantic import ValidationError

    from asyncsess.supervised.preference import PreferenceConfig, preference_accuracy

    with pytest.raises(ValidationError, match="batch_size"):
        PreferenceConfig(method="dpo", data="x.jsonl", batch_size=7)
    assert PreferenceConfig(method="kto", data="x.jsonl", batch_size=7).batch_size == 7
    with pytest.raises(ValidationError, match="method"):
        PreferenceConfig(method="ipo", data="x.jsonl")
    # DPO scores pairs by margin, KTO scores each example by the sign its label asks for
    assert preference_accuracy("dpo", [0.0, -1.0, -1.0, 0.0], [0.0] * 4, [True, False] * 2) == 0.5
    assert preference_accuracy("kto", [1.0, -1.0, 1.0], [0.0] * 3, [True, False, False]) == 2 / 3
