"""What the OpenAI front records of every call it serves, by rollout id (turned into trajectories by
:mod:`asyncsess.rl.capture`): the exact prompt tokens, each choice's sampled tokens and the sampler's
log-probs, the weight version that produced them, the finish reason and the usage."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CapturedChoice", "CapturedCall", "CaptureStore", "MAX_CAPTURE_TOKENS"]

MAX_CAPTURE_TOKENS = 4_000_000  # what a server keeps per API key by default: about 100 MB of captures at the most


class CapturedChoice(BaseModel):
    """One sampled continuation: its tokens, the sampler's log-prob of each, and how it ended."""

    model_config = ConfigDict(extra="forbid")

    index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "tool_calls"]
    text: str = ""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # tool-call id -> how its arguments break the schema of its ``strict`` tool (sampling is unconstrained): for a reward
    schema_errors: dict[str, str] = Field(default_factory=dict)
    # how the reply fails the call ``tool_choice`` ("required" or a named function) forced: not a call, another tool
    tool_choice_error: str | None = None


class CapturedCall(BaseModel):
    """Everything the front knows about one served call."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    call_index: int  # position of the call within its rollout
    endpoint: Literal["chat.completions", "completions", "responses"]
    model: str
    sampler_id: str
    weight_version: int  # which refresh of the weights sampled it (the loop's optimizer step)
    prompt_tokens: list[int]
    choices: list[CapturedChoice]
    usage: dict[str, int]
    request: dict[str, Any] = Field(default_factory=dict)  # messages / prompt and sampling settings, as sent


class CaptureStore:
    """The calls the front served, by rollout id, in the order they were served.

    ``max_tokens`` bounds the memory: a call costs its prompt and sampled tokens plus its request's JSON at
    four characters a token. Past the bound the store forgets whole rollouts, least recently added to
    first (the one being added to last, and then only its oldest calls); ``dropped_calls`` counts them. A
    trainer that takes its rollouts as they finish never sees a drop; one that never takes them does not
    grow the server without bound.

    A call still being served when its rollout is taken (or dropped) is **late**: the trainer already has the
    rollout without it, so it is not captured (``late_calls`` counts them), and a new call of the same rollout id
    numbers on after it rather than reusing its index.
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.dropped_calls = 0
        self.late_calls = 0
        self._calls: OrderedDict[str, list[CapturedCall]] = OrderedDict()
        self._counts: dict[str, int] = {}  # rollout -> call indices handed out
        self._in_flight: dict[str, int] = {}  # rollout -> calls reserved and not yet added or released
        self._late: dict[str, list[int]] = {}  # taken rollout -> [indices below this are late, late calls in flight]

    def reserve(self, rollout_id: str) -> int:
        """The call index of a new call of ``rollout_id``: the order in which its calls arrived."""
        n = self._counts.get(rollout_id, 0)
        self._counts[rollout_id] = n + 1
        self._in_flight[rollout_id] = self._in_flight.get(rollout_id, 0) + 1
        return n

    def release(self, rollout_id: str, index: int) -> bool:
        """Give back ``index`` (of a call that captured nothing) if no later call of ``rollout_id`` took one."""
        if self._settle(rollout_id, index) or self._counts.get(rollout_id) != index + 1:
            return False
        if index:
            self._counts[rollout_id] = index
        else:
            del self._counts[rollout_id]
        return True

    def add(self, call: CapturedCall) -> None:
        if self._settle(call.rollout_id, call.call_index):
            self.late_calls += 1
            return
        self._calls.setdefault(call.rollout_id, []).append(call)
        self._calls.move_to_end(call.rollout_id)
        self.tokens += _cost(call)
        if self.max_tokens is not None:
            while self.tokens > self.max_tokens and self._calls:
                oldest = next(iter(self._calls))
                calls = self._calls[oldest]
                if oldest == call.rollout_id and len(calls) == 1:
                    break  # one call over the whole bound is kept until taken
                gone = self._calls.pop(oldest) if oldest != call.rollout_id else [calls.pop(0)]
                if oldest != call.rollout_id:
                    self._forget(oldest)
                self.tokens -= sum(_cost(c) for c in gone)
                self.dropped_calls += len(gone)

    def calls(self, rollout_id: str) -> list[CapturedCall]:
        return sorted(self._calls.get(rollout_id, []), key=lambda c: c.call_index)

    def pop(self, rollout_id: str) -> list[CapturedCall]:
        """The calls of ``rollout_id``, forgotten by the store."""
        self._forget(rollout_id)
        calls = self._calls.pop(rollout_id, [])
        self.tokens -= sum(_cost(c) for c in calls)
        return sorted(calls, key=lambda c: c.call_index)

    def _forget(self, rollout_id: str) -> None:
        """Start ``rollout_id`` afresh: its calls still in flight become late, and new ones number on after them."""
        in_flight = self._in_flight.get(rollout_id, 0)
        if in_flight:
            self._late[rollout_id] = [self._counts[rollout_id], in_flight]
        else:
            self._counts.pop(rollout_id, None)

    def _settle(self, rollout_id: str, index: int) -> bool:
        """A reserved call of ``rollout_id`` ended; True if it is late (its rollout was taken while it ran)."""
        left = self._in_flight.get(rollout_id, 0) - 1
        if left > 0:
            self._in_flight[rollout_id] = left
        else:
            self._in_flight.pop(rollout_id, None)
        late = self._late.get(rollout_id)
        if late is None or index >= late[0]:
            return False
        late[1] -= 1
        if late[1] <= 0:
            del self._late[rollout_id]
            if rollout_id not in self._in_flight and rollout_id not in self._calls:
                self._counts.pop(rollout_id, None)  # nothing of the rollout left anywhere: it starts again at 0
        return True

    def rollout_ids(self) -> list[str]:
        return list(self._calls)

    def __iter__(self) -> Iterator[CapturedCall]:
        for calls in list(self._calls.values()):
            yield from calls

    def write_jsonl(self, path: str | Path) -> int:
        """Append every captured call as one JSON line; returns how many were written."""
        n = 0
        with open(path, "a", encoding="utf-8") as f:
            for call in self:
                f.write(call.model_dump_json() + "\n")
                n += 1
        return n


def _cost(call: CapturedCall) -> int:
    """What a call weighs in a store's ``max_tokens``: its tokens, and its request at 4 characters a token."""
    tokens = len(call.prompt_tokens) + sum(len(c.tokens) + len(c.text) // 4 for c in call.choices)
    return tokens + len(json.dumps(call.request, default=str)) // 4
