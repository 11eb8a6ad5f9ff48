"""GSM8K: grade-school word problems whose reference solution ends with ``#### <number>``.

Loaded from a local JSONL file (rows ``{"question", "answer"}`` in the dataset's own format) or,
when online, through ``datasets`` (``openai/gsm8k``, config ``main``). Reward 1 when the number after
``####`` in the reply matches the reference (:func:`final_answer`).
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path

from ..rl.problem_env import Problem
from .numbers import DECIMAL, canonical

__all__ = ["INSTRUCTION", "load", "final_answer", "grade"]

INSTRUCTION = " Solve it step by step, then give the final answer as a number after ####, e.g. #### 42."
# after "####" (and a "$"), one run of digits, dots and commas; one reading per "####", so linear in the text
_FINAL = re.compile(r"####\s*(?:\$\s*)?(-?[0-9.,]+)")
_MORE = re.compile(r"[ \t]*(?:[eE][-+]?[0-9]|\*\*|[*/^][ \t]*[0-9.])")  # an exponent or an operator: an expression


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` that has one, canonical (:func:`asyncsess.tasks.numbers.canonical`:
    ``"#### 1,200.50"`` -> ``"1200.5"``); ``None`` if absent or if that ``####`` is followed by something else
    than a plain ASCII decimal (``1e999``, ``10**10**10``, ``3/4``, ``٤٢``)."""
    last = next(iter(deque(_FINAL.finditer(text), maxlen=1)), None)
    if last is None:
        return None
    value = last.group(1).rstrip(".,").replace(",", "")  # a sentence may end right after the number
    if not DECIMAL.fullmatch(value) or _MORE.match(text, last.end(1)):
        return None
    return canonical(value)


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
