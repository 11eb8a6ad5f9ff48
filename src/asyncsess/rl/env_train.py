"""The RL loop for environments (multi-turn, tools), with sampling and training overlapped under a staleness bound.

Rollouts run ahead of the trainer, one task per group, each sampled from the newest weights when it starts.
At most ``groups_per_batch × (k + 1)`` groups are started and not yet trained (``k =
max_steps_off_policy``): that paces sampling, and a slot is freed when its group has been trained on
(tinker-cookbook's async mode, ``spec/cookbook.md`` §4). The trainer takes finished groups oldest sampler
first; a group more than ``k`` optimizer steps old is requeued (its problem is played again with the newest
weights), so no group trained at step ``s`` was sampled before step ``s - k``. ``k = 0`` is the synchronous
on-policy loop. ``forward_backward`` is submitted per sub-batch (``groups_per_batch / num_minibatches``
groups) as soon as that many groups have finished, and one ``optim_step`` closes each step.

Advantages are group-centred (``R - mean(R)``, cookbook §3); groups of equal rewards add no datums.
``metrics.jsonl`` gets one line per step (``env/all/*``, ``stop/*``, ``async/staleness_{max,min,mean}``,
``async/requeued``, ``optim/*``, ``tokens/*``, ``time/*``) and held-out results (``test/env/all/*``, greedy,
one episode per problem) before the first step, every ``eval_every`` steps and after the last. Checkpoints
go to ``checkpoints.jsonl`` with the position in the dataset and the groups started but not trained; a rerun
in the same directory resumes there (those groups are played again with the restored weights).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup
from pydantic import ConfigDict, Field, model_validator

from ..backends.base import Tokenizer
from ..client import SamplingClient, ServiceClient, TrainingClient
from ..futures import APIFuture
from ..runs.checkpoints import CheckpointRecord, RecoveryConfig, open_training_client, prepare_run_dir, run_recovering, save_checkpoint
from ..runs.metrics import MetricsLogger, read_metrics
from ..runs.progress import progress_bar
from ..types import AdamParams, Datum, ForwardBackwardOutput
from .data import is_constant, sample_train_kl
from .env import (
    EnvGroupBuilder,
    RLDataset,
    SamplerCompleter,
    TokenCompleter,
    TrajectoryGroup,
    do_group_rollout,
    group_datums,
    rollout_metrics,
)

__all__ = ["EnvRLConfig", "EnvRLResult", "MakeCompleter", "MakeDatasets", "PlayGroup", "train_env_rl"]

# (tokenizer) -> (training dataset, held-out group builders: one episode each)
MakeDatasets = Callable[[Tokenizer], tuple[RLDataset, Sequence[EnvGroupBuilder]]]
# (sampler, max_tokens, temperature, context_window) -> the policy that plays episodes
MakeCompleter = Callable[[SamplingClient, int, float, int | None], TokenCompleter]
# (builder, sampler, temperature, sampler_step) -> the played group; default: the envs played by the completer
PlayGroup = Callable[[EnvGroupBuilder, SamplingClient, float, int], Awaitable[TrajectoryGroup]]


class EnvRLConfig(RecoveryConfig):
    """Settings of an environment RL run (written to ``config.json``); a lost session is recovered (:class:`RecoveryConfig`)."""

    model_config = ConfigDict(extra="forbid")

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    lora_rank: int = 32
    lora_alpha: float | None = 64.0
    train_unembed: bool = False
    seed: int = 0
    learning_rate: float = 4e-5
    groups_per_batch: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=1)
    max_tokens: int = Field(default=512, ge=1)
    temperature: float = 1.0
    context_window: int | None = None  # caps prompt + max_tokens; default: the base model's, where the backend says
    loss_fn: str = "cispo"
    loss_fn_config: dict[str, float] | None = None
    max_steps_off_policy: int = Field(default=0, ge=0)
    num_minibatches: int = Field(default=1, ge=1)
    max_steps: int = Field(default=50, ge=0)
    max_minutes: float | None = None
    eval_every: int = 0
    save_every: int = 0

    @model_validator(mode="after")
    def _minibatches(self) -> EnvRLConfig:
        if self.num_minibatches > self.groups_per_batch:
            raise ValueError(f"num_minibatches ({self.num_minibatches}) exceeds groups_per_batch ({self.groups_per_batch})")
        return self


@dataclass
class EnvRLResult:
    run_dir: Path
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    train_seconds: float
    final_checkpoint: CheckpointRecord


def _default_completer(sampler: SamplingClient, max_tokens: int, temperature: float, context_window: int | None) -> TokenCompleter:
    return SamplerCompleter(sampler, max_tokens, temperature, context_window)


async def train_env_rl(
    config: EnvRLConfig,
    make_datasets: MakeDatasets,
    run_dir: str | Path,
    *,
    make_completer: MakeCompleter | None = None,
    play_group: PlayGroup | None = None,
    if_exists: Literal["resume", "overwrite", "raise"] = "resume",
    progress: bool = True,
) -> EnvRLResult:
    """Run (or resume) RL on the environments of ``make_datasets(tokenizer)``.

    ``play_group`` replaces how a group is played (the agent loop runs the user's agents through the
    OpenAI front there); by default each env is played with ``make_completer``'s policy.
    """
    cfg = config

    async def attempt(mode: Literal["resume", "overwrite", "raise"], recovered: dict[str, float]) -> EnvRLResult:
        path, record = prepare_run_dir(run_dir, cfg, mode)
        start = record.step if record else 0
        with MetricsLogger(path, resume_step=start if record or recovered else None) as log:
            async with ServiceClient(cfg.url) as svc:
                tc = await open_training_client(svc, cfg, record)
                train, test = make_datasets(tc.get_tokenizer())
                window = cfg.context_window
                if window is None:
                    caps = await svc.get_server_capabilities()
                    window = next((m.max_context_length for m in caps.supported_models if m.model_name == tc.base_model), None)
                loop = _Loop(cfg, tc, train, list(test), make_completer or _default_completer, window, path, log, play_group)
                loop.pending_metrics = dict(recovered)
                return await loop.run(start, record, progress)

    return await run_recovering(attempt, if_exists, url=cfg.url, run_dir=run_dir, recovery=cfg)


class _Samplers:
    """The newest sampling client and older ones still used by rollouts; unused old ones are stopped."""

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


@dataclass
class _Finished:
    index: int  # position of the group in the run's stream of groups
    version: int  # optimizer steps of the weights it was sampled from
    group: TrajectoryGroup | None
    error: Exception | None
    seconds: float


class _Rollouts:
    """Plays the run's groups ahead of the trainer, at most ``slots`` of them started and not yet trained."""

    def __init__(
        self,
        tg: TaskGroup,
        dataset: RLDataset,
        groups_per_batch: int,
        slots: int,
        samplers: _Samplers,
        play: Callable[[EnvGroupBuilder, SamplingClient, int], Awaitable[TrajectoryGroup]],
        cursor: int,
        pending: Sequence[int],
    ) -> None:
        self._tg, self._dataset, self._per_batch = tg, dataset, groups_per_batch
        self._slots = anyio.Semaphore(slots)
        self._samplers, self._play_group = samplers, play
        self.cursor = cursor  # the next group never started
        self._queue: deque[int] = deque(pending)  # started before (a checkpoint, a requeue), to play again
        self.open: set[int] = set(pending)  # started and not yet trained
        self._ready: list[_Finished] = []
        self._changed = anyio.Event()

    async def dispatch(self) -> None:
        while True:
            await self._slots.acquire()
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
            group = await self._play_group(builder, sampler, version)
        except Exception as err:
            error = err
        finally:
            self._samplers.release(sampler)
        self._ready.append(_Finished(index, version, group, error, time.perf_counter() - t0))
        self._changed.set()

    async def take(self) -> _Finished:
        """A finished group, the one sampled from the oldest weights first; a rollout's error is raised here."""
        while not self._ready:
            self._changed = anyio.Event()
            await self._changed.wait()
        done = min(self._ready, key=lambda f: f.version)
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


class _Loop:
    def __init__(
        self,
        cfg: EnvRLConfig,
        tc: TrainingClient,
        train: RLDataset,
        test: list[EnvGroupBuilder],
        make_completer: MakeCompleter,
        window: int | None,
        path: Path,
        log: MetricsLogger,
        play_group: PlayGroup | None = None,
    ) -> None:
        self.cfg, self.tc, self.train, self.test = cfg, tc, train, test
        self.make_completer, self.window, self.path, self.log = make_completer, window, path, log
        self.play_group = play_group
        self.samplers: _Samplers | None = None
        self.pending_metrics: dict[str, float] = {}  # logged with the next step (a recovery's figures)

    async def play(
        self, builder: EnvGroupBuilder, sampler: SamplingClient, version: int, temperature: float | None = None
    ) -> TrajectoryGroup:
        t = self.cfg.temperature if temperature is None else temperature
        if self.play_group is not None:
            return await self.play_group(builder, sampler, t, version)
        return await do_group_rollout(builder, self.policy(sampler, t), version)

    def policy(self, sampler: SamplingClient, temperature: float | None = None) -> TokenCompleter:
        t = self.cfg.temperature if temperature is None else temperature
        return self.make_completer(sampler, self.cfg.max_tokens, t, self.window)

    async def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the held-out builders with the newest weights."""
        if not self.test:
            return {}
        assert self.samplers is not None
        version, sampler = self.samplers.acquire()
        groups: list[TrajectoryGroup | None] = [None] * len(self.test)
        try:

            async def one(i: int) -> None:
                groups[i] = await self.play(self.test[i], sampler, version, 0.0)

            async with anyio.create_task_group() as tg:
                for i in range(len(self.test)):
                    tg.start_soon(one, i)
        finally:
            self.samplers.release(sampler)
        return {f"test/{k}": v for k, v in rollout_metrics([g for g in groups if g is not None]).items()}

    async def run(self, start: int, record: CheckpointRecord | None, progress: bool) -> EnvRLResult:
        cfg = self.cfg
        self.samplers = _Samplers(start, await self.tc.save_weights_and_get_sampling_client())
        if start == 0:
            before = await self.evaluate()
        else:
            before = next(({k: v for k, v in r.items() if k.startswith("test/")} for r in read_metrics(self.path) if r["step"] == 0), {})
        extra = record.extra if record is not None else {}
        eval_metrics = before if start == 0 else {}
        async with anyio.create_task_group() as tg:
            rollouts = _Rollouts(
                tg,
                self.train,
                cfg.groups_per_batch,
                cfg.groups_per_batch * (cfg.max_steps_off_policy + 1),
                self.samplers,
                self.play,
                int(extra.get("cursor", start * cfg.groups_per_batch)),
                [int(i) for i in extra.get("pending", [])],
            )
            tg.start_soon(rollouts.dispatch)
            failure: Exception | None = None
            try:
                step, train_seconds = await self.steps(start, rollouts, eval_metrics, progress)
            except Exception as err:  # raised as itself, not inside the task group's ExceptionGroup
                failure = err
            position = {"cursor": rollouts.cursor, "pending": sorted(rollouts.open)}
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        after = await self.evaluate()
        self.log.log(step, {"progress/step": step, **after})
        final = await self.checkpoint(step, position, final=True)
        return EnvRLResult(self.path, step, before, after, train_seconds, final)

    async def steps(self, start: int, rollouts: _Rollouts, eval_metrics: dict[str, float], progress: bool) -> tuple[int, float]:
        """Train from step ``start`` to ``max_steps`` (or ``max_minutes``); the steps done and their seconds."""
        cfg = self.cfg
        step, train_seconds, step_seconds = start, 0.0, 0.0
        with progress_bar("RL", total=cfg.max_steps, enabled=progress) as bar:
            bar.advance(start)
            while step < cfg.max_steps:
                if cfg.max_minutes is not None and train_seconds + step_seconds > 60 * cfg.max_minutes:
                    break
                t0 = time.perf_counter()
                metrics = await self.train_step(step, rollouts)
                step += 1
                step_seconds = time.perf_counter() - t0
                train_seconds += step_seconds
                metrics.update({"time/step": step_seconds, "time/total": train_seconds, **eval_metrics, **self.pending_metrics})
                self.pending_metrics = {}
                self.log.log(step - 1, metrics)
                bar.advance(status=f"reward {metrics['env/all/reward/total']:.3f}")
                eval_metrics = {}
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                    eval_metrics = await self.evaluate()
                if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                    await self.checkpoint(step, rollouts, final=False)
        return step, train_seconds

    async def train_step(self, step: int, rollouts: _Rollouts) -> dict[str, Any]:
        cfg, tc = self.cfg, self.tc
        assert self.samplers is not None
        k, per_batch = cfg.max_steps_off_policy, cfg.groups_per_batch
        sub_batch = -(-per_batch // cfg.num_minibatches)
        taken: list[_Finished] = []
        waiting: list[_Finished] = []
        submitted: list[tuple[APIFuture[ForwardBackwardOutput], list[tuple[Datum, list[float]]]]] = []
        requeued, wait = 0, 0.0
        while len(taken) < per_batch:
            tw = time.perf_counter()
            done = await rollouts.take()
            wait += time.perf_counter() - tw
            if done.version < step - k:
                rollouts.requeue(done.index)
                requeued += 1
                continue
            taken.append(done)
            waiting.append(done)
            if len(waiting) == sub_batch or len(taken) == per_batch:
                pairs = [p for f in waiting if f.group is not None for p in group_datums(f.group)]
                if pairs:
                    submitted.append((tc.forward_backward([d for d, _ in pairs], cfg.loss_fn, cfg.loss_fn_config), pairs))
                waiting = []
        t1 = time.perf_counter()
        groups = [f.group for f in taken if f.group is not None]
        staleness = [step - f.version for f in taken]
        rewards = [g.total_rewards for g in groups]
        metrics: dict[str, Any] = {
            "progress/step": step,
            "progress/done_frac": (step + 1) / max(1, cfg.max_steps),
            **rollout_metrics(groups),
            "env/all/constant_reward_groups": sum(is_constant(r) for r in rewards),
            "async/staleness_max": max(staleness, default=0),
            "async/staleness_min": min(staleness, default=0),
            "async/staleness_mean": sum(staleness) / max(1, len(staleness)),
            "async/requeued": requeued,
            "tokens/sampled": sum(len(x.ac.tokens) for g in groups for t in g.trajectories for x in t.transitions),
            "tokens/train": sum(d.model_input.length for _, pairs in submitted for d, _ in pairs),
            "train/datums": sum(len(pairs) for _, pairs in submitted),
            "train/forward_backward_calls": len(submitted),
            "time/sample_wait": wait,
            "time/group_rollout": sum(f.seconds for f in taken) / max(1, len(taken)),
        }
        if submitted:
            opt = tc.optim_step(AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8))
            sampler = await tc.save_weights_and_get_sampling_client()
            outs = [await fut for fut, _ in submitted]
            opt_out = await opt
            pairs = [p for _, ps in submitted for p in ps]
            trainer_lps = [o["logprobs"].data for out in outs for o in out.loss_fn_outputs]
            metrics.update(sample_train_kl([d.loss_fn_inputs["logprobs"].data for d, _ in pairs], trainer_lps, [m for _, m in pairs]))
            metrics["optim/loss"] = sum(out.metrics.get("loss:sum", 0.0) for out in outs)
            metrics.update({f"optim/{k}": v for k, v in (opt_out.metrics or {}).items()})
        else:  # no signal in this batch: the weights stay as they are
            sampler = self.samplers.client
        await self.samplers.publish(step + 1, sampler)
        rollouts.trained([f.index for f in taken])
        metrics["time/train"] = time.perf_counter() - t1
        return metrics

    async def checkpoint(self, step: int, position: _Rollouts | dict[str, Any], final: bool) -> CheckpointRecord:
        if isinstance(position, _Rollouts):
            position = {"cursor": position.cursor, "pending": sorted(position.open)}
        name = f"{'final' if final else 'step'}-{step:06d}"
        return await save_checkpoint(self.tc, self.path, name, step, kind="both" if final else "state", final=final, extra=position)
