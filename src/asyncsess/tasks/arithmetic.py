"""Offline arithmetic: "What is 23 + 45? Reply with only the number." with 1–2 digit operands
(each operand has one or two digits with equal probability, so a quarter of the problems are
single-digit ones).

Reward 1 when the reply's final number (its last run of ASCII digits with its sign, so "23 + 45 = 68"
counts) equals the answer, compared as canonical strings (``-0`` is 0, ``068`` is 68; never converted to
``int``, so a 100k-digit reply is just wrong). ``env/all/format`` records whether the reply is only that
number, as the prompt asks.
"""

from __future__ import annotations

import random
import re

from ..errors import InvalidInputError
from ..rl.problem_env import Problem
from .numbers import canonical

__all__ = ["QUESTION", "make_problems", "split", "grade"]

QUESTION = "What is {a} {op} {b}? Reply with only the number."
OPS = "+-"  # the operations the problems use (their answers are computed for these only)
_INT = re.compile(r"-?[0-9]+")


def _problem(a: int, op: str, b: int) -> Problem:
    return Problem(QUESTION.format(a=a, op=op, b=b), str(a + b if op == "+" else a - b))


def _operand(rng: random.Random) -> int:
    return rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def make_problems(n: int, seed: int, ops: str = "+-", exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """``n`` distinct problems (questions not in ``exclude``), drawn with ``random.Random(seed)``; ``ops``: some of
    ``+`` and ``-``, each once."""
    if not ops or set(ops) - set(OPS) or len(set(ops)) != len(ops):
        raise InvalidInputError(f"{ops!r:.40} is not some of {OPS!r}, each once", field="ops", fix='pass "+", "-" or "+-"')
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidInputError(f"{n!r:.40} problems", field="n", fix="pass a number of problems ≥ 0")
    space = 100 * 100 * len(ops) - len(exclude)
    if n > space:
        raise InvalidInputError(f"only {space} distinct problems with ops={ops!r}", field="n", fix=f"ask for at most {space}")
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    while len(out) < n:
        p = _problem(_operand(rng), rng.choice(ops), _operand(rng))
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def split(n_train: int, n_test: int, seed: int, ops: str = "+-") -> tuple[list[Problem], list[Problem]]:
    """A held-out test set and a training set that shares no question with it."""
    test = make_problems(n_test, seed + 1_000_003, ops)
    train = make_problems(n_train, seed, ops, exclude=frozenset(p.question for p in test))
    return train, test


def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    numbers = _INT.findall(reply)
    correct = bool(numbers) and canonical(numbers[-1]) == canonical(problem.answer)
    only = reply.strip() == problem.answer
    return float(correct), {"correct": float(correct), "format": float(only)}
