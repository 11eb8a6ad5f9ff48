"""``metrics.jsonl``: one JSON object per step, under the anchors' metric names.

Namespaces follow tinker-cookbook: ``env/all/reward/total``, ``env/all/<metric>``, ``test/env/all/...``,
``test/nll``, ``optim/*`` (``optim/kl_sample_train_v1``, ``optim/entropy``, ...), ``progress/*``,
``time/*``, ``async/*``, ``tokens/*``, ``stop/*``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Infinity
    return value


class MetricsLogger:
    """Appends ``{"step": n, **metrics}`` lines to ``run_dir/metrics.jsonl``, flushed per line.

    ``resume_step`` drops the lines of steps ``>= resume_step`` first, so a resumed run rewrites them
    instead of duplicating them.
    """

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] < resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (or of ``<run_dir>/metrics.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
