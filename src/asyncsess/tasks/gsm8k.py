"""GSM8K: grade-school word problems whose reference solution ends with ``#### <number>``.

Loaded from a local JSONL file (rows ``{"question", "answer"}`` in the dataset's own format) or,
when online, through ``datasets`` (``openai/gsm8k``, config ``main``). Reward 1 when the number after
``####`` in the reply matches the reference (:func:`final_answer`).
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path
from typing import Any

from ..rl.problem_env import Problem
from .numbers import DECIMAL, canonical
from .rows import RowError, check_limit, load_rows, need

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


FIX = 'use one JSON object per line: {"question": "...", "answer": "... #### 42"} (the dataset\'s own rows)'


def _row(row: dict[str, Any], index: int = 0) -> Problem:
    question = need(row, "question", str, "a string")
    reference = need(row, "answer", str, "a string (the worked solution, ending with '#### <number>')")
    answer = final_answer(reference)
    if answer is None:
        raise RowError("answer", f"no '#### <number>' in the reference answer: {reference[-80:]!r}")
    return Problem(question.strip() + INSTRUCTION, answer)


def load(split: str = "train", path: str | Path | None = None, limit: int | None = None) -> list[Problem]:
    """Problems from ``path`` (JSONL) or from the ``datasets`` hub copy of GSM8K (needs network). A file that is not
    one such row per line is an InvalidInputError naming the file, the line and the key (:mod:`.rows`)."""
    check_limit(limit)
    if path is not None:
        problems = load_rows(path, _row, FIX)
    else:
        try:
            import datasets  # type: ignore[import-not-found]
        except ImportError:
            raise ImportError("reading GSM8K from the hub needs `pip install datasets`; or pass a local JSONL path") from None
        problems = [_row(r) for r in datasets.load_dataset("openai/gsm8k", "main", split=split)]
    return problems[:limit] if limit is not None else problems


def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    """1 when the reply's final answer equals the reference, both canonical: a reference written by hand as
    ``"1,200"`` or ``"42.0"`` matches ``#### 1200`` and ``#### 42`` (one that is no plain decimal is compared as written)."""
    got = final_answer(reply)
    want = final_answer(f"#### {problem.answer.strip()}") or problem.answer
    correct = got is not None and got == want
    return float(correct), {"correct": float(correct), "format": float(got is not None)}
