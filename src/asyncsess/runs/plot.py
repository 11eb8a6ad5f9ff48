"""Curves of a recorded run (``metrics.jsonl``) as PNG files, and optional MLflow logging.

Needs matplotlib (``pip install 'asyncsess[plot]'``); MLflow logging needs ``mlflow``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .checkpoints import CONFIG_FILE
from .metrics import read_metrics

__all__ = ["PANELS", "plot_run", "log_to_mlflow"]

# panel name -> the metrics it draws (those present in the run)
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("env/all/reward/total", "test/env/all/reward/total"),
    "accuracy": ("env/all/correct", "test/env/all/correct", "accuracy", "test/accuracy"),
    "loss": ("optim/loss", "train/nll", "test/nll", "dpo_loss", "kto_loss"),
    "kl_sample_train": ("optim/kl_sample_train_v1", "optim/kl_sample_train_v2"),
    "tokens_per_s": ("tokens/sampled_per_s", "tokens/train_per_s"),
}


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [float(v) for _, v in points]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``<panel>.png`` for each panel with data (default: ``run_dir/plots``); return the paths."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'asyncsess[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        lines = [(k, *_series(records, k)) for k in keys]
        lines = [line for line in lines if line[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for key, steps, values in lines:
            ax.plot(steps, values, marker="o" if len(steps) < 3 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{Path(run_dir).name}: {panel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{panel}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def log_to_mlflow(run_dir: str | Path, tracking_uri: str, experiment: str = "asyncsess", plots: list[Path] | None = None) -> str:
    """Log a recorded run to MLflow (params from ``config.json``, every metric by step, the plots); return the run id."""
    try:
        import mlflow  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError("MLflow logging needs mlflow: pip install mlflow") from None
    run_dir = Path(run_dir)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    config = json.loads((run_dir / CONFIG_FILE).read_text()) if (run_dir / CONFIG_FILE).exists() else {}
    with mlflow.start_run(run_name=run_dir.name) as run:
        mlflow.log_params({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in config.items()})
        for record in read_metrics(run_dir):
            values = {_mlflow_name(k): float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            mlflow.log_metrics(values, step=int(record["step"]))
        for path in plots or []:
            mlflow.log_artifact(str(path), artifact_path="plots")
        return str(run.info.run_id)


def _mlflow_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)
