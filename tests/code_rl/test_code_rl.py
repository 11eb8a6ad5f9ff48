"""code_rl end to end on mock://: scripted two-turn replies graded in the LocalSandbox, training through a real
TrainingClient (cispo), staleness bounded by k, a well-formed metrics.jsonl, resume; and the scheduler's requeue."""

from __future__ import annotations

import json
import os

import anyio
import pytest

from asyncsess import ServiceClient
from asyncsess.rl import Env, EnvGroupBuilder, RLConfig, ScriptedCompleter, StepResult, train_rl
from asyncsess.runs.checkpoints import last_checkpoint
from asyncsess.runs.metrics import read_metrics
from asyncsess.tasks import code
from asyncsess.types import ModelInput
from examples import code_rl

from ..recipes.helpers import check_metrics_file
from .scripted import code_policy

pytestmark = pytest.mark.anyio
PROBLEMS = code.load(code_rl.BUNDLED)
ARGS = [
    "groups_per_batch=2",
    "group_size=4",
    "num_minibatches=2",
    "max_staleness=1",
    "n_test=2",
    "eval_every=2",
    "learning_rate=0.05",
    "sandbox_concurrency=4",
]
KEYS = {
    "env/all/reward/total",
    "env/all/correct",
    "env/all/format",
    "env/all/tool_calls",
    "env/all/check/tests_passed",
    "env/all/turns_per_episode",
    "stop/completed",
    "stop/max_turns",
    "stop/parse_error",
    "async/staleness_max",
    "async/staleness_min",
    "async/staleness_mean",
    "async/requeued",
    "optim/loss",
    "optim/kl_sample_train_v1",
    "optim/entropy",
    "tokens/train",
    "time/step",
    "test/env/all/correct",
    "test/env/all/reward/total",
}


def scripted(seed: int):
    script = code_policy(PROBLEMS, seed)  # one random stream for the run

    def make(sampler, max_tokens, temperature, context_window):
        return ScriptedCompleter(sampler, script, max_tokens=max_tokens, temperature=temperature, context_window=context_window)

    return make


async def state(path: str) -> tuple[int, float]:
    """Optimizer steps held by a mock:// checkpoint, and the weights' total magnitude."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_training_client_from_state_with_optimizer(path)
        _, _, steps = svc.backend.optimizer_state(tc.model_id)
        return steps, float(abs(svc.backend.weights(tc.model_id)).sum())


async def test_the_recipes_sandbox_hides_its_problems_files(tmp_path):
    test_path = tmp_path / "test.jsonl"
    test_path.write_text(code_rl.BUNDLED.read_text())
    cfg = code_rl.CodeRLConfig.model_validate({**code_rl.DEFAULTS.model_dump(), "test_path": str(test_path)})
    async with code_rl.open_sandbox(cfg) as sandbox:
        report = await sandbox.isolation()
        expected = sorted(os.path.realpath(p) for p in (code_rl.BUNDLED, test_path)) if report.namespaces else []
        assert report.hidden_files == expected and (expected or os.geteuid() != 0)


async def test_code_rl_runs_two_turns_with_bounded_staleness(tmp_path):
    result = await code_rl.main([*ARGS, "max_steps=6", f"run_dir={tmp_path}"], make_completer=scripted(0))
    records = check_metrics_file(tmp_path, KEYS)
    assert result.steps == 6 and [r["step"] for r in records] == list(range(7))
    steps = [r for r in records if "async/staleness_max" in r]
    assert all(0 <= r["async/staleness_min"] <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1 for r in steps)
    assert steps[0]["async/staleness_max"] == 0 and any(r["async/staleness_max"] == 1 for r in steps)  # sampling ran ahead
    assert abs(steps[0]["optim/kl_sample_train_v1"]) < 1e-5  # step 0 is on-policy: scripted log-probs match training
    # two turns: some episodes called check_solution and answered after reading the verdict
    assert all(1.0 <= r["env/all/turns_per_episode"] <= 2.0 for r in steps)
    assert any(r["env/all/turns_per_episode"] > 1.0 and r["env/all/tool_calls"] > 0 for r in steps)
    assert any(r.get("env/all/check/tests_passed", 0.0) > 0 for r in steps)  # only steps whose episodes called the check have it
    assert any(r["stop/max_turns"] > 0 or r["stop/parse_error"] > 0 for r in steps)
    # forward_backward streamed in sub-batches, and the reward spans the cookbook's values
    assert any(r["train/forward_backward_calls"] == 2 for r in steps)
    assert all(-0.1 <= r["env/all/reward/total"] <= 1.0 for r in steps)
    assert sum("test/env/all/correct" in r for r in records) == 4  # before, after steps 2 and 4, after
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["loss_fn"] == "cispo" and config["loss_fn_config"] == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    final = result.final_checkpoint
    # one optimizer step per loop step that had signal (a batch of equal-reward groups trains nothing)
    assert final.final and final.step == 6 and (await state(final.state_path))[0] == trained(records) >= 4
    # every group started was trained once or is saved with the checkpoint, sampled and not yet trained
    assert final.extra["cursor"] - len(pending(tmp_path, final)) == 6 * 2


def trained(records: list[dict]) -> int:
    """Loop steps that ran an optimizer step: which groups share a batch depends on timing when sampling runs
    ahead, so now and then a batch holds only equal-reward groups and trains nothing."""
    return sum(1 for r in records if r.get("train/datums", 0) > 0)


def pending(run_dir, record) -> list[dict]:
    """The groups a checkpoint saved: sampled, not yet trained."""
    if "pending_file" not in record.extra:
        return []
    return json.loads((run_dir / record.extra["pending_file"]).read_text())


async def test_code_rl_resumes_from_its_checkpoint(tmp_path):
    args = [*ARGS, "save_every=2", f"run_dir={tmp_path}"]
    first = await code_rl.main([*args, "max_steps=2"], make_completer=scripted(1))
    assert first.steps == 2 and last_checkpoint(tmp_path).step == 2
    resumed = await code_rl.main([*args, "max_steps=4"], make_completer=scripted(2))
    assert resumed.steps == 4 and resumed.before == first.before
    records = check_metrics_file(tmp_path, KEYS)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert (await state(resumed.final_checkpoint.state_path))[0] == trained(records) >= 2
    final = resumed.final_checkpoint
    assert final.extra["cursor"] - len(pending(tmp_path, final)) == 4 * 2


class DigitEnv(Env):
    """One turn; reward = share of digits in the reply. The group with ``gate`` waits until it is opened."""

    def __init__(self, tokenizer, index: int, gate: anyio.Event | None):
        self.tokenizer, self.index, self.gate = tokenizer, index, gate

    async def initial_observation(self):
        ob = self.tokenizer.apply_chat_template([{"role": "user", "content": f"Code {self.index}:"}], add_generation_prompt=True)
        return ModelInput.from_ints(ob), [self.tokenizer.convert_tokens_to_ids("<|end|>")]

    async def step(self, action):
        if self.gate is not None:
            await self.gate.wait()
        text = self.tokenizer.decode(action, skip_special_tokens=True)
        return StepResult(sum(c.isdigit() for c in text) / max(1, len(text)), True, metrics={"index": float(self.index)})


class DigitBuilder(EnvGroupBuilder):
    def __init__(self, dataset: GatedDataset, index: int):
        self.dataset, self.index = dataset, index

    async def make_envs(self):
        plays = self.dataset.plays
        gate = self.dataset.gate if self.index == 0 and 0 not in plays else None
        plays.append(self.index)
        if self.index >= 6:
            self.dataset.gate.set()
        return [DigitEnv(self.dataset.tokenizer, self.index, gate) for _ in range(4)]


class GatedDataset:
    """Group 0's first play is held back until group 6 is played (after two optimizer steps, with k = 1 and
    two groups per batch), so it is two steps old when it finishes and must be requeued."""

    def __init__(self, tokenizer):
        self.tokenizer, self.gate, self.plays = tokenizer, anyio.Event(), []

    def get_batch(self, index: int):
        return [DigitBuilder(self, i) for i in (2 * index, 2 * index + 1)]

    def __len__(self) -> int:
        return 1_000


async def test_stale_groups_are_requeued_and_played_again(tmp_path):
    cfg = RLConfig(
        groups_per_batch=2,
        group_size=4,
        max_tokens=8,
        learning_rate=0.3,
        lora_rank=4,
        loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        max_staleness=1,
        max_steps=5,
    )
    datasets: list[GatedDataset] = []

    def make(tokenizer):
        datasets.append(GatedDataset(tokenizer))
        return datasets[0], []

    result = await train_rl(cfg, make, tmp_path, progress=False)
    records = [r for r in read_metrics(tmp_path) if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in records] and all(r["async/staleness_max"] <= 1 for r in records)
    assert sum(r["async/requeued"] for r in records) == 1
    assert datasets[0].plays.count(0) == 2  # played again with newer weights
    assert result.final_checkpoint.extra["cursor"] - len(pending(tmp_path, result.final_checkpoint)) == 5 * 2


class Broken(EnvGroupBuilder):
    async def make_envs(self):
        raise RuntimeError("the task failed")


class BrokenDataset:
    def get_batch(self, index: int):
        return [Broken(), Broken()]

    def __len__(self) -> int:
        return 1


async def test_a_failing_rollout_stops_the_run_with_its_error(tmp_path):
    cfg = RLConfig(groups_per_batch=2, group_size=2, max_steps=3, loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    with pytest.raises(RuntimeError, match="the task failed"):
        await train_rl(cfg, lambda tokenizer: (BrokenDataset(), []), tmp_path, progress=False)


class DigitDataset:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_batch(self, index: int):
        return [GatedBuilder(self, 2 * index), GatedBuilder(self, 2 * index + 1)]

    def __len__(self) -> int:
        return 1_000


class GatedBuilder(EnvGroupBuilder):
    def __init__(self, dataset: DigitDataset, index: int):
        self.dataset, self.index = dataset, index

    async def make_envs(self):
        return [DigitEnv(self.dataset.tokenizer, self.index, None) for _ in range(4)]


async def test_the_env_loop_recovers_a_lost_session_and_finishes(tmp_path):
    """The server drops the session every 9 ops; the env loop reopens it from its last checkpoint each time."""
    cfg = RLConfig(
        url="mock://?stop_after_ops=9",
        groups_per_batch=2,
        group_size=4,
        max_tokens=8,
        learning_rate=0.3,
        lora_rank=4,
        loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        max_steps=5,
        save_every=1,
        max_recoveries=8,
        recovery_wait_s=5.0,
    )
    result = await train_rl(cfg, lambda tokenizer: (DigitDataset(tokenizer), []), tmp_path, progress=False)
    assert result.steps == 5 and (await state(result.final_checkpoint.state_path))[0] == 5
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    recoveries = [r for r in records if "recovery/count" in r]
    assert recoveries and all(r["recovery/lost_steps"] <= 1 for r in recoveries)
