"""A scripted code-RL policy: replies chosen at random among right and wrong answers, tool calls, no code."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

from asyncsess.tasks.code import CodeProblem

WRONG = "print(0)\n"


def answer(code: str) -> str:
    return f"Here is my program.\n```python\n{code}```"


def tool_call(code: str) -> str:
    return "Let me check it first.\n<tool_call>" + json.dumps({"name": "check_solution", "arguments": {"code": code}}) + "</tool_call>"


def code_policy(problems: Sequence[CodeProblem], seed: int, sample_share: float = 0.0) -> Callable[[str], str | None]:
    """``script(conversation)`` for :class:`asyncsess.rl.rollouts.ScriptedCompleter`. First turn: a tool call with the
    reference or a wrong program, a right or wrong answer, a reply without code, or a malformed tool call;
    after a tool result: the reference program when the check passed, else another call or a coin flip. With
    ``sample_share`` of first turns the model samples its own reply (``None``)."""
    rng = random.Random(seed)

    def script(conversation: str) -> str | None:
        problem = next(p for p in problems if p.question in conversation)
        assert problem.solution is not None
        right = problem.solution
        if '"test_count"' in conversation:  # the tool's verdict is in the conversation: answer (or call again)
            if '"passed": true' in conversation:
                return answer(right)
            r = rng.random()
            return tool_call(right) if r < 0.3 else answer(right if r < 0.65 else WRONG)
        if rng.random() < sample_share:
            return None
        r = rng.random()
        if r < 0.3:
            return tool_call(right)
        if r < 0.45:
            return tool_call(WRONG)
        if r < 0.65:
            return answer(right)
        if r < 0.8:
            return answer(WRONG)
        if r < 0.9:
            return "I am not sure how to solve this."
        return "<tool_call>{not json</tool_call>"

    return script
