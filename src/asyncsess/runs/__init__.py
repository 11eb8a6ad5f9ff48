"""A run directory: ``config.json``, ``checkpoints.jsonl`` and resume (:mod:`.checkpoints`), ``metrics.jsonl``
(:mod:`.metrics`), the progress bar and before/after table (:mod:`.progress`), and plots (:mod:`.plot`)."""

from .checkpoints import (
    CheckpointRecord,
    RecoveryConfig,
    last_checkpoint,
    open_run_dir,
    parse_overrides,
    prepare_run_dir,
    run_recovering,
    save_checkpoint,
)
from .metrics import MetricsLogger, read_metrics
from .plot import log_to_mlflow, plot_run
from .progress import print_before_after, progress_bar

__all__ = [
    "CheckpointRecord",
    "MetricsLogger",
    "RecoveryConfig",
    "last_checkpoint",
    "log_to_mlflow",
    "open_run_dir",
    "parse_overrides",
    "plot_run",
    "prepare_run_dir",
    "print_before_after",
    "progress_bar",
    "read_metrics",
    "run_recovering",
    "save_checkpoint",
]
