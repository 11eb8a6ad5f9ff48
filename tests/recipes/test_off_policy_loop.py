"""Off-policy correction in the GRPO loop on mock:// (staleness 3): stable, logged, and off at staleness 0."""

import numpy as np
import pytest

from asyncsess.rl import RLConfig
from asyncsess.runs.metrics import read_metrics

from .helpers import check_metrics_file
from .test_rl_loop import BASE, run, state

pytestmark = pytest.mark.anyio
STALE = BASE.model_copy(update={"max_staleness": 3, "max_steps": 24, "learning_rate": 0.5})
OFF_POLICY_KEYS = {
    "off_policy/kl",
    "off_policy/ratio_max",
    "off_policy/is_weight_mean",
    "off_policy/is_weight_max",
    "off_policy/clip_frac",
    "off_policy/mask_frac",
    "async/staleness_mean",
}


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_staleness_3_run_with_tis_stays_stable_and_learns(tmp_path, seed):
    cfg = STALE.model_copy(update={"seed": seed})
    assert cfg.off_policy == "tis" and cfg.is_cap == 2.0  # the defaults
    await run(cfg, [], tmp_path)
    records = [r for r in check_metrics_file(tmp_path, OFF_POLICY_KEYS) if "env/all/reward/total" in r]
    rewards = [r["env/all/reward/total"] for r in records]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards
    assert min(rewards[len(rewards) // 2 :]) > np.mean(rewards[:4])  # no collapse in the second half
    assert [r["async/staleness_max"] for r in records][3:] == [3] * (len(records) - 3)
    corrected = [r for r in records if "off_policy/is_weight_max" in r]
    assert corrected and all(r["off_policy/is_weight_max"] <= 2.0 + 1e-12 for r in corrected)
    assert any(r["off_policy/clip_frac"] > 0 for r in corrected)  # the cap did act
    assert any(r["off_policy/ratio_max"] > 2.0 for r in corrected)
    assert all(0.0 <= r["off_policy/kl"] < 0.5 for r in records), [r["off_policy/kl"] for r in records]


async def test_the_correction_changes_the_update_and_masks_drop_tokens(tmp_path):
    cfg = STALE.model_copy(update={"max_steps": 8})
    tis = await run(cfg, [], tmp_path / "tis")
    none = await run(cfg.model_copy(update={"off_policy": "none"}), [], tmp_path / "none")
    assert not np.array_equal((await state(tis.final_checkpoint.state_path))[0], (await state(none.final_checkpoint.state_path))[0])
    assert not any("off_policy/is_weight_max" in r for r in read_metrics(tmp_path / "none"))
    assert any(r.get("off_policy/kl", 0.0) > 0 for r in read_metrics(tmp_path / "none"))  # the KL is logged either way
    await run(cfg.model_copy(update={"off_policy": "geo_mask", "is_mask_low": 0.97, "is_mask_high": 1.03}), [], tmp_path / "geo")
    masked = [r["off_policy/mask_frac"] for r in read_metrics(tmp_path / "geo") if "off_policy/mask_frac" in r]
    assert any(0 < f for f in masked) and all(0 <= f <= 1 for f in masked)


async def test_at_staleness_0_the_correction_is_off_and_training_is_bit_identical(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 4, "seed": 3})
    assert cfg.max_staleness == 0
    on = await run(cfg, [], tmp_path / "tis")
    off = await run(cfg.model_copy(update={"off_policy": "none"}), [], tmp_path / "none")
    a, b = await state(on.final_checkpoint.state_path), await state(off.final_checkpoint.state_path)
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)
    records = read_metrics(tmp_path / "tis")
    assert not any("off_policy/is_weight_max" in r for r in records)
    assert all(0 <= r["off_policy/kl"] < 1e-9 for r in records if "off_policy/kl" in r)  # on-policy: p == q up to float32


def test_unknown_modes_name_the_field():
    with pytest.raises(ValueError, match="off_policy"):
        RLConfig(off_policy="TIS")


@pytest.mark.once  # long and Python-independent: one Python of the mock matrix runs it
async def test_tis_learns_faster_than_ppo_against_stale_behaviour_at_no_higher_kl(tmp_path):
    """Staleness 3, lr 1.0, 24 steps, 3 seeds: the default (TIS, anchor p) against the loop without correction
    (ppo clipped around the sampler's log-probs, which zeroes the gradient of the stale tokens outside the
    clip). Measured over seeds 0-17: final reward 0.57 vs 0.40, each batch of 3 seeds apart by 0.11 to 0.29,
    mean KL within 0.9-1.2x. With one optimizer step per batch the KL does not blow up without correction on
    mock:// (AdamW bounds each step; docs/recipes.md): the next test shows where it does."""
    cfg = BASE.model_copy(update={"max_staleness": 3, "max_steps": 24, "learning_rate": 1.0})
    finals: dict[str, list[float]] = {"tis": [], "none": []}
    kls: dict[str, list[float]] = {"tis": [], "none": []}
    for seed in range(3):
        for mode in finals:
            path = tmp_path / f"{mode}-{seed}"
            await run(cfg.model_copy(update={"seed": seed, "off_policy": mode}), [], path)
            records = [r for r in read_metrics(path) if "env/all/reward/total" in r]
            finals[mode].append(float(np.mean([r["env/all/reward/total"] for r in records[-5:]])))
            kls[mode].extend(r["off_policy/kl"] for r in records if "off_policy/kl" in r)
    assert np.mean(finals["tis"]) > np.mean(finals["none"]) + 0.05, finals
    assert np.mean(kls["tis"]) < 1.5 * np.mean(kls["none"]), (np.mean(kls["tis"]), np.mean(kls["none"]))


def _run_figures(path) -> tuple[float, float]:
    """The largest sampler-trainer KL of a run and its reward over the last 5 steps."""
    records = [r for r in read_metrics(path) if "env/all/reward/total" in r]
    rewards = [r["env/all/reward/total"] for r in records[-5:]]
    return max(r["off_policy/kl"] for r in records if "off_policy/kl" in r), float(np.mean(rewards))


@pytest.mark.once  # eight runs: one Python of the mock matrix runs it
async def test_without_correction_reused_stale_batches_blow_the_kl_up_and_the_default_keeps_it_near_on_policy(tmp_path):
    """The tinker-cookbook A/B at staleness 3 (unclipped IS about 30x the KL of PPO-clipped training, which matched
    on-policy accuracy), on mock://: 4 optimizer steps per batch (``epochs_per_batch``), lr 10, ``adam_eps`` 1 (an
    SGD-like step, so an unclipped ratio makes a large step, as in a shared-parameter model). Uncorrected
    (``importance_sampling``, ``off_policy="none"``) the ratio compounds over the epochs; the defaults (``ppo``
    clipped around the batch's proximal log-probs, TIS weights) hold each batch to the trust region. Measured
    over seeds 0-23 (docs/recipes.md): max KL 10.0-16.1 uncorrected against 0.7-2.1, ratio >= 5.5x on every
    seed; final reward 0.37 uncorrected, 0.79 corrected, 0.72 on-policy (staleness 0)."""
    cfg = BASE.model_copy(
        update={"max_staleness": 3, "max_steps": 30, "learning_rate": 10.0, "adam_eps": 1.0, "epochs_per_batch": 4, "group_size": 8}
    )
    assert cfg.loss_fn == "ppo" and cfg.off_policy == "tis"  # the defaults are the corrected arm
    ratios, finals = [], {"none": [], "tis": [], "on_policy": []}
    for seed in range(4):
        arms = {
            "none": cfg.model_copy(update={"seed": seed, "loss_fn": "importance_sampling", "off_policy": "none"}),
            "tis": cfg.model_copy(update={"seed": seed}),
            "on_policy": cfg.model_copy(update={"seed": seed, "max_staleness": 0}),
        }
        kl = {}
        for name, arm in arms.items():
            await run(arm, [], tmp_path / f"{name}-{seed}")
            kl[name], final = _run_figures(tmp_path / f"{name}-{seed}")
            finals[name].append(final)
        assert kl["none"] > 5.0 and kl["tis"] < 3.0 and kl["none"] > 3 * kl["tis"], (seed, kl)  # blown up / held
        assert kl["on_policy"] < 1e-6, kl  # staleness 0: p == q up to float32
        ratios.append(kl["none"] / kl["tis"])
    assert np.mean(ratios) > 5.0, ratios
    means = {k: float(np.mean(v)) for k, v in finals.items()}
    assert means["tis"] > means["none"] + 0.2, means  # the uncorrected run's reward collapses, the corrected one learns
    assert means["tis"] > means["on_policy"] - 0.15, means  # near on-policy


def test_epochs_per_batch_is_checked():
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="epochs_per_batch"):
            RLConfig(epochs_per_batch=bad)
