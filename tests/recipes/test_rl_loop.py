"""The GRPO loop on mock://: learning, bounded staleness, and bit-exact resume."""

import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.rl import (
    Problem,
    ProblemDataset,
    ProblemEnv,
    ProblemGroupBuilder,
    PromptRenderer,
    RLConfig,
    RLResult,
    StepResult,
    problem_datasets,
    train_rl,
)
from asyncsess.runs.checkpoints import last_checkpoint
from asyncsess.runs.metrics import read_metrics

from .helpers import check_metrics_file, digit_share

pytestmark = pytest.mark.anyio
PROBLEMS = [Problem(f"Code {i}:", "0") for i in range(12)]
BASE = RLConfig(url="mock://", groups_per_batch=4, group_size=4, max_tokens=8, learning_rate=0.3, lora_rank=4, normalize_std=False)


async def run(cfg: RLConfig, test: list[Problem], run_dir, **kwargs) -> RLResult:
    """GRPO on PROBLEMS graded by the share of digits, ``test`` held out."""
    return await train_rl(cfg, problem_datasets(PROBLEMS, test, digit_share, cfg), run_dir, progress=False, **kwargs)


async def state(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weights and AdamW state stored at a mock:// checkpoint path."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_training_client_from_state_with_optimizer(path)
        m, v, step = svc.backend.optimizer_state(tc.model_id)
        return svc.backend.weights(tc.model_id), m, v, step


def comparable(records: list[dict]) -> list[dict]:
    """Records without wall-clock figures."""
    return [
        {k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("_per_s") or k == "progress/done_frac")} for r in records
    ]


async def test_reward_rises_and_metrics_are_well_formed(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 15, "seed": 1, "group_size": 8, "learning_rate": 0.5})
    result = await run(cfg, PROBLEMS[:4], tmp_path)
    records = check_metrics_file(
        tmp_path,
        {
            "env/all/reward/total",
            "env/all/correct",
            "optim/loss",
            "optim/kl_sample_train_v1",
            "optim/kl_sample_train_v2",
            "optim/entropy",
            "async/staleness_max",
            "tokens/sampled_per_s",
            "time/step",
            "test/env/all/correct",
        },
    )
    rewards = [r["env/all/reward/total"] for r in records if "env/all/reward/total" in r]
    assert len(rewards) == 15 and np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2
    assert result.steps == 15 and result.after["test/env/all/reward/total"] > result.before["test/env/all/reward/total"]
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-5 for r in records if "optim/kl_sample_train_v1" in r)  # on-policy


async def test_groups_are_at_most_k_steps_old(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 6, "max_staleness": 2})
    await run(cfg, [], tmp_path)
    records = [r for r in read_metrics(tmp_path) if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in records] == [0, 1, 2, 2, 2, 2]
    assert all(r["async/staleness_min"] == r["async/staleness_max"] for r in records)
    # off-policy groups: the trainer's log-probs differ from the sampler's
    assert any(abs(r.get("optim/kl_sample_train_v1", 0.0)) > 1e-4 for r in records[2:])


@pytest.mark.parametrize(("k", "epochs"), [(0, 1), (2, 1), (2, 3)])
async def test_resume_is_bit_exact(tmp_path, k, epochs):
    cfg = BASE.model_copy(update={"max_steps": 6, "save_every": 3, "max_staleness": k, "seed": 5, "epochs_per_batch": epochs})
    whole = await run(cfg, PROBLEMS[:4], tmp_path / "whole")
    first = await run(cfg.model_copy(update={"max_steps": 3}), PROBLEMS[:4], tmp_path / "split")
    assert first.steps == 3 and last_checkpoint(tmp_path / "split").step == 3
    resumed = await run(cfg, PROBLEMS[:4], tmp_path / "split")
    assert resumed.steps == 6 and resumed.before == whole.before and resumed.after == whole.after
    a, b = await state(whole.final_checkpoint.state_path), await state(resumed.final_checkpoint.state_path)
    assert a[3] == b[3] == 6 * epochs  # AdamW steps: epochs_per_batch per batch
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)
    assert comparable(read_metrics(tmp_path / "whole")) == comparable(read_metrics(tmp_path / "split"))


class InlineEnv(ProblemEnv):
    """Grades on the event loop, as ProblemEnv did before graders ran in threads."""

    async def step(self, action):
        reward, metrics = self.grader(self.problem, self.renderer.reply(action))
        return StepResult(reward, True, metrics=metrics)


class InlineBuilder(ProblemGroupBuilder):
    async def make_envs(self):
        return [InlineEnv(self.renderer, self.problem, self.grader) for _ in range(self.group_size)]


@pytest.mark.parametrize("k", [0, 2])
async def test_grading_in_threads_changes_no_result(tmp_path, k):
    """Same seed, same rewards in the same order, same weights, graded in threads or on the loop."""
    cfg = BASE.model_copy(update={"max_steps": 6, "max_staleness": k, "seed": 5})

    def inline(tokenizer):
        renderer = PromptRenderer(tokenizer)
        build = lambda p, n=cfg.group_size: InlineBuilder(renderer, p, digit_share, n)  # noqa: E731
        return ProblemDataset(PROBLEMS, cfg.groups_per_batch, build, cfg.seed), [build(p, 1) for p in PROBLEMS[:4]]

    threaded = await run(cfg, PROBLEMS[:4], tmp_path / "threaded")
    loop = await train_rl(cfg, inline, tmp_path / "loop", progress=False)
    assert threaded.before == loop.before and threaded.after == loop.after
    a, b = await state(threaded.final_checkpoint.state_path), await state(loop.final_checkpoint.state_path)
    assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
    assert comparable(read_metrics(tmp_path / "threaded")) == comparable(read_metrics(tmp_path / "loop"))


async def test_kl_penalty_changes_the_update(tmp_path):
    plain = await run(BASE.model_copy(update={"max_steps": 2}), [], tmp_path / "a")
    cfg = BASE.model_copy(update={"max_steps": 2, "kl_penalty_coef": 0.5, "max_staleness": 1})
    kl = await run(cfg, [], tmp_path / "b")
    assert not np.array_equal((await state(plain.final_checkpoint.state_path))[0], (await state(kl.final_checkpoint.state_path))[0])


async def test_a_spent_time_budget_starts_no_step(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 5, "max_minutes": 0.0})
    result = await run(cfg, PROBLEMS[:4], tmp_path)
    assert result.steps == 0 and result.after == result.before and result.final_checkpoint.step == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


@pytest.mark.parametrize("k", [0, 2])
async def test_a_lost_session_is_recovered_from_the_last_checkpoint_bit_exactly(tmp_path, k):
    """The server drops the session every 17 ops; the loop reopens from checkpoints.jsonl and ends where an
    uninterrupted run ends, weights, optimizer state and metrics alike."""
    cfg = BASE.model_copy(update={"max_steps": 6, "save_every": 2, "max_staleness": k, "seed": 5})
    whole = await run(cfg, PROBLEMS[:4], tmp_path / "whole")
    flaky = cfg.model_copy(update={"url": "mock://?stop_after_ops=17", "max_recoveries": 10, "recovery_wait_s": 5.0})
    recovered = await run(flaky, PROBLEMS[:4], tmp_path / "flaky")
    a, b = await state(whole.final_checkpoint.state_path), await state(recovered.final_checkpoint.state_path)
    assert a[3] == b[3] == 6
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)
    records = read_metrics(tmp_path / "flaky")
    recoveries = [r for r in records if "recovery/count" in r]
    assert recoveries and all(0 <= r["recovery/lost_steps"] <= cfg.save_every for r in recoveries)
    assert [r["step"] for r in records] == list(range(7))  # every step logged once, after the redone ones
    strip = [{k: v for k, v in r.items() if not k.startswith("recovery/")} for r in comparable(records)]
    assert strip == comparable(read_metrics(tmp_path / "whole"))


async def test_recovery_gives_up_after_max_recoveries(tmp_path, caplog):
    from asyncsess.runs.checkpoints import session_lost

    cfg = BASE.model_copy(update={"url": "mock://?stop_after_ops=5", "max_steps": 6, "save_every": 1, "max_recoveries": 1})
    with pytest.raises(Exception) as info:
        await run(cfg, [], tmp_path)
    assert session_lost(info.value)
    assert "stopped by the server" in repr(info.value)
    assert [r.message for r in caplog.records if "recovery" in r.message][0].count("recovery 1 ") == 1
    assert sum("recovery" in r.message for r in caplog.records) == 1


async def test_other_errors_are_not_recovered(tmp_path):
    cfg = BASE.model_copy(update={"max_steps": 2, "loss_fn": "no-such-loss", "max_recoveries": 5})
    with pytest.raises(Exception) as info:
        await run(cfg, [], tmp_path)
    from asyncsess.runs.checkpoints import session_lost

    assert "no-such-loss" in repr(info.value) and not session_lost(info.value)


def test_the_optimizer_settings_live_in_the_config():
    cfg = BASE.model_copy(update={"learning_rate": 0.01, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_eps": 1e-6, "grad_clip_norm": 1.0})
    adam = cfg.adam()
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.grad_clip_norm) == (0.01, 0.8, 0.99, 1e-6, 1.0)
    assert (RLConfig().adam().beta1, RLConfig().adam().beta2, RLConfig().adam().eps) == (0.9, 0.95, 1e-8)  # the recipes' values
    for bad in (
        {"adam_beta1": 1.0},
        {"adam_eps": 0.0},
        {"adam_eps": 1e-46},  # 0 in the float32 optimizer: refused at the start, not at the first optim_step
        {"weight_decay": -0.1},
        {"weight_decay": 0.5, "learning_rate": 4.0},
        {"num_minibatches": 9, "groups_per_batch": 8},
        {"lr_schedule": "exp"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RLConfig(**bad)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"group_size": 1001}, "group_size"),  # was refused as num_samples by the first training sample, after the evaluation
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"context_window": 2**80}, "context_window"),
        ({"max_staleness": 10**12}, "max_staleness"),  # was a tight loop starting 8e12 groups (the run never answered)
        ({"groups_per_batch": 10**9}, "groups_per_batch"),
    ],
)
def test_sizes_a_run_cannot_take_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        RLConfig(**bad)
    RLConfig(group_size=1000, max_staleness=8191, groups_per_batch=8)  # the limits themselves are taken


def test_configs_built_on_rlconfig_keep_its_ranges():
    """AgentRLConfig redeclared lora_rank, lora_alpha, learning_rate, max_tokens (the agent recipe's config inherits
    it) without their ranges: learning_rate=-1 or 1e9 and lora_rank=0 were taken."""
    from asyncsess.rl.agent import AgentRLConfig

    for config in (AgentRLConfig,):
        for name, field in RLConfig.model_fields.items():
            assert config.model_fields[name].metadata == field.metadata, (config.__name__, name)
        for bad in ({"learning_rate": -1.0}, {"learning_rate": 1e9}, {"lora_rank": 0}, {"lora_alpha": -1.0}, {"max_tokens": 2**40}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                config(**bad)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
async def test_the_learning_rate_decays_to_zero_over_the_steps(tmp_path, schedule):
    cfg = BASE.model_copy(update={"max_steps": 6, "lr_schedule": schedule, "remove_constant_reward_groups": False})
    await run(cfg, [], tmp_path)
    lrs = [r["optim/learning_rate"] for r in read_metrics(tmp_path) if "optim/learning_rate" in r]
    want = [0.3 * (1 - s / 6) if schedule == "linear" else 0.3 * 0.5 * (1 + np.cos(np.pi * s / 6)) for s in range(6)]
    assert lrs == pytest.approx(want, rel=1e-6) and lrs[0] == 0.3 and lrs[-1] < 0.05


async def test_a_timed_run_decays_by_its_training_time(tmp_path):
    """With ``max_minutes``, whichever limit is nearer sets the decay: here the clock, not the 10_000 steps."""
    cfg = BASE.model_copy(
        update={"max_steps": 10_000, "max_minutes": 0.02, "lr_schedule": "linear", "remove_constant_reward_groups": False}
    )
    await run(cfg, [], tmp_path)
    records = [r for r in read_metrics(tmp_path) if "optim/learning_rate" in r]
    assert 2 <= len(records) < 10_000
    # the step number and the training time behind each step when it started
    want = [0.3 * (1 - max(r["step"] / 10_000, (r["time/total"] - r["time/step"]) / 1.2)) for r in records]
    assert [r["optim/learning_rate"] for r in records] == pytest.approx(want, rel=1e-6)
    assert records[-1]["optim/learning_rate"] < records[0]["optim/learning_rate"] == 0.3


async def test_a_large_evaluation_does_not_pause_the_sampling_pool(tmp_path, caplog):
    """300 held-out problems against the client's 256-request bound: the loop paces them instead of queueing."""
    cfg = BASE.model_copy(update={"url": "mock://?latency_ms=2", "max_steps": 1})
    test = [Problem(f"Held out {i}:", "0") for i in range(300)]
    with caplog.at_level("WARNING", logger="asyncsess"):
        result = await run(cfg, test, tmp_path)
    assert result.before["test/env/all/turns_per_episode"] == 1.0 and len(test) == 300
    assert not [r for r in caplog.records if "Sampling is paused" in r.getMessage()]
