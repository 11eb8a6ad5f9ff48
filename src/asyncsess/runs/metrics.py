"""``metrics.jsonl``: one JSON object per step, under the anchors' metric names.

Namespaces follow tinker-cookbook: ``env/all/reward/total``, ``env/all/<metric>``, ``test/env/all/...``,
``test/nll``, ``optim/*`` (``optim/kl_sample_train_v1``, ``optim/entropy``, ...), ``progress/*``,
``time/*``, ``async/*``, ``tokens/*``, ``stop/*``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from .jsonl import json_data, open_for_append, read_jsonl, refuse, write_whole

__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Appends ``{"step": n, **metrics}`` lines to ``run_dir/metrics.jsonl``, flushed per line.

    ``resume_step`` drops the lines of steps ``>= resume_step`` first, so a resumed run rewrites them
    instead of duplicating them. A torn last line (a killed process's) is cut off before appending; a line
    that is not a record is a typed error naming it (see :mod:`.jsonl`).
    """

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] < resume_step]
            write_whole(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # the old lines or the kept ones, never a part
        self._file = open_for_append(self.path, lambda n, r: _check(self.path, n, r), _FIX)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if "step" in metrics and metrics["step"] != step:  # it would replace the line's step, which a resume reads
            raise InvalidInputError(
                f"metrics hold step {metrics['step']!r:.40}, logged as step {step}", field="metrics.step", fix="leave step out of metrics"
            )
        record = {"step": int(step), **{k: json_data(v, k, "metrics") for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FIX = "start a new run directory, or cut metrics.jsonl back to its last good line"


def _check(path: Path, line: int, record: dict[str, Any]) -> None:
    step = record.get("step")
    if type(step) is not int or not 0 <= step <= 2**53:
        raise refuse(path, line, "step", f"{step!r:.40} is not a step number", _FIX)
    total = record.get("time/total")
    if total is not None and (type(total) not in (int, float) or total < 0):
        raise refuse(path, line, "time/total", f"{total!r:.40} is not a number of seconds", _FIX)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (or of ``<run_dir>/metrics.jsonl``): each an object with a
    ``step``; a torn last line (a killed process's) is left out, any other bad line is a typed error."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    file = path
    if not file.exists():
        raise FileNotFoundError(f"no {file}")
    return [r for _, r in read_jsonl(file, lambda n, r: _check(file, n, r), _FIX)]
