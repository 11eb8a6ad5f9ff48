"""Playing episodes: the policies (:class:`SamplerCompleter`, :class:`ScriptedCompleter`), a group played
concurrently (:func:`do_group_rollout`), the sampler pool that hands each rollout a weight version, and
the scheduler that plays the run's groups ahead of the trainer under a staleness bound.

A group whose envs all start from the same observation (every single-turn problem, the first turn of most
multi-turn ones) samples that first action in one request of ``n = group_size`` (one prefill), seeded when
the policy has a seed, so a run at a fixed seed is reproducible.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from ..client import SamplingClient
from ..errors import InvalidInputError
from ..types import ModelInput, SamplingParams
from .grading import COUNTED
from .types import STOP_REASONS, StepResult, TokensWithLogprobs, Trajectory, TrajectoryGroup, Transition, check_reward

if TYPE_CHECKING:
    from .types import Env, EnvGroupBuilder, RLDataset, StopCondition, TokenCompleter


__all__ = [
    "SamplerCompleter",
    "ScriptedCompleter",
    "do_rollout",
    "do_group_rollout",
    "rollout_metrics",
    "SamplerPool",
    "RolloutScheduler",
    "FinishedGroup",
]


class SamplerCompleter:
    """Samples from a :class:`SamplingClient`; ``max_tokens`` is capped to the context window.

    ``complete_group`` samples ``n`` continuations of one observation in one request, with ``seed``.
    """

    def __init__(
        self, sampler: SamplingClient, max_tokens: int, temperature: float = 1.0, context_window: int | None = None, seed: int | None = None
    ):
        self.sampler, self.max_tokens, self.temperature, self.context_window = sampler, max_tokens, temperature, context_window
        self.seed = seed

    async def __call__(self, model_input: ModelInput, stop: StopCondition) -> TokensWithLogprobs:
        return (await self._sample(model_input, stop, 1, None))[0]

    async def complete_group(self, model_input: ModelInput, stop: StopCondition, n: int) -> list[TokensWithLogprobs]:
        return await self._sample(model_input, stop, n, self.seed)

    async def _sample(self, model_input: ModelInput, stop: StopCondition, n: int, seed: int | None) -> list[TokensWithLogprobs]:
        max_tokens = self.max_tokens
        if self.context_window is not None:
            max_tokens = max(1, min(max_tokens, self.context_window - model_input.length))
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, stop=list(stop) or None, seed=seed)
        out = []
        for seq in (await self.sampler.sample(model_input, n, params)).sequences:
            if seq.logprobs is None:
                raise ValueError("the sampler returned no log-probs; RL needs them")
            out.append(TokensWithLogprobs(list(seq.tokens), [float(x) for x in seq.logprobs], seq.stop_reason))
        return out


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


# turns one episode may take: an env that never sets episode_done would otherwise sample forever
MAX_TURNS = 10_000
_ENV_FIX = "see asyncsess.rl.types.Env: initial_observation() -> (ModelInput, stop), step(action) -> StepResult"


async def _play(env: Env, policy: TokenCompleter, ob: ModelInput, stop: StopCondition, first: TokensWithLogprobs | None) -> Trajectory:
    transitions: list[Transition] = []
    name = type(env).__qualname__
    while len(transitions) < MAX_TURNS:
        ac, first = first or _action(await policy(ob, stop), policy), None
        result = await env.step(ac.tokens)
        if not isinstance(result, StepResult):
            raise InvalidInputError(f"{name}.step() returned {result!r:.60}, not a StepResult", field="step", fix=_ENV_FIX)
        reward, metrics = check_reward(result.reward, result.metrics, f"{name}.step()")
        transitions.append(Transition(ob, ac, reward, result.episode_done, metrics))
        if result.episode_done:
            reason = "max_tokens" if ac.stop_reason == "length" else result.stop_reason or "completed"
            return Trajectory(transitions, reason)
        ob, stop = _observation(result.next_observation, result.next_stop_condition, f"{name}.step()'s next_observation")
    raise InvalidInputError(f"{name} played {MAX_TURNS} turns without episode_done", field="episode_done", fix="end each episode")


def _action(ac: object, policy: object) -> TokensWithLogprobs:
    """A policy's (a ``make_completer``'s) action, checked: int tokens, each with a finite log-prob."""
    name = type(policy).__qualname__
    if (
        not isinstance(ac, TokensWithLogprobs)
        or not isinstance(ac.tokens, list)
        or not isinstance(ac.logprobs, list)
        or len(ac.tokens) != len(ac.logprobs)
        or not all(type(t) is int for t in ac.tokens)
    ):
        fix = "return TokensWithLogprobs(tokens: list[int], logprobs: list[float], one per token, stop_reason)"
        raise InvalidInputError(f"{name} returned {ac!r:.80}", field="make_completer", fix=fix)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in ac.logprobs):
        raise InvalidInputError(
            f"{name} returned a log-prob that is not a finite number", field="make_completer", fix="return the sampler's log-probs"
        )
    return ac


def _observation(ob: object, stop: object, source: str) -> tuple[ModelInput, StopCondition]:
    """An env's observation and stop condition, checked (a ModelInput: ``ModelInput.from_ints(tokens)``)."""
    if not isinstance(ob, ModelInput):
        raise InvalidInputError(
            f"{source} is {ob!r:.60}, not a ModelInput", field="observation", fix=f"wrap tokens: ModelInput.from_ints(tokens); {_ENV_FIX}"
        )
    return ob, stop  # type: ignore[return-value]


async def _start(env: Env) -> tuple[ModelInput, StopCondition]:
    started = await env.initial_observation()
    source = f"{type(env).__qualname__}.initial_observation()"
    if not isinstance(started, tuple) or len(started) != 2:
        raise InvalidInputError(f"{source} returned {started!r:.60}, not (observation, stop)", field="observation", fix=_ENV_FIX)
    return _observation(*started, source)


async def do_rollout(env: Env, policy: TokenCompleter) -> Trajectory:
    """Play one episode to its end."""
    ob, stop = await _start(env)
    return await _play(env, policy, ob, stop, None)


async def do_group_rollout(builder: EnvGroupBuilder, policy: TokenCompleter, sampler_step: int = 0) -> TrajectoryGroup:
    """Play every env of a group concurrently, then add the group rewards. Where all envs start from the same
    observation and the policy has ``complete_group``, their first actions are sampled in one request."""
    made = await builder.make_envs()
    if not isinstance(made, Sequence) or not all(callable(getattr(e, "step", None)) for e in made):
        raise InvalidInputError(
            f"{type(builder).__qualname__}.make_envs() returned {made!r:.60}, not a list of Envs", field="make_envs", fix=_ENV_FIX
        )
    envs = list(made)
    starts = [await _start(env) for env in envs]
    firsts: Sequence[TokensWithLogprobs | None] = [None] * len(envs)
    complete_group = getattr(policy, "complete_group", None)
    if len(envs) > 1 and complete_group is not None:
        first, stop = starts[0][0], list(starts[0][1])
        if all((ob is first or ob.to_ints() == first.to_ints()) and list(s) == stop for ob, s in starts[1:]):
            firsts = [_action(a, policy) for a in await complete_group(starts[0][0], starts[0][1], len(envs))]
            if len(firsts) != len(envs):
                raise InvalidInputError(
                    f"{type(policy).__qualname__}.complete_group gave {len(firsts)} actions for {len(envs)} envs",
                    field="make_completer",
                    fix="return n actions",
                )
    trajectories: list[Trajectory | None] = [None] * len(envs)

    async def one(i: int) -> None:
        trajectories[i] = await _play(envs[i], policy, starts[i][0], starts[i][1], firsts[i])

    await run_all(one, len(envs))
    done = [t for t in trajectories if t is not None]
    source = f"{type(builder).__qualname__}.compute_group_rewards()"
    rewards = await builder.compute_group_rewards(done, envs)
    if not isinstance(rewards, Sequence) or len(rewards) != len(done) or not all(isinstance(p, tuple) and len(p) == 2 for p in rewards):
        raise InvalidInputError(  # a short list dropped trajectories from the group without a word
            f"{source} returned {rewards!r:.60} for {len(done)} trajectories",
            field="compute_group_rewards",
            fix="return one (reward, metrics) pair per trajectory",
        )
    group = [check_reward(r, m, source) for r, m in rewards]
    return TrajectoryGroup(done, [r for r, _ in group], [m for _, m in group], sampler_step)


async def run_all(fn: Callable[[int], Awaitable[None]], n: int) -> None:
    """``fn(0)`` .. ``fn(n - 1)`` concurrently; the first to fail cancels the rest and its error is raised as
    itself (an env's or grader's own exception, not an ExceptionGroup around it)."""
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def one(i: int) -> None:
            try:
                await fn(i)
            except Exception as err:
                errors.append(err)
                tg.cancel_scope.cancel()

        for i in range(n):
            tg.start_soon(one, i)
    if errors:
        raise errors[0]


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Means over trajectories: ``env/all/reward/total``, ``env/all/<metric>`` (over the trajectories that
    report it; ``env/all/grader_timeouts`` and ``agent_timeouts`` are counts), ``env/all/turns_per_episode``,
    ``env/all/ac_tokens_per_turn``, ``env/all/ob_tokens_per_turn``, and the share of each stop reason as ``stop/<reason>``."""
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
        out[f"env/all/{key}"] = sum(values) / (1 if key in COUNTED else len(values))
    reasons = [t.stop_reason for t, _, _ in rows]
    for reason in dict.fromkeys([*STOP_REASONS, *reasons]):
        out[f"stop/{reason}"] = reasons.count(reason) / n
    return out


class SamplerPool:
    """The newest sampling client (and its weight version) and older ones still used by rollouts; an old one
    is stopped once no rollout uses it."""

    def __init__(self, version: int, client: SamplingClient) -> None:
        self.version, self.client = version, client
        self._clients: dict[int, SamplingClient] = {id(client): client}
        self._users: Counter[int] = Counter()

    def acquire(self) -> tuple[int, SamplingClient]:
        self._users[id(self.client)] += 1
        return self.version, self.client

    def release(self, client: SamplingClient) -> None:
        self._users[id(client)] -= 1

    async def publish(self, version: int, client: SamplingClient) -> None:
        self.version, self.client = version, client
        self._clients[id(client)] = client
        for key, old in list(self._clients.items()):
            if old is not client and self._users[key] <= 0:
                del self._clients[key]
                await old.stop()


# (builder, sampler, its weight version, the group's position in the run's stream) -> the played group
PlayFn = Callable[["EnvGroupBuilder", SamplingClient, int, int], Awaitable[TrajectoryGroup]]


@dataclass
class FinishedGroup:
    index: int  # position of the group in the run's stream of groups
    version: int  # optimizer steps of the weights it was sampled from
    group: TrajectoryGroup | None
    error: Exception | None
    started: float
    finished: float


class RolloutScheduler:
    """Plays the run's groups ahead of the trainer, at most ``slots`` of them started and not yet trained.

    Group ``index`` is builder ``index % groups_per_batch`` of batch ``index // groups_per_batch``; each is
    played with the newest weights when its slot frees; a requeued group is played again before new ones.
    ``finished`` groups (saved with a checkpoint, see :meth:`settle`) are ready to train from the start.
    """

    def __init__(
        self,
        tg: TaskGroup,
        dataset: RLDataset,
        groups_per_batch: int,
        slots: int,
        samplers: SamplerPool,
        play: PlayFn,
        cursor: int,
        finished: Sequence[FinishedGroup] = (),
    ) -> None:
        self._tg, self._dataset, self._per_batch = tg, dataset, groups_per_batch
        self._slots = anyio.Semaphore(max(0, slots - len(finished)))
        self._samplers, self._play_group = samplers, play
        self.cursor = cursor  # the next group never started
        self._queue: deque[int] = deque()  # requeued, to play again
        self.open: set[int] = {f.index for f in finished}  # started and not yet trained
        self._ready: list[FinishedGroup] = list(finished)
        self._changed = anyio.Event()

    async def dispatch(self) -> None:
        """Start a group whenever a slot is free; the groups of freed slots start together, in one tick, so their
        sampling requests reach the backend together (and batch there)."""
        while True:
            await self._slots.acquire()
            self._start()
            while True:
                try:
                    self._slots.acquire_nowait()
                except anyio.WouldBlock:
                    break
                self._start()

    def _start(self) -> None:
        if self._queue:
            index = self._queue.popleft()
        else:
            index, self.cursor = self.cursor, self.cursor + 1
        self.open.add(index)
        version, sampler = self._samplers.acquire()
        self._tg.start_soon(self._play, index, version, sampler)

    async def _play(self, index: int, version: int, sampler: SamplingClient) -> None:
        t0 = time.perf_counter()
        group: TrajectoryGroup | None = None
        error: Exception | None = None
        try:
            builder = self._dataset.get_batch(index // self._per_batch)[index % self._per_batch]
            group = await self._play_group(builder, sampler, version, index)
        except Exception as err:
            error = err
        finally:
            self._samplers.release(sampler)
        self._ready.append(FinishedGroup(index, version, group, error, t0, time.perf_counter()))
        self._changed.set()

    async def take(self) -> FinishedGroup:
        """A finished group, the one sampled from the oldest weights first; a rollout's error is raised here."""
        while not self._ready:
            self._changed = anyio.Event()
            await self._changed.wait()
        done = min(self._ready, key=lambda f: (f.version, f.index))
        self._ready.remove(done)
        if done.error is not None:
            raise done.error
        return done

    def requeue(self, index: int) -> None:
        self._queue.appendleft(index)
        self._slots.release()

    def trained(self, indices: Sequence[int]) -> None:
        for index in indices:
            self.open.discard(index)
            self._slots.release()

    async def settle(self) -> tuple[int, list[FinishedGroup]]:
        """Wait until every started group has finished; then :attr:`cursor` and the finished, untrained groups (a
        checkpoint saves them, so a resumed run trains exactly what an uninterrupted one would)."""
        while not self.open <= {f.index for f in self._ready}:
            self._changed = anyio.Event()
            await self._changed.wait()
        for f in self._ready:
            if f.error is not None:
                raise f.error
        return self.cursor, sorted(self._ready, key=lambda f: f.index)
