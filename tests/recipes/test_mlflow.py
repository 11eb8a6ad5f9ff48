"""``asyncsess plot RUN_DIR --mlflow-uri URI`` logs the run's params, metrics by step and plots (needs mlflow)."""

import anyio
import mlflow
from typer.testing import CliRunner

from asyncsess.cli.app import app
from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl

from .helpers import digit_share


def test_plot_logs_a_recorded_run_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store, so the test needs no server or database
    cfg = RLConfig(url="mock://", groups_per_batch=2, group_size=4, max_tokens=8, learning_rate=0.3, max_steps=3)
    problems = [Problem(f"Code {i}:", "0") for i in range(4)]
    anyio.run(lambda: train_rl(cfg, problem_datasets(problems, problems[:2], digit_share, cfg), tmp_path / "run", progress=False))
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # mlflow.set_tracking_uri writes it; monkeypatch restores it
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "run"), "--mlflow-uri", uri, "--experiment", "recipes"])
    assert result.exit_code == 0, result.output
    run_id = result.output.split()[-1]
    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["loss_fn"] == "ppo" and run.data.params["group_size"] == "4"
    assert [m.step for m in client.get_metric_history(run_id, "env/all/reward/total")] == [0, 1, 2]
    assert [m.step for m in client.get_metric_history(run_id, "test/env/all/correct")] == [0, 3]
    assert {a.path for a in client.list_artifacts(run_id, "plots")} >= {"plots/reward.png", "plots/loss.png"}
