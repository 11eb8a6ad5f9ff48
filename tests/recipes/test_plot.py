"""``asyncsess plot RUN_DIR`` writes valid PNG curves of a recorded run (needs matplotlib)."""

import anyio
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from asyncsess.cli.app import app
from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl

from .helpers import digit_share

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_pngs_of_a_recorded_run(tmp_path):
    cfg = RLConfig(url="mock://", groups_per_batch=2, group_size=4, max_tokens=8, learning_rate=0.3, max_steps=4)
    problems = [Problem(f"Code {i}:", "0") for i in range(4)]
    anyio.run(lambda: train_rl(cfg, problem_datasets(problems, problems[:2], digit_share, cfg), tmp_path / "run", progress=False))
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "run"), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert written == ["accuracy.png", "kl_sample_train.png", "loss.png", "reward.png", "tokens_per_s.png"]
    assert result.output.split() == [
        str(tmp_path / "png" / n) for n in ["reward.png", "accuracy.png", "loss.png", "kl_sample_train.png", "tokens_per_s.png"]
    ]
    for name in written:
        path = tmp_path / "png" / name
        assert path.read_bytes()[:8] == PNG
        height, width, _ = imread(path).shape
        assert (width, height) == (600, 350)


def test_plot_refuses_a_missing_directory(tmp_path):
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "nope")])
    assert result.exit_code != 0


@pytest.mark.parametrize("metrics", [None, '{"step": "x"}\n'])
def test_plot_of_a_run_without_readable_metrics_is_an_error_line_not_a_traceback(tmp_path, metrics):
    if metrics is not None:
        (tmp_path / "metrics.jsonl").write_text(metrics)
    result = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2 and "error: " in result.output and "metrics.jsonl" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
