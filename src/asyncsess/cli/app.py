"""The ``asyncsess`` command: ``demo`` (the main job), ``plot`` (curves of a run), and sub-commands that
installed packages contribute through the ``asyncsess.cli.app`` entry-point group (e.g. ``sagemaker``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import anyio
import typer
from pydantic import ValidationError

from ..errors import AsyncSessError
from ..serve.command import finite, serve
from .demo import DEMO, run_demo

app = typer.Typer(help="asyncsess: LLM training loops against live training sessions.", no_args_is_help=True)
log = logging.getLogger("asyncsess")


@app.command()
def demo(
    model: str = typer.Option(DEMO.base_model, help="Base model: a local:// alias, a model directory or a hub id."),
    url: str = typer.Option(DEMO.url, help="Backend URL."),
    minutes: float = typer.Option(DEMO.max_minutes, min=0.0, callback=finite, help="Training time limit in minutes (0: none)."),
    steps: int = typer.Option(DEMO.max_steps, min=0, help="Maximum number of training steps (0: only the evaluation)."),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="Seed of the problems, the LoRA init and the sampling."),
    run_dir: Path = typer.Option(
        Path("runs/demo"), file_okay=False, writable=True, help="Where metrics.jsonl, checkpoints.jsonl and config.json go."
    ),
    resume: bool = typer.Option(False, help="Resume the run in --run-dir instead of starting over."),
    n_test: int = typer.Option(100, min=1, max=10_000, help="Held-out problems graded before and after (500 for a tighter estimate)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """GRPO on offline arithmetic; prints held-out greedy accuracy before and after."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise typer.BadParameter(f"cannot make {str(run_dir)!r}: {err.strerror}", param_hint="--run-dir") from None
    _run(lambda: run_demo(model, url, minutes or None, steps, seed, run_dir, resume, n_test=n_test, progress=progress))


def _run(main: Callable[[], Awaitable[Any]]) -> None:
    """Run ``main``; a refused setting or input (a typed asyncsess error, an invalid config) ends the command with
    its message and exit code 2, not a traceback."""
    try:
        anyio.run(main)
    except (AsyncSessError, ValidationError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run directory with metrics.jsonl."),
    out: Path | None = typer.Option(None, help="Output directory (default: RUN_DIR/plots)."),
    mlflow_uri: str | None = typer.Option(None, envvar="MLFLOW_TRACKING_URI", help="Also log the run to this MLflow tracking URI."),
    experiment: str = typer.Option("asyncsess", help="MLflow experiment name."),
) -> None:
    """Write PNG curves (reward, accuracy, loss, sampler-vs-trainer KL, tokens/s) of a recorded run."""
    from ..runs.plot import log_to_mlflow, plot_run

    try:
        paths = plot_run(run_dir, out)
    except (AsyncSessError, FileNotFoundError) as err:  # no metrics.jsonl, or a line that is not a record
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    for p in paths:
        typer.echo(str(p))
    if mlflow_uri:
        typer.echo(f"mlflow run {log_to_mlflow(run_dir, mlflow_uri, experiment, paths)}")


app.command(name="serve")(serve)


def _mount_plugins() -> None:
    for ep in entry_points(group="asyncsess.cli.app"):
        try:
            app.add_typer(ep.load(), name=ep.name)
        except ImportError as err:  # a plugin whose own dependencies are missing
            log.debug("skipping the %s sub-command: %r", ep.name, err)


_mount_plugins()
