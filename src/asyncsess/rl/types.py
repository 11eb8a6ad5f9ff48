"""The RL vocabulary (torch-free), after tinker-cookbook's ``rl/types.py``.

An :class:`Env` is one episode: ``initial_observation()`` gives the first prompt (tokens) and the stop
condition, ``step(action)`` takes the sampled tokens and returns a :class:`StepResult`. An
:class:`EnvGroupBuilder` makes the ``group_size`` envs of one problem, whose rewards are centred within the
group; an :class:`RLDataset` hands out batches of builders by index (its order a pure function of the
index), a :class:`StatefulDataset` draws them in order and saves its position as JSON data. A :class:`TokenCompleter` is the policy. Playing
an env gives a :class:`Trajectory` of :class:`Transition` s; a group's trajectories form a
:class:`TrajectoryGroup`. Single-turn problems are one-step envs (:mod:`asyncsess.rl.problem_env`), chat
episodes with tools are :class:`asyncsess.rl.tool_env.ToolEnv`.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidInputError
from ..types import ModelInput

__all__ = [
    "Action",
    "Observation",
    "StopCondition",
    "STOP_REASONS",
    "MAX_REWARD",
    "StepResult",
    "check_reward",
    "Env",
    "EnvGroupBuilder",
    "RLDataset",
    "StatefulDataset",
    "TokensWithLogprobs",
    "TokenCompleter",
    "Transition",
    "Trajectory",
    "TrajectoryGroup",
]

Action = list[int]
Observation = ModelInput
StopCondition = list[str] | list[int]

# Why an episode ended (logged as ``stop/<reason>``): the env ended it normally, the model used up its
# turns, the last action hit ``max_tokens``, it could not be parsed, or the conversation outgrew the context.
STOP_REASONS = ("completed", "max_turns", "max_tokens", "parse_error", "context_overflow")


# the largest |reward| (and |metric|) a run takes: centred advantages (up to twice it) stay within float32
MAX_REWARD = 1e30
_REWARD_FIX = "return a finite float (score a reply you cannot grade as 0.0; leave a metric out where it does not apply)"


def check_reward(reward: object, metrics: Mapping[str, object], source: str) -> tuple[float, dict[str, float]]:
    """``reward`` and ``metrics`` as a run takes them: real numbers (numpy's included, a bool as 0/1) of at most
    :data:`MAX_REWARD` in magnitude. Anything else (None, a string, NaN, inf, an array) is an
    :class:`InvalidInputError` naming ``source`` (the env, grader or agent that returned it) and the field, so a
    broken reward function stops the run at once, not later as NaN advantages or as a string read as a number."""
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise InvalidInputError(f"{source} returned metrics {metrics!r:.60}", field="metrics", fix="return a dict of str to float")
    value = _number(reward, "reward", source)
    return value, {k: _number(v, f"metrics[{k!r:.40}]", source) for k, v in metrics.items()}


def _number(value: object, name: str, source: str) -> float:
    try:
        number = float(value) if isinstance(value, numbers.Real) else math.nan
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= MAX_REWARD):
        raise InvalidInputError(
            f"{source} returned {name} = {value!r:.60} (a {type(value).__name__}), not a finite number within ±{MAX_REWARD:g}",
            field=name.partition("[")[0],
            fix=_REWARD_FIX,
        )
    return number


@dataclass
class StepResult:
    """What an env returns for one action. ``stop_reason`` says why a finished episode ended (default completed)."""

    reward: float
    episode_done: bool
    next_observation: Observation = field(default_factory=ModelInput.empty)
    next_stop_condition: StopCondition = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str | None = None


class Env(abc.ABC):
    """One episode; single use."""

    @abc.abstractmethod
    async def initial_observation(self) -> tuple[Observation, StopCondition]: ...

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult: ...


class EnvGroupBuilder(abc.ABC):
    """Makes the envs of one group (the same problem ``group_size`` times)."""

    @abc.abstractmethod
    async def make_envs(self) -> Sequence[Env]: ...

    async def compute_group_rewards(self, trajectories: Sequence[Trajectory], envs: Sequence[Env]) -> list[tuple[float, dict[str, float]]]:
        """Rewards that depend on the whole group (pairwise, multi-agent), added to each trajectory's; default 0."""
        return [(0.0, {}) for _ in trajectories]


class RLDataset(Protocol):
    """Batches of group builders; ``get_batch(i)`` is batch ``i`` of the run."""

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class StatefulDataset(Protocol):
    """Batches of group builders drawn in order (a stream, a shuffling generator, a file reader), whose position
    is saved with each checkpoint and restored on resume.

    ``next_batch()`` draws the next ``groups_per_batch`` builders (endlessly: start a new epoch rather than
    stop). ``state_dict()`` returns the position as JSON data (cursor, epoch, RNG state as lists and ints);
    ``load_state_dict(state)`` puts the dataset back there, so the batches drawn next are those drawn after
    ``state_dict()`` was taken. :class:`asyncsess.rl.datasets.ShuffledDataset` is one, ready to use.
    """

    def next_batch(self) -> Sequence[EnvGroupBuilder]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TokensWithLogprobs:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


class TokenCompleter(Protocol):
    """The policy: continues an observation until a stop condition or its token budget."""

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs: ...


@dataclass
class Transition:
    ob: Observation
    ac: TokensWithLogprobs
    reward: float
    episode_done: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    transitions: list[Transition]
    stop_reason: str

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.transitions)

    @property
    def metrics(self) -> dict[str, float]:
        """The episode's metrics: each step's, a later step's value winning on a shared key."""
        out: dict[str, float] = {}
        for t in self.transitions:
            out.update(t.metrics)
        return out


@dataclass
class TrajectoryGroup:
    """One group's trajectories, their group rewards, and the weights (optimizer steps) they were sampled from."""

    trajectories: list[Trajectory]
    group_rewards: list[float]
    group_metrics: list[dict[str, float]]
    sampler_step: int = 0

    @property
    def total_rewards(self) -> list[float]:
        return [t.reward + g for t, g in zip(self.trajectories, self.group_rewards)]

    def to_dict(self) -> dict[str, Any]:
        """As JSON-able data (a group saved with a checkpoint)."""
        return {
            "trajectories": [
                {
                    "transitions": [
                        {
                            "ob": t.ob.model_dump(mode="json"),
                            "ac": asdict(t.ac),
                            "reward": t.reward,
                            "episode_done": t.episode_done,
                            "metrics": t.metrics,
                        }
                        for t in traj.transitions
                    ],
                    "stop_reason": traj.stop_reason,
                }
                for traj in self.trajectories
            ],
            "group_rewards": self.group_rewards,
            "group_metrics": self.group_metrics,
            "sampler_step": self.sampler_step,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrajectoryGroup:
        """The group :meth:`to_dict` saved; a ValueError (or KeyError / TypeError) for data it cannot have written:
        rewards and metrics that are not finite numbers, token ids that are not ints, log-probs not one per token."""
        group = cls._from_dict(d)
        for traj in group.trajectories:
            for t in traj.transitions:
                check_reward(t.reward, t.metrics, "a saved transition")
                lps = t.ac.logprobs
                if not all(type(x) is int for x in t.ac.tokens) or len(lps) != len(t.ac.tokens):
                    raise ValueError("a saved action's tokens are not ints with one log-prob each")
                if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in lps):
                    raise ValueError("a saved action's log-probs are not finite numbers")
        if not len(group.group_rewards) == len(group.group_metrics) == len(group.trajectories):
            raise ValueError("a saved group has not one group reward per trajectory")
        for r, m in zip(group.group_rewards, group.group_metrics):
            check_reward(r, m, "a saved group reward")
        return group

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> TrajectoryGroup:
        trajectories = [
            Trajectory(
                [
                    Transition(
                        ModelInput.model_validate(t["ob"]), TokensWithLogprobs(**t["ac"]), t["reward"], t["episode_done"], t["metrics"]
                    )
                    for t in traj["transitions"]
                ],
                traj["stop_reason"],
            )
            for traj in d["trajectories"]
        ]
        return cls(trajectories, list(d["group_rewards"]), list(d["group_metrics"]), int(d["sampler_step"]))
