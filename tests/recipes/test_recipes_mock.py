"""Each torch-free recipe runs a few steps on mock:// and writes a well-formed metrics.jsonl."""

import json
from pathlib import Path

import pytest

from asyncsess.runs.metrics import read_metrics
from examples import gsm8k_grpo, math_rl, sft_chat

from .helpers import check_metrics_file

pytestmark = pytest.mark.anyio
DATA = Path(__file__).parents[2] / "examples" / "data"
RL_KEYS = {
    "env/all/reward/total",
    "env/all/correct",
    "env/all/format",
    "async/staleness_mean",
    "tokens/sampled",
    "time/step",
    "test/env/all/correct",
    "progress/step",
}


async def test_math_rl(tmp_path):
    result = await math_rl.main(["max_steps=3", "groups_per_batch=2", "group_size=4", "n_test=5", f"run_dir={tmp_path}"])
    assert result.steps == 3 and set(result.before) == set(result.after)
    assert {f"test/env/all/{k}" for k in ("reward/total", "correct", "format")} <= set(result.before)
    assert result.before["test/env/all/turns_per_episode"] == 1.0  # a problem is a one-step env
    records = check_metrics_file(tmp_path, RL_KEYS)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert json.loads((tmp_path / "config.json").read_text())["loss_fn"] == "ppo"
    [*_, final] = [json.loads(line) for line in (tmp_path / "checkpoints.jsonl").read_text().splitlines()]
    assert final["final"] and final["step"] == 3 and final["state_path"].startswith("mock://")


async def test_gsm8k_grpo_from_a_local_jsonl(tmp_path):
    args = ["max_steps=2", "groups_per_batch=2", "group_size=4", "max_tokens=32", "eval_every=1", f"run_dir={tmp_path}"]
    result = await gsm8k_grpo.main([*args, f"train_path={DATA / 'gsm8k_sample.jsonl'}"])
    assert result.steps == 2
    records = check_metrics_file(tmp_path, RL_KEYS)
    assert sum("test/env/all/correct" in r for r in records) == 3  # before, after step 1 (eval_every=1), after


async def test_sft_chat(tmp_path):
    summary = await sft_chat.main(["num_epochs=2", "batch_size=4", "eval_every=2", "learning_rate=0.05", f"run_dir={tmp_path}"])
    records = check_metrics_file(tmp_path, {"train/nll", "test/nll", "optim/lr", "optim/grad_norm"})
    assert summary["steps"] == 14 and [r["step"] for r in records] == list(range(15))
    assert sum("test/nll" in r for r in records) == 8  # before, every 2 steps, after
    assert summary["test/nll_after"] < summary["test/nll_before"]
    lrs = [r["optim/lr"] for r in records if "optim/lr" in r]
    assert lrs[0] == 0.05 and lrs == sorted(lrs, reverse=True)  # linear decay


async def test_sft_chat_resumes_from_its_checkpoint(tmp_path):
    args = ["num_epochs=2", "batch_size=4", "learning_rate=0.05", "save_every=5", f"run_dir={tmp_path / 'a'}"]
    whole = await sft_chat.main(args)
    part = await sft_chat.main([*args[:-1], "max_steps=5", f"run_dir={tmp_path / 'b'}"])
    assert part["steps"] == 5
    # a longer run in the same directory starts at step 5 (max_steps may change on resume)
    resumed = await sft_chat.main([*args[:-1], "max_steps=14", f"run_dir={tmp_path / 'b'}"])
    assert resumed["test/nll_after"] == whole["test/nll_after"]


async def test_sft_chat_recovers_a_lost_session(tmp_path):
    """The server drops the session every 13 ops; the run reopens from its checkpoints and ends as an
    uninterrupted one does."""
    args = ["num_epochs=2", "batch_size=4", "learning_rate=0.05", "save_every=3", "eval_every=0"]
    whole = await sft_chat.main([*args, f"run_dir={tmp_path / 'a'}"])
    flaky = await sft_chat.main([*args, "url=mock://?stop_after_ops=13", "max_recoveries=10", f"run_dir={tmp_path / 'b'}"])
    assert flaky["test/nll_after"] == whole["test/nll_after"]
    records = read_metrics(tmp_path / "b")
    assert [r["step"] for r in records] == list(range(15))
    assert any("recovery/count" in r for r in records)


def test_demo_command_on_mock(tmp_path):
    from typer.testing import CliRunner

    from asyncsess.cli.app import app

    args = ["demo", "--url", "mock://", "--model", "mock/bigram-tiny", "--steps", "2", "--run-dir", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out greedy accuracy (100 problems) after 2 steps" in result.output and "test/env/all/correct" in result.output
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "metrics.jsonl", "checkpoints.jsonl"}
    check_metrics_file(tmp_path, RL_KEYS)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["group_size"], config["lora_rank"], config["max_tokens"], config["normalize_std"]) == (8, 16, 16, True)
    wider = CliRunner().invoke(app, [*args[:-3], "--steps", "1", "--n-test", "7", "--run-dir", str(tmp_path / "b"), "--no-progress"])
    assert wider.exit_code == 0 and "held-out greedy accuracy (7 problems) after 1 steps" in wider.output, wider.output
    assert CliRunner().invoke(app, [*args, "--n-test", "0"]).exit_code == 2  # refused by the option's range


def test_demo_keeps_local_checkpoints_in_the_run_dir(tmp_path):
    from asyncsess.cli.demo import local_checkpoint_dir

    here = str((tmp_path / "run").resolve() / "checkpoints")
    assert local_checkpoint_dir("local://?dtype=bfloat16", tmp_path / "run") == f"local://?dtype=bfloat16&dir={here}"
    assert local_checkpoint_dir("local://?dir=/elsewhere", tmp_path / "run") == "local://?dir=/elsewhere"
    assert local_checkpoint_dir("mock://?seed=1", tmp_path / "run") == "mock://?seed=1"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--minutes", "-1"], "--minutes"),  # took as a 1-minute run that trained for no time at all
        (["--minutes", "nan"], "--minutes"),  # trained with no time limit
        (["--minutes", "inf"], "--minutes"),
        (["--seed", "-3"], "--seed"),
        (["--steps", "-1"], "--steps"),
        (["--run-dir", "/proc/no/such/dir"], "--run-dir"),  # a FileNotFoundError traceback
        (["--url", "bogus://x"], "url"),  # a typed error, printed without a traceback
    ],
)
def test_demo_command_refuses_bad_options_with_a_message_not_a_traceback(tmp_path, args, option):
    from typer.testing import CliRunner

    from asyncsess.cli.app import app

    base = ["demo", "--url", "mock://", "--model", "mock/bigram-tiny", "--steps", "1", "--run-dir", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, [*base, *args])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the run began


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--port", "99999"], "--port"),
        (["--poll-timeout", "nan"], "--poll-timeout"),
        (["--backend", "nope://"], "--backend"),
        (["--max-body-seconds", "0"], "--max-body-seconds"),
        (["--max-body-seconds", "inf"], "--max-body-seconds"),
    ],
)
def test_serve_command_refuses_bad_options_before_it_binds(args, option):
    from typer.testing import CliRunner

    from asyncsess.cli.app import app

    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2 and option in result.output, result.output


@pytest.mark.parametrize(
    "bad",
    [
        {"learning_rate": float("nan")},
        {"temperature": -1.0},
        {"max_minutes": float("nan")},
        {"max_minutes": -1.0},
        {"lora_rank": 0},
        {"seed": -1},
        {"save_every": -1},
        {"kl_penalty_coef": float("inf")},
        {"loss_fn": "bogus"},
        {"loss_fn": "cross_entropy"},
        {"loss_fn": "ppo", "loss_fn_config": {"beta": 1.0}},
        {"loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": 2.0}},
    ],
)
def test_rl_config_refuses_what_the_run_would_fail_on_later(bad):
    """Each was accepted and failed (or silently misbehaved: NaN minutes never ran out) steps into the run."""
    from pydantic import ValidationError

    from asyncsess.rl import RLConfig

    with pytest.raises(ValidationError) as err:
        RLConfig(**bad)
    named = {str(e["loc"][0]) for e in err.value.errors() if e["loc"]} | {m for m in bad if m in str(err.value)}
    assert named & set(bad), str(err.value)
    assert RLConfig(loss_fn="dro", loss_fn_config={"beta": 1}).loss_fn_config == {"beta": 1.0}
