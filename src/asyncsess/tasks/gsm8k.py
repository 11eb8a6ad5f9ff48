"""GSM8K: grade-school word problems whose reference solution ends with ``#### <number>``.

Loaded from a local JSONL file (rows ``{"question", "answer"}`` in the dataset's own format) or,
when online, through ``datasets`` (``openai/gsm8k``, config ``main``). Reward 1 when the number after
``####`` in the reply matches the reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..rl.problem_env import Problem

__all__ = ["INSTRUCTION", "load", "final_answer", "grade"]

INSTRUCTION = " Solve it step by step, then give the final answer as a number after ####, e.g. #### 42."
_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> str | None:
    """The number after the last ``####``, without commas or a trailing ``.0``; ``None`` if absent."""
    found = _FINAL.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def _row(row: dict[str, str]) -> Problem:
    answer = final_answer(row["answer"])
    if answer is None:
        raise ValueError(f"no '#### <number>' in the reference answer: {row['answer'][-80:]!r}")
    return Problem(row["question"].strip() + INSTRUCTION, answer)


def load(split: str = "train", path: str | Path | None = None, limit: int | None = None) -> list[Problem]:
    """Problems from ``path`` (JSONL) or from the ``datasets`` hub copy of GSM8K (needs network)."""
    if path is not None:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    else:
        try:
            import datasets  # type: ignore[import-not-found]
        except ImportError:
            raise ImportError("reading GSM8K from the hub needs `pip install datasets`; or pass a local JSONL path") from None
        rows = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
    problems = [_row(r) for r in rows]
    return problems[:limit] if limit is not None else problems


def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    got = final_answer(reply)
    correct = got is not None and got == problem.answer
    return float(correct), {"correct": float(correct), "format": float(got is not None)}
