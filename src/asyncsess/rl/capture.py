"""Token-faithful captures of OpenAI-style calls, merged per rollout into trajectories and RL datums.

The OpenAI front (:mod:`asyncsess.serve.openai_front`) records every call it serves as a
:class:`asyncsess.serve.capture.CapturedCall`: the exact prompt tokens it rendered, each choice's sampled tokens and the sampler's
log-probs, the weight version that produced them, the finish reason and the usage. Calls carry the rollout
id the agent set (header ``X-Rollout-Id``, ``metadata.rollout_id`` or ``user``).

:func:`build_trajectory` turns the calls of one rollout into an :class:`asyncsess.rl.types.Trajectory`: one
transition per call (observation = prompt tokens, action = completion tokens with their log-probs), so
:func:`asyncsess.rl.data.trajectory_datums` merges consecutive calls into one datum where the later prompt
extends the earlier prompt + completion token for token, trains only the sampled tokens (mask 1) and masks
everything the template, the user or a tool put in between (mask 0). Where a prompt does *not* extend what
the model saw and said before (re-tokenization drift: a reply re-rendered differently, an edited history),
the trajectory is split there and a :class:`Drift` with its reason and position is recorded: the mismatched
tokens are observation tokens of the new segment, never trained on as the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..runs.jsonl import open_for_append, read_jsonl
from ..serve.capture import CapturedCall
from ..types import Datum, ModelInput
from .data import trajectory_datums
from .types import TokensWithLogprobs, Trajectory, Transition

__all__ = ["Drift", "AgentTrajectory", "build_trajectory", "read_trajectories", "trajectories_file"]

DriftReason = Literal["completion_retokenized", "prompt_changed"]


class Drift(BaseModel):
    """A call whose prompt is not a token-level extension of the previous prompt + completion.

    ``position`` is the first token index where they differ; ``reason`` is ``completion_retokenized`` when
    that lies inside the previous completion (the reply came back rendered differently) and
    ``prompt_changed`` when it lies inside the previous prompt (history edited, template not prefix-stable).
    """

    call_index: int
    position: int
    reason: DriftReason
    expected: int  # tokens the model had seen and said before this call
    handling: Literal["split"] = "split"


class AgentTrajectory(BaseModel):
    """One rollout's calls as a trajectory, with its reward and the drift found while merging them."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rollout_id: str
    reward: float
    calls: list[CapturedCall]
    chosen: list[int]  # per call, the choice the next call continued (0 for the last)
    drift: list[Drift]
    weight_versions: list[int]

    def trajectory(self) -> Trajectory:
        """As an :class:`asyncsess.rl.types.Trajectory` (one transition per call; the reward on the last)."""
        transitions = []
        for i, (call, k) in enumerate(zip(self.calls, self.chosen)):
            choice = call.choices[k]
            last = i == len(self.calls) - 1
            ac = TokensWithLogprobs(list(choice.tokens), list(choice.logprobs), "length" if choice.finish_reason == "length" else "stop")
            metrics = {"calls": float(len(self.calls)), "drift": float(len(self.drift))} if last else {}
            transitions.append(Transition(ModelInput.from_ints(call.prompt_tokens), ac, self.reward if last else 0.0, last, metrics))
        ended = self.calls[-1].choices[self.chosen[-1]].finish_reason if self.calls else "stop"
        return Trajectory(transitions, "max_tokens" if ended == "length" else "completed")

    def datums(self, advantage: float) -> list[tuple[Datum, list[float]]]:
        """RL datums with ``advantage`` on the sampled tokens, and their masks (1 = trained)."""
        return trajectory_datums(self.trajectory(), advantage)

    def segments(self) -> list[dict[str, Any]]:
        """The merged token sequences: ``tokens``, ``mask`` (1 = sampled by the model) and ``logprobs`` per token."""
        out = []
        for datum, mask in self.datums(1.0):
            tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].data[-1])]
            lps = [0.0, *[float(x) for x in datum.loss_fn_inputs["logprobs"].data]]
            out.append({"tokens": tokens, "mask": [0.0, *mask], "logprobs": lps})
        return out

    def record(self) -> dict[str, Any]:
        """A JSON-able line for offline SFT / DPO: calls, merged segments, drift and reward."""
        return {
            "rollout_id": self.rollout_id,
            "reward": self.reward,
            "weight_versions": self.weight_versions,
            "drift": [d.model_dump() for d in self.drift],
            "segments": self.segments(),
            "calls": [c.model_dump() for c in self.calls],
            "chosen": self.chosen,
        }


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def build_trajectory(rollout_id: str, calls: Sequence[CapturedCall], reward: float) -> AgentTrajectory:
    """Merge one rollout's calls (in call order) into a trajectory, detecting re-tokenization drift.

    Of a call with several choices, the one the next prompt continues is followed (the longest such);
    where none is, choice 0 is and the next call is a drift.
    """
    calls = sorted(calls, key=lambda c: c.call_index)
    for c in calls:
        for ch in c.choices:
            if len(ch.tokens) != len(ch.logprobs):
                raise ValueError(f"call {c.call_index} choice {ch.index}: {len(ch.tokens)} tokens but {len(ch.logprobs)} log-probs")
    chosen: list[int] = []
    for i, call in enumerate(calls):
        k = 0
        if i + 1 < len(calls):
            nxt = calls[i + 1].prompt_tokens
            fits = [ch.index for ch in call.choices if _extends(nxt, call.prompt_tokens + ch.tokens)]
            if fits:
                k = max(fits, key=lambda j: len(call.choices[j].tokens))
        chosen.append(k)
    drift: list[Drift] = []
    for i in range(1, len(calls)):
        prev, k = calls[i - 1], chosen[i - 1]
        expected = prev.prompt_tokens + prev.choices[k].tokens
        prompt = calls[i].prompt_tokens
        if not _extends(prompt, expected):
            pos = _first_difference(prompt, expected)
            reason: DriftReason = "completion_retokenized" if pos >= len(prev.prompt_tokens) else "prompt_changed"
            drift.append(Drift(call_index=calls[i].call_index, position=pos, reason=reason, expected=len(expected)))
    return AgentTrajectory(
        rollout_id=rollout_id,
        reward=float(reward),
        calls=list(calls),
        chosen=chosen,
        drift=drift,
        weight_versions=sorted({c.weight_version for c in calls}),
    )


def _extends(prompt: Sequence[int], before: Sequence[int]) -> bool:
    return len(prompt) >= len(before) and list(prompt[: len(before)]) == list(before)


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """The trajectory records of a ``trajectories.jsonl`` written by the agent loop (for offline SFT / DPO): a torn
    last line (a killed run's) is left out, any other line that is not a JSON object is an InvalidInputError naming
    it (:mod:`asyncsess.runs.jsonl`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no {path}")
    return [r for _, r in read_jsonl(path, _any_record, _FIX)]


def _any_record(line: int, record: dict[str, Any]) -> None:
    """Every JSON object is a trajectory record here."""


_FIX = "cut trajectories.jsonl back to its last good line"


def trajectories_file(path: Path) -> Path:
    """``path`` (a run's ``trajectories.jsonl``) ready for appending: a torn last line left by a killed run is cut
    off first, so the next record does not land on the same line."""
    open_for_append(path, _any_record, _FIX).close()
    return path
