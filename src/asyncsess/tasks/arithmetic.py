"""Offline arithmetic: "What is 23 + 45? Reply with only the number." with 1–2 digit operands.

Reward 1 when the reply's final number (its last integer, so "23 + 45 = 68" counts) equals the
answer. ``env/all/format`` records whether the reply is only that number, as the prompt asks.
"""

from __future__ import annotations

import random
import re

from ..rollouts import Problem

__all__ = ["QUESTION", "make_problems", "split", "grade"]

QUESTION = "What is {a} {op} {b}? Reply with only the number."
_INT = re.compile(r"-?\d+")


def _problem(a: int, op: str, b: int) -> Problem:
    return Problem(QUESTION.format(a=a, op=op, b=b), str(a + b if op == "+" else a - b))


def make_problems(n: int, seed: int, max_operand: int = 99, ops: str = "+-", exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """``n`` distinct problems (questions not in ``exclude``), drawn with ``random.Random(seed)``."""
    space = (max_operand + 1) ** 2 * len(ops) - len(exclude)
    if n > space:
        raise ValueError(f"only {space} distinct problems with max_operand={max_operand}, ops={ops!r}")
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    while len(out) < n:
        p = _problem(rng.randint(0, max_operand), rng.choice(ops), rng.randint(0, max_operand))
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def split(n_train: int, n_test: int, seed: int, **kwargs: object) -> tuple[list[Problem], list[Problem]]:
    """A held-out test set and a training set that shares no question with it."""
    test = make_problems(n_test, seed + 1_000_003, **kwargs)  # type: ignore[arg-type]
    train = make_problems(n_train, seed, exclude=frozenset(p.question for p in test), **kwargs)  # type: ignore[arg-type]
    return train, test


def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    numbers = _INT.findall(reply)
    correct = bool(numbers) and numbers[-1] == problem.answer
    only = reply.strip() == problem.answer
    return float(correct), {"correct": float(correct), "format": float(only)}
