"""Chat episodes with tools, rendered through the tokenizer's own chat template.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in its reply
(the Hermes/Qwen convention); each result goes back as a ``tool`` message and the model gets another turn.
The next observation is the whole conversation rendered again by the template, exactly what a chat server
would show the model; :func:`asyncsess.rl.data.trajectory_datums` still merges the turns into one datum when that
rendering extends the previous observation and action, which holds for prefix-stable templates.

Templates differ in what they support, so :class:`ChatRenderer` probes the tokenizer once: where the template
has no tool role (it raises, or drops the message) a result is sent as a user message wrapped in
``<tool_response>…</tool_response>`` (how Qwen's template renders tool results), and where it ignores the
``tools`` argument the tool signatures are added to the system message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..chat import Message, turn_stop_tokens
from ..types import ModelInput
from .types import Action, Env, Observation, StepResult, StopCondition

__all__ = ["Tool", "ToolCall", "parse_tool_calls", "ChatRenderer", "ToolEnv"]

ToolFn = Callable[[Mapping[str, Any]], Awaitable[tuple[str, dict[str, float]]]]
FinalGrader = Callable[[str], Awaitable[tuple[float, dict[str, float]]]]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_PROBE = "asyncsess-probe-7f3a"


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``run(arguments) -> (result text, metrics)``."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    run: ToolFn

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """The tool calls in a reply, and an error message when one is malformed (not JSON, no name, unclosed)."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            return calls, f"a tool call is not JSON: {err}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments", {}), dict):
            return calls, 'a tool call must be {"name": str, "arguments": object}'
        calls.append(ToolCall(obj["name"], dict(obj.get("arguments", {}))))
    if text.count("<tool_call>") != len(calls):
        return calls, "a <tool_call> is not closed"
    return calls, None


class ChatRenderer:
    """Renders conversations with tools for one tokenizer; ``stop`` holds the tokens that end an assistant turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop: list[int] = turn_stop_tokens(tokenizer)
        self.tool_role = self._renders(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": _PROBE}]
        )
        self._native_tools: dict[str, bool] = {}

    def tokens(self, messages: Sequence[Message], tools: Sequence[Tool] = (), add_generation_prompt: bool = True) -> list[int]:
        """The conversation's tokens as the model sees it (with the prompt for the next assistant turn)."""
        schemas = [t.schema() for t in tools]
        msgs = self._portable(messages)
        if schemas and not self._shows_tools(schemas):
            msgs = _with_tool_prompt(msgs, schemas)
            schemas = []
        return self._render(msgs, schemas, add_generation_prompt)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _render(self, messages: Sequence[Message], tools: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        extra = {"tools": tools} if tools else {}
        out = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **extra)
        if not isinstance(out, list):
            out = out["input_ids"]
        return [int(t) for t in out]

    def _renders(self, messages: list[dict[str, str]]) -> bool:
        try:
            return _PROBE in self.tokenizer.decode(self._render(messages, [], False))
        except Exception:  # the template rejects the conversation (an unknown role)
            return False

    def _shows_tools(self, schemas: list[dict[str, Any]]) -> bool:
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._native_tools:
            probe = [{"role": "user", "content": "hi"}]
            try:
                self._native_tools[key] = self._render(probe, schemas, True) != self._render(probe, [], True)
            except Exception:
                self._native_tools[key] = False
        return self._native_tools[key]

    def _portable(self, messages: Sequence[Message]) -> list[dict[str, str]]:
        """Tool results as user messages where the template has no tool role (adjacent ones joined)."""
        if self.tool_role:
            return [dict(m) for m in messages]
        out: list[dict[str, str]] = []
        for m in messages:
            if m.get("role") != "tool":
                out.append(dict(m))
                continue
            wrapped = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + wrapped
            else:
                out.append({"role": "user", "content": wrapped, "_tool": "1"})
        return [{k: v for k, v in m.items() if k != "_tool"} for m in out]


def _with_tool_prompt(messages: list[dict[str, str]], schemas: list[dict[str, Any]]) -> list[dict[str, str]]:
    signatures = "\n".join(json.dumps(s) for s in schemas)
    prompt = (
        "You can call these tools:\n<tools>\n" + signatures + "\n</tools>\n"
        'To call one, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and end your turn; '
        "the result comes back in <tool_response></tool_response>."
    )
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


class ToolEnv(Env):
    """A chat episode: the model may call tools on each of its first ``max_turns - 1`` turns; the episode ends
    with the first reply that calls none (or the ``max_turns``-th reply), which ``grade`` scores.

    A malformed tool call ends the episode (``parse_error``; the reply is still graded). When the next
    observation would reach ``max_trajectory_tokens`` the episode ends with ``overflow_reward``
    (``context_overflow``). Tool metrics are reported on the turn of the call; the final step adds
    ``tool_calls``, the number of calls made.
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
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.renderer, self.messages, self.grade = renderer, [dict(m) for m in messages], grade
        self.tools = {t.name: t for t in tools}
        self.max_turns, self.max_trajectory_tokens, self.overflow_reward = max_turns, max_trajectory_tokens, overflow_reward
        self.turns = 0
        self.tool_calls = 0

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return ModelInput.from_ints(self.renderer.tokens(self.messages, list(self.tools.values()))), list(self.renderer.stop)

    async def step(self, action: Action) -> StepResult:
        text = self.renderer.decode(action)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        calls, error = parse_tool_calls(text)
        if error is not None or not calls or self.turns >= self.max_turns:
            reward, final = await self.grade(text)
            reason = "parse_error" if error is not None else "max_turns" if calls else "completed"
            return StepResult(reward, True, metrics={**final, "tool_calls": float(self.tool_calls)}, stop_reason=reason)
        metrics: dict[str, float] = {}
        for call in calls:
            tool = self.tools.get(call.name)
            if tool is None:
                content = json.dumps({"error": f"unknown tool {call.name!r}; available: {sorted(self.tools)}"})
            else:
                content, tool_metrics = await tool.run(call.arguments)
                metrics.update(tool_metrics)
            self.messages.append({"role": "tool", "content": content})
        self.tool_calls += len(calls)
        ob = self.renderer.tokens(self.messages, list(self.tools.values()))
        if self.max_trajectory_tokens is not None and len(ob) >= self.max_trajectory_tokens:
            metrics["tool_calls"] = float(self.tool_calls)
            return StepResult(self.overflow_reward, True, metrics=metrics, stop_reason="context_overflow")
        return StepResult(0.0, False, ModelInput.from_ints(ob), list(self.renderer.stop), metrics)
