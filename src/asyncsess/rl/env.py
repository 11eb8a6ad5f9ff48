"""Environments for multi-turn RL (torch-free), after tinker-cookbook's ``rl/types.py`` (``spec/cookbook.md`` §2–3).

An :class:`Env` is one episode: ``initial_observation()`` gives the first prompt (tokens) and the stop
condition, ``step(action)`` takes the sampled tokens and returns a :class:`StepResult`. An
:class:`EnvGroupBuilder` makes the ``group_size`` envs of one problem, whose rewards are centred within the
group; an :class:`RLDataset` hands out batches of builders. :func:`do_group_rollout` plays a group with a
:class:`TokenCompleter`, and :func:`group_datums` turns it into RL datums: consecutive turns of a trajectory
share one datum while each observation extends the previous observation plus action (sequence extension),
observation tokens get advantage 0. Chat episodes with tools live in :mod:`asyncsess.rl.tool_env`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from ..client import SamplingClient
from ..types import Datum, ModelInput, SamplingParams, TensorData
from .data import center_advantages
from .rollouts import problems_for_step

__all__ = [
    "Action",
    "Observation",
    "StopCondition",
    "STOP_REASONS",
    "StepResult",
    "Env",
    "EnvGroupBuilder",
    "RLDataset",
    "ProblemDataset",
    "TokensWithLogprobs",
    "TokenCompleter",
    "SamplerCompleter",
    "ScriptedCompleter",
    "Transition",
    "Trajectory",
    "TrajectoryGroup",
    "do_rollout",
    "do_group_rollout",
    "trajectory_datums",
    "group_datums",
    "rollout_metrics",
]

Action = list[int]
Observation = ModelInput
StopCondition = list[str] | list[int]

# Why an episode ended (logged as ``stop/<reason>``): the env ended it normally, the model used up its
# turns, the last action hit ``max_tokens``, it could not be parsed, or the conversation outgrew the context.
STOP_REASONS = ("completed", "max_turns", "max_tokens", "parse_error", "context_overflow")


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


class ProblemDataset:
    """``groups_per_batch`` problems per batch from an endless, epoch-shuffled pass (deterministic, so resumable)."""

    def __init__(self, problems: Sequence[Any], groups_per_batch: int, make_builder: Callable[[Any], EnvGroupBuilder], seed: int = 0):
        if not problems:
            raise ValueError("no problems")
        self.problems, self.groups_per_batch, self.make_builder, self.seed = list(problems), groups_per_batch, make_builder, seed

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.make_builder(p) for p in problems_for_step(self.problems, index, self.groups_per_batch, self.seed)]

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-len(self.problems) // self.groups_per_batch)


@dataclass
class TokensWithLogprobs:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


class TokenCompleter(Protocol):
    """The policy: continues an observation until a stop condition or its token budget."""

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs: ...


class SamplerCompleter:
    """Samples one continuation from a :class:`SamplingClient`; ``max_tokens`` is capped to the context window."""

    def __init__(self, sampler: SamplingClient, max_tokens: int, temperature: float = 1.0, context_window: int | None = None):
        self.sampler, self.max_tokens, self.temperature, self.context_window = sampler, max_tokens, temperature, context_window

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs:
        max_tokens = self.max_tokens
        if self.context_window is not None:
            max_tokens = max(1, min(max_tokens, self.context_window - model_input.length))
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, stop=list(stop) or None)
        seq = (await self.sampler.sample(model_input, 1, params)).sequences[0]
        if seq.logprobs is None:
            raise ValueError("the sampler returned no log-probs; RL needs them")
        return TokensWithLogprobs(list(seq.tokens), [float(x) for x in seq.logprobs], seq.stop_reason)


class ScriptedCompleter:
    """A policy whose replies are scripted and scored by a real sampler's log-probs (tests, benchmarks).

    ``script(conversation)`` gets the decoded observation (special tokens included) and returns the reply,
    or ``None`` to let the model sample it. A scripted reply is encoded, ends with the first stop token id
    (as a sampled turn would) and gets ``compute_logprobs`` from the sampler, so the datums it yields are
    exactly those a sampled reply with the same tokens would give.
    """

    def __init__(
        self,
        sampler: SamplingClient,
        script: Callable[[str], str | None],
        max_tokens: int,
        temperature: float = 1.0,
        context_window: int | None = None,
    ):
        self.sampler, self.script, self.max_tokens = sampler, script, max_tokens
        self.tokenizer = sampler.get_tokenizer()
        self.fallback = SamplerCompleter(sampler, max_tokens, temperature, context_window)

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs:
        prompt = model_input.to_ints()
        text = self.script(self.tokenizer.decode(prompt))
        if text is None:
            return await self.fallback(model_input, stop)
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        ends = [s for s in stop if isinstance(s, int)]
        reason = "stop"
        if len(tokens) + bool(ends) > self.max_tokens:
            tokens, reason = tokens[: self.max_tokens], "length"
        elif ends:
            tokens.append(ends[0])
        logprobs = await self.sampler.compute_logprobs(prompt + tokens)
        return TokensWithLogprobs(tokens, [float(x or 0.0) for x in logprobs[len(prompt) :]], reason)


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


async def do_rollout(env: Env, policy: TokenCompleter) -> Trajectory:
    """Play one episode to its end."""
    ob, stop = await env.initial_observation()
    transitions = []
    while True:
        ac = await policy(ob, stop)
        result = await env.step(ac.tokens)
        transitions.append(Transition(ob, ac, float(result.reward), result.episode_done, dict(result.metrics)))
        if result.episode_done:
            reason = "max_tokens" if ac.stop_reason == "length" else result.stop_reason or "completed"
            return Trajectory(transitions, reason)
        ob, stop = result.next_observation, result.next_stop_condition


async def do_group_rollout(builder: EnvGroupBuilder, policy: TokenCompleter, sampler_step: int = 0) -> TrajectoryGroup:
    """Play every env of a group concurrently, then add the group rewards."""
    envs = list(await builder.make_envs())
    trajectories: list[Trajectory | None] = [None] * len(envs)

    async def one(i: int) -> None:
        trajectories[i] = await do_rollout(envs[i], policy)

    async with anyio.create_task_group() as tg:
        for i in range(len(envs)):
            tg.start_soon(one, i)
    done = [t for t in trajectories if t is not None]
    group = await builder.compute_group_rewards(done, envs)
    return TrajectoryGroup(done, [float(r) for r, _ in group], [dict(m) for _, m in group], sampler_step)


def trajectory_datums(trajectory: Trajectory, advantage: float) -> list[tuple[Datum, list[float]]]:
    """RL datums of one trajectory with its action masks.

    Turns are merged while each observation starts with everything so far (previous observations and
    actions); otherwise a new datum starts. Action tokens carry their sampler log-probs and ``advantage``;
    observation tokens carry log-prob 0 and advantage 0 (mask 0).
    """
    out: list[tuple[Datum, list[float]]] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[float] = []

    def flush() -> None:
        if len(tokens) > 1 and any(mask[1:]):
            n = len(tokens) - 1
            adv = [advantage * m for m in mask[1:]]
            datum = Datum.model_construct(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.model_construct(data=tokens[1:], dtype="int64", shape=[n]),
                    "logprobs": TensorData.model_construct(data=logprobs[1:], dtype="float32", shape=[n]),
                    "advantages": TensorData.model_construct(data=adv, dtype="float32", shape=[n]),
                },
            )
            out.append((datum, mask[1:]))
        del tokens[:], logprobs[:], mask[:]

    def add(new: Sequence[int], lps: Sequence[float], m: float) -> None:
        tokens.extend(new)
        logprobs.extend(lps)
        mask.extend([m] * len(new))

    for t in trajectory.transitions:
        ob = t.ob.to_ints()
        if len(t.ac.logprobs) != len(t.ac.tokens):
            raise ValueError(f"{len(t.ac.tokens)} action tokens but {len(t.ac.logprobs)} log-probs")
        if not tokens or ob[: len(tokens)] != tokens:
            flush()
        new = ob[len(tokens) :]
        add(new, [0.0] * len(new), 0.0)
        add(t.ac.tokens, t.ac.logprobs, 1.0)
    flush()
    return out


def group_datums(group: TrajectoryGroup) -> list[tuple[Datum, list[float]]]:
    """Datums of the group's trajectories with a non-zero centred advantage ``R - mean(R)`` (cookbook §3)."""
    out = []
    for trajectory, adv in zip(group.trajectories, center_advantages(group.total_rewards)):
        if adv != 0.0:
            out.extend(trajectory_datums(trajectory, adv))
    return out


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Means over trajectories: ``env/all/reward/total``, ``env/all/<metric>`` (over the trajectories that
    report it), ``env/all/turns_per_episode``, ``env/all/ac_tokens_per_turn``, ``env/all/ob_tokens_per_turn``,
    and the share of each stop reason as ``stop/<reason>``."""
    rows = [(t, total, gm) for g in groups for t, total, gm in zip(g.trajectories, g.total_rewards, g.group_metrics)]
    n = max(1, len(rows))
    turns = [len(t.transitions) for t, _, _ in rows]
    nturns = max(1, sum(turns))
    out = {
        "env/all/reward/total": sum(total for _, total, _ in rows) / n,
        "env/all/turns_per_episode": sum(turns) / n,
        "env/all/ac_tokens_per_turn": sum(len(x.ac.tokens) for t, _, _ in rows for x in t.transitions) / nturns,
        "env/all/ob_tokens_per_turn": sum(x.ob.length for t, _, _ in rows for x in t.transitions) / nturns,
    }
    episode = [{**t.metrics, **gm} for t, _, gm in rows]
    for key in sorted({k for m in episode for k in m}):
        values = [m[key] for m in episode if key in m]
        out[f"env/all/{key}"] = sum(values) / len(values)
    reasons = [t.stop_reason for t, _, _ in rows]
    for reason in dict.fromkeys([*STOP_REASONS, *reasons]):
        out[f"stop/{reason}"] = reasons.count(reason) / n
    return out
