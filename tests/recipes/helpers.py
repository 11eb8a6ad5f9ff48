"""Helpers shared by the recipe tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

from asyncsess.rl import Problem


def digit_share(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    """A grader the mock's bigram model can learn: the share of digits in the reply."""
    share = sum(c.isdigit() for c in reply) / max(1, len(reply))
    return share, {"correct": float(reply.strip() == problem.answer)}


def check_metrics_file(run_dir: str | Path, required: set[str]) -> list[dict]:
    """``metrics.jsonl`` is well formed: one JSON object per line, unique increasing int steps, finite
    numbers (or null), and every key of ``required`` in at least one line; returns the records."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records, "metrics.jsonl is empty"
    steps = [r["step"] for r in records]
    assert all(type(s) is int for s in steps) and steps == sorted(set(steps)), steps
    for r in records:
        for k, v in r.items():
            assert isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and math.isfinite(v))), (k, v)
    missing = required - {k for r in records for k in r}
    assert not missing, f"metrics never logged: {sorted(missing)}"
    return records
