"""Chat episodes with tools (:class:`ToolEnv`), rendered through the tokenizer's own chat template by
:class:`asyncsess.chat.ChatRenderer`.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in its reply
(the Hermes/Qwen convention); each result goes back as a ``tool`` message and the model gets another turn.
The next observation is the whole conversation rendered again by the template, exactly what a chat server
would show the model; :func:`asyncsess.rl.data.trajectory_datums` still merges the turns into one datum when that
rendering extends the previous observation and action, which holds for prefix-stable templates.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence

from ..chat import ChatRenderer, Message, Tool, parse_tool_calls
from ..errors import InvalidInputError
from ..types import ModelInput
from .grading import GRADER_TIMEOUT_S, check_timeout, grade_async, timed_out
from .types import Action, Env, Observation, StepResult, StopCondition

__all__ = ["ToolEnv", "FinalGrader"]

FinalGrader = Callable[[str], Awaitable[tuple[float, dict[str, float]]]]


class ToolEnv(Env):
    """A chat episode: the model may call tools on each of its first ``max_turns - 1`` turns; the episode ends
    with the first reply that calls none (or the ``max_turns``-th reply), which ``grade`` scores.

    A malformed tool call, more than ``max_calls`` calls in one reply, or a conversation the template cannot render
    with its special-token text kept plain (:func:`asyncsess.chat.render_chat`) ends the episode (``parse_error``;
    the reply is still graded). A call of an unknown tool, or with arguments that do not fit the tool's schema
    (:meth:`asyncsess.chat.Tool.refusal`), is not run: its result is an ``{"error": ...}`` for the model. When the next
    observation would reach ``max_trajectory_tokens`` the episode ends with ``overflow_reward``
    (``context_overflow``). Tool metrics are reported on the turn of the call; the final step adds
    ``tool_calls``, the number of calls made. A ``grade`` that has not returned within ``grader_timeout_s`` seconds
    (``None``: no limit, for a grader that bounds itself) scores the reply 0 with the metric ``grader_timeouts`` = 1.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        grade: FinalGrader,
        *,
        max_turns: int = 2,
        max_trajectory_tokens: int | None = None,
        overflow_reward: float = 0.0,
        max_calls: int = 16,
        grader_timeout_s: float | None = GRADER_TIMEOUT_S,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if max_calls < 1:
            raise ValueError("max_calls must be >= 1")
        self.renderer, self.messages, self.grade = renderer, [dict(m) for m in messages], grade
        self.tools = {t.name: t for t in tools}
        self.max_turns, self.max_trajectory_tokens, self.overflow_reward = max_turns, max_trajectory_tokens, overflow_reward
        self.max_calls = max_calls
        self.grader_timeout_s = None if grader_timeout_s is None else check_timeout(grader_timeout_s)
        self.turns = 0
        self.tool_calls = 0

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return ModelInput.from_ints(self.renderer.tokens(self.messages, list(self.tools.values()))), list(self.renderer.stop)

    async def step(self, action: Action) -> StepResult:
        text = self.renderer.decode(action)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        calls, error = parse_tool_calls(text, self.max_calls)
        if error is not None or not calls or self.turns >= self.max_turns:
            return await self._end(text, "parse_error" if error is not None else "max_turns" if calls else "completed")
        metrics: dict[str, float] = {}
        for call in calls:
            tool = self.tools.get(call.name)
            refusal = f"unknown tool {call.name[:64]!r}; available: {sorted(self.tools)}" if tool is None else tool.refusal(call.arguments)
            if tool is None or refusal is not None:
                content = json.dumps({"error": refusal})
            else:
                content, tool_metrics = await tool.run(call.arguments)
                metrics.update(tool_metrics)
            self.messages.append({"role": "tool", "content": content})
        self.tool_calls += len(calls)
        try:
            ob = self.renderer.tokens(self.messages, list(self.tools.values()))
        except InvalidInputError:  # the reply or a result spells special tokens and the template changes that content
            return await self._end(text, "parse_error", metrics)
        if self.max_trajectory_tokens is not None and len(ob) >= self.max_trajectory_tokens:
            metrics["tool_calls"] = float(self.tool_calls)
            return StepResult(self.overflow_reward, True, metrics=metrics, stop_reason="context_overflow")
        return StepResult(0.0, False, ModelInput.from_ints(ob), list(self.renderer.stop), metrics)

    async def _end(self, text: str, reason: str, metrics: dict[str, float] | None = None) -> StepResult:
        graded = await grade_async(self.grade, text, timeout_s=self.grader_timeout_s)
        reward, final = timed_out(self.grade, self.grader_timeout_s) if graded is None else graded
        return StepResult(reward, True, metrics={**(metrics or {}), **final, "tool_calls": float(self.tool_calls)}, stop_reason=reason)
