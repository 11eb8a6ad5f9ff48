"""The RL loop: one config, one loop, for single-turn problems, multi-turn envs and OpenAI-speaking agents.

Rollouts run ahead of the trainer, one task per group, each played with the newest weights when it starts
(tinker-cookbook's async mode). At most ``groups_per_batch × (k + 1)`` groups are started and not yet trained
(``k = max_staleness``): that paces sampling, and a slot is freed when its group has been trained on. The
trainer takes finished groups oldest weights first; a group more than ``k`` optimizer steps old is requeued
(played again with the newest weights), so no group trained at step ``s`` was sampled before step ``s - k``.
``k = 0`` is the synchronous on-policy loop, and there a run at a fixed seed is reproducible and resumes bit
for bit (each group's sampling seed follows from its position in the run). ``forward_backward`` is submitted
per sub-batch (``groups_per_batch / num_minibatches`` groups) as soon as that many groups have finished;
one ``optim_step`` (AdamW with the config's settings) closes each step, or ``epochs_per_batch`` of them, each after a
``forward_backward`` over the whole batch again (PPO-style reuse; the ratio's anchor stays the batch's start).

Advantages are group-centred (``R - mean(R)``, optionally std-normalised); groups of equal rewards add no
datums; an optional KL penalty against the base model moves the advantages (cookbook). ``metrics.jsonl`` gets
one line per step and held-out results (``test/...``, greedy, one episode per held-out builder) before the
first step, every ``eval_every`` steps and after the last. Checkpoints go to ``checkpoints.jsonl`` with the
position in the stream of groups, the groups started but not trained, and a stateful dataset's state
(:class:`~asyncsess.rl.types.StatefulDataset`); a rerun in the same directory resumes there. A lost session is
recovered (:class:`~asyncsess.runs.checkpoints.RecoveryConfig`). Every sampler refresh is checked against the
trainer (``verify_refresh``, :mod:`.refresh`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..backends.base import Tokenizer
from ..client import SamplingClient, ServiceClient, TrainingClient
from ..errors import AsyncSessError, InvalidInputError
from ..futures import APIFuture
from ..runs.checkpoints import (
    CHECKPOINTS_FILE,
    MAX_STEP,
    CheckpointRecord,
    RecoveryConfig,
    open_run_dir,
    open_training_client,
    run_recovering,
    save_checkpoint,
)
from ..runs.jsonl import write_whole
from ..runs.metrics import MetricsLogger, read_metrics
from ..runs.progress import progress_bar
from ..runs.schedule import LRSchedule, decayed_lr
from ..types import MAX_LEARNING_RATE, MAX_TOKENS, AdamParams, Datum, ForwardBackwardOutput, TensorData
from ..validation import MAX_SAMPLES, check_loss_fn, check_loss_fn_config
from .data import datum_tokens, group_datums, is_constant, kl_penalty, sample_train_kl
from .datasets import CheckedBatches, DrawnBatches, made_datasets, run_dataset
from .off_policy import Correction, OffPolicyMode, correct_batch, off_policy_metrics
from .refresh import RefreshProbe, default_tolerance, probe_tokens
from .rollouts import FinishedGroup, RolloutScheduler, SamplerCompleter, SamplerPool, do_group_rollout, rollout_metrics, run_all
from .types import EnvGroupBuilder, RLDataset, StatefulDataset, TokenCompleter, TrajectoryGroup

__all__ = [
    "LearningRate",
    "LoraAlpha",
    "LoraRank",
    "MaxTokens",
    "Steps",
    "RLConfig",
    "RLResult",
    "MakeCompleter",
    "MakeDatasets",
    "PlayGroup",
    "train_rl",
]

# (tokenizer) -> (training dataset, held-out group builders: one episode each; None for none)
MakeDatasets = Callable[[Tokenizer], tuple[RLDataset | StatefulDataset, Sequence[EnvGroupBuilder] | None]]
# (sampler, max_tokens, temperature, context_window) -> the policy that plays episodes
MakeCompleter = Callable[[SamplingClient, int, float, int | None], TokenCompleter]
# (builder, sampler, temperature, sampler_step) -> the played group; default: the envs played by the completer
PlayGroup = Callable[[EnvGroupBuilder, SamplingClient, float, int], Awaitable[TrajectoryGroup]]


# groups started and not yet trained, groups_per_batch × (max_staleness + 1): past it a run is a config typo (each
# is a task, and all are played to the end before the final checkpoint)
MAX_GROUPS_AHEAD = 65_536
# held-out episodes played at once: well under the client's sampling bound (256 requests), so that a large
# evaluation neither pauses the pool (and logs it) nor crowds out the rollouts in flight
EVAL_EPISODES_IN_FLIGHT = 128
# optimizer steps over one batch: PPO-style reuse takes a few (TRL, verl and OpenRLHF default to 1, papers use ≤ 8)
MAX_EPOCHS_PER_BATCH = 64


# the ranges of the settings a config built on RLConfig may give new defaults (AgentRLConfig does): a subclass that
# redeclares a field replaces its Field, so it must redeclare it with these types to keep the checks
LoraRank = Annotated[int, Field(ge=1)]
LoraAlpha = Annotated[float | None, Field(gt=0.0)]
LearningRate = Annotated[float, Field(ge=0.0, le=MAX_LEARNING_RATE)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Steps = Annotated[int, Field(ge=0)]


class RLConfig(RecoveryConfig):
    """Settings of an RL run (written to ``config.json``); a lost session is recovered (:class:`RecoveryConfig`).

    Every number is checked when the config is made (finite, in range), so a bad setting fails before the run
    directory is written or a model is loaded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    lora_rank: LoraRank = 16
    lora_alpha: LoraAlpha = 32.0
    train_unembed: bool = False
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    # the optimizer: AdamW, one step per batch
    learning_rate: LearningRate = 1e-4
    # decays to 0 over the run, whichever limit ends it first: steps done / max_steps or training time / max_minutes
    lr_schedule: LRSchedule = "constant"
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    adam_eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    grad_clip_norm: float = Field(default=0.0, ge=0.0)
    # the batch: groups_per_batch problems × group_size episodes
    groups_per_batch: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=1, le=MAX_SAMPLES)  # sampled in one request of n = group_size
    max_tokens: MaxTokens = 16
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    context_window: int | None = Field(
        default=None, ge=2, le=MAX_TOKENS
    )  # caps prompt + max_tokens; default: the base model's, where the backend says
    # the loss
    loss_fn: str = "ppo"
    loss_fn_config: dict[str, float] | None = None
    normalize_std: bool = False  # divide centred advantages by the group std (math_rl and the demo do)
    remove_constant_reward_groups: bool = True
    kl_penalty_coef: float = Field(default=0.0, ge=0.0)
    # overlap: sampling runs up to max_staleness optimizer steps ahead; forward_backward in sub-batches
    max_staleness: int = Field(default=0, ge=0)
    num_minibatches: int = Field(default=1, ge=1)
    # optimizer steps over each batch (TRL's num_iterations, verl's ppo_epochs): the loss's ratio is taken against the
    # log-probs at the batch's start, so past 1 only a clipped loss (ppo, cispo) keeps the weights near them
    epochs_per_batch: int = Field(default=1, ge=1, le=MAX_EPOCHS_PER_BATCH)
    # off-policy correction of stale groups (rl/off_policy.py; only when max_staleness > 0): ratio cap, mask bounds
    off_policy: OffPolicyMode = "tis"
    is_cap: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    is_mask_low: float = Field(default=0.5, ge=0.0, le=1.0)
    is_mask_high: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    # the run
    max_steps: Steps = 100
    max_minutes: float | None = Field(default=None, gt=0.0)
    eval_every: int = Field(default=0, ge=0)
    save_every: int = Field(default=0, ge=0)
    # check each sampler refresh against the trainer (asyncsess.rl.refresh); tolerance None: by URL scheme
    verify_refresh: bool = True
    refresh_tolerance: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)

    @field_validator("loss_fn")
    @classmethod
    def _known_loss(cls, loss_fn: str) -> str:
        if loss_fn == "cross_entropy":
            raise ValueError("cross_entropy takes no advantages: use an RL loss (importance_sampling, ppo, cispo, dro, gspo)")
        try:
            return check_loss_fn(loss_fn)
        except AsyncSessError as err:
            raise ValueError(err.message) from None

    @model_validator(mode="after")
    def _minibatches(self) -> RLConfig:
        try:
            self.loss_fn_config = check_loss_fn_config(self.loss_fn, self.loss_fn_config)
        except AsyncSessError as err:
            raise ValueError(err.message) from None
        if self.num_minibatches > self.groups_per_batch:
            raise ValueError(f"num_minibatches ({self.num_minibatches}) exceeds groups_per_batch ({self.groups_per_batch})")
        if (ahead := self.groups_per_batch * (self.max_staleness + 1)) > MAX_GROUPS_AHEAD:
            raise ValueError(
                f"groups_per_batch × (max_staleness + 1) = {ahead} groups would be played ahead of the trainer (and all of them "
                f"at the end of a run), more than {MAX_GROUPS_AHEAD}: lower max_staleness or groups_per_batch"
            )
        try:
            self.adam()  # the first step's settings (a schedule only lowers the rate): AdamParams' own bounds, at the start
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            field = {"eps": "adam_eps", "beta1": "adam_beta1", "beta2": "adam_beta2"}.get(str(first["loc"][0]), str(first["loc"][0]))
            raise ValueError(f"{field}: {first['msg'].removeprefix('Value error, ')}") from None
        return self

    def adam(self, done: float = 0.0) -> AdamParams:
        """The optimizer's settings when the fraction ``done`` of the run is behind (for ``lr_schedule``)."""
        return AdamParams(
            learning_rate=decayed_lr(self.learning_rate, done, self.lr_schedule),
            beta1=self.adam_beta1,
            beta2=self.adam_beta2,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            grad_clip_norm=self.grad_clip_norm,
        )


@dataclass
class RLResult:
    run_dir: Path
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    train_seconds: float
    final_checkpoint: CheckpointRecord


async def train_rl(
    config: RLConfig,
    make_datasets: MakeDatasets,
    run_dir: str | Path,
    *,
    make_completer: MakeCompleter | None = None,
    play_group: PlayGroup | None = None,
    if_exists: Literal["resume", "overwrite", "raise"] = "resume",
    progress: bool = True,
) -> RLResult:
    """Run (or resume) RL on the envs of ``make_datasets(tokenizer)`` (for single-turn problems:
    :func:`asyncsess.rl.problem_env.problem_datasets`). Its training dataset is an :class:`RLDataset`
    (batches by index) or a :class:`StatefulDataset` (drawn in order, its state saved with each checkpoint).

    ``make_completer`` replaces the policy that plays each env (default: sampling with the config's
    settings); ``play_group`` replaces how a whole group is played (the agent loop runs the user's agents
    through the OpenAI front there).
    """
    cfg = config

    async def attempt(mode: Literal["resume", "overwrite", "raise"], recovered: dict[str, float]) -> RLResult:
        with open_run_dir(run_dir, cfg, mode) as (path, record):  # held until the run ends: a second run on it is refused
            return await run(path, record, recovered)

    async def run(path: Path, record: CheckpointRecord | None, recovered: dict[str, float]) -> RLResult:
        start = record.step if record else 0
        resumed = _resume_point(path, record, cfg.groups_per_batch)  # checked before a session is opened
        with MetricsLogger(path, resume_step=start) as log:  # a run resumed before its first checkpoint rewrites step 0 on
            async with ServiceClient(cfg.url) as svc:
                tc = await open_training_client(svc, cfg, record)
                train, test = made_datasets(make_datasets(tc.get_tokenizer()))
                data = run_dataset(train, cfg.groups_per_batch, record.extra if record else None)  # checked, restored
                if isinstance(data, CheckedBatches):  # its first batch, before a sampling or training op
                    data.get_batch(resumed[0] // cfg.groups_per_batch)
                window = cfg.context_window
                if window is None:
                    caps = await svc.get_server_capabilities()
                    window = next((m.max_context_length for m in caps.supported_models if m.model_name == tc.base_model), None)
                reference = await svc.create_sampling_client(base_model=tc.base_model) if cfg.kl_penalty_coef else None
                loop = _Loop(cfg, tc, data, test, window, path, log, make_completer, play_group, reference)
                loop.pending_metrics = dict(recovered)
                return await loop.run(start, record, resumed, progress)

    return await run_recovering(attempt, if_exists, url=cfg.url, run_dir=run_dir, recovery=cfg)


_Pending = tuple[int, int, TrajectoryGroup]  # a saved group: its index, sampler version, episodes
_PENDING = re.compile(r"pending-[0-9]{6,20}\.json")


def _resume_point(path: Path, record: CheckpointRecord | None, groups_per_batch: int) -> tuple[int, list[_Pending]]:
    """The record's position in the stream of groups (``cursor``) and the groups it sampled but did not train
    (its ``pending_file``, read from the run directory only); a typed error naming the field if either is not
    what a checkpoint writes."""
    if record is None:
        return 0, []
    where, fix = f"{path / CHECKPOINTS_FILE} ({record.name})", "start a new run directory"
    cursor = record.extra.get("cursor", record.step * groups_per_batch)
    if type(cursor) is not int or not 0 <= cursor <= MAX_STEP:
        raise InvalidInputError(f"{where}: cursor {cursor!r:.40} is not a group number", field="checkpoints.jsonl.extra.cursor", fix=fix)
    name = record.extra.get("pending_file")
    if name is None:
        return cursor, []
    if not isinstance(name, str) or not _PENDING.fullmatch(name):
        raise InvalidInputError(
            f"{where}: pending_file {name!r:.80} is not a pending-<step>.json name in the run directory",
            field="checkpoints.jsonl.extra.pending_file",
            fix=fix,
        )
    file = path / name
    try:
        if file.is_symlink() or not file.is_file():
            raise OSError(f"{file} is not a file in the run directory")
        saved = json.loads(file.read_bytes().decode("utf-8"))
        if not isinstance(saved, list) or not all(isinstance(f, dict) and {"index", "version", "group"} <= f.keys() for f in saved):
            raise ValueError("not a list of saved groups")
        if not all(type(f["index"]) is int and type(f["version"]) is int and isinstance(f["group"], dict) for f in saved):
            raise ValueError("a group's index, version or group has the wrong type")
        groups = [(f["index"], f["version"], TrajectoryGroup.from_dict(f["group"])) for f in saved]
        if not all(0 <= i < cursor and 0 <= v <= record.step for i, v, _ in groups) or len({i for i, _, _ in groups}) != len(groups):
            raise ValueError(f"a group's index is not one below the cursor ({cursor}) or its version is past the step ({record.step})")
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as err:
        raise InvalidInputError(f"{where}: {name}: {str(err)[:120]}", field="checkpoints.jsonl.extra.pending_file", fix=fix) from None
    return cursor, groups


class _Loop:
    def __init__(
        self,
        cfg: RLConfig,
        tc: TrainingClient,
        train: CheckedBatches | DrawnBatches,
        test: list[EnvGroupBuilder],
        window: int | None,
        path: Path,
        log: MetricsLogger,
        make_completer: MakeCompleter | None,
        play_group: PlayGroup | None,
        reference: SamplingClient | None,
    ) -> None:
        self.cfg, self.tc, self.train, self.test, self.window, self.path, self.log = cfg, tc, train, test, window, path, log
        self.make_completer, self.play_group, self.reference = make_completer, play_group, reference
        self.samplers: SamplerPool | None = None
        tol = cfg.refresh_tolerance or default_tolerance(cfg.url)
        self.probe = RefreshProbe(probe_tokens(tc.get_tokenizer()), tol) if cfg.verify_refresh else None
        self.pending_metrics: dict[str, float] = {}  # logged with the next step (a recovery's figures)

    async def play(self, builder: EnvGroupBuilder, sampler: SamplingClient, version: int, index: int | None) -> TrajectoryGroup:
        """Play one group; ``index`` is its position in the run (its sampling seed), ``None`` for a greedy evaluation."""
        cfg = self.cfg
        t = 0.0 if index is None else cfg.temperature
        if self.play_group is not None:
            return await self.play_group(builder, sampler, t, version)
        if self.make_completer is not None:
            policy = self.make_completer(sampler, cfg.max_tokens, t, self.window)
        else:
            seed = None if index is None else cfg.seed * 1_000_003 + (index // cfg.groups_per_batch) * 1_000 + index % cfg.groups_per_batch
            policy = SamplerCompleter(sampler, cfg.max_tokens, t, self.window, seed)
        return await do_group_rollout(builder, policy, version)

    async def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the held-out builders with the newest weights."""
        if not self.test:
            return {}
        assert self.samplers is not None
        version, sampler = self.samplers.acquire()
        groups: list[TrajectoryGroup | None] = [None] * len(self.test)
        limit = anyio.CapacityLimiter(EVAL_EPISODES_IN_FLIGHT)
        try:

            async def one(i: int) -> None:
                async with limit:
                    groups[i] = await self.play(self.test[i], sampler, version, None)

            await run_all(one, len(self.test))
        finally:
            self.samplers.release(sampler)
        return {f"test/{k}": v for k, v in rollout_metrics([g for g in groups if g is not None]).items()}

    async def run(self, start: int, record: CheckpointRecord | None, resumed: tuple[int, list[_Pending]], progress: bool) -> RLResult:
        cfg = self.cfg
        sampler, probe, _ = await self.refresh(None)
        await self.verify(start, probe, sampler, None)  # a resumed adapter loaded twice fails here
        self.samplers = SamplerPool(start, sampler)
        train_seconds = 0.0
        if start == 0:
            before = await self.evaluate()
        else:  # the evaluation before step 0, and the training time spent so far, from the run's own records
            records = [r for r in read_metrics(self.path) if r["step"] < start]
            before = next(({k: v for k, v in r.items() if k.startswith("test/")} for r in records if r["step"] == 0), {})
            train_seconds = next((r["time/total"] for r in reversed(records) if r.get("time/total") is not None), 0.0)
        now = time.perf_counter()
        finished = [FinishedGroup(index, version, group, None, now, now) for index, version, group in resumed[1]]
        eval_metrics = before if start == 0 else {}
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            rollouts = RolloutScheduler(
                tg,
                self.train,
                cfg.groups_per_batch,
                cfg.groups_per_batch * (cfg.max_staleness + 1),
                self.samplers,
                self.play,
                resumed[0],
                finished,
            )
            if isinstance(self.train, DrawnBatches):  # it keeps the batches of groups not yet trained
                self.train.needed = lambda: min(rollouts.open, default=rollouts.cursor)
            tg.start_soon(rollouts.dispatch)
            try:  # a failure is raised as itself, not inside the task group's ExceptionGroup
                step, train_seconds = await self.steps(start, train_seconds, rollouts, eval_metrics, progress)
                cursor, finished = await rollouts.settle()  # the groups in flight finish; a resumed run trains them
            except Exception as err:
                failure = err
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        after = await self.evaluate()
        self.log.log(step, {"progress/step": step, **after})
        final = await self.checkpoint(step, cursor, finished, final=True)
        return RLResult(self.path, step, before, after, train_seconds, final)

    async def steps(
        self, start: int, train_seconds: float, rollouts: RolloutScheduler, eval_metrics: dict[str, float], progress: bool
    ) -> tuple[int, float]:
        """Train from step ``start`` to ``max_steps`` (or ``max_minutes``); the steps done and the training seconds."""
        cfg = self.cfg
        step, step_seconds = start, 0.0
        with progress_bar("RL", total=cfg.max_steps if cfg.max_minutes is None else None, enabled=progress) as bar:
            bar.advance(start)
            while step < cfg.max_steps:
                if cfg.max_minutes is not None and train_seconds + step_seconds >= 60 * cfg.max_minutes:
                    break
                t0 = time.perf_counter()
                run_frac = max(step / max(1, cfg.max_steps), train_seconds / (60 * cfg.max_minutes) if cfg.max_minutes else 0.0)
                metrics = await self.train_step(step, rollouts, run_frac)
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
                    await self.checkpoint(step, *await rollouts.settle(), final=False)
        return step, train_seconds

    def datums(self, finished: list[FinishedGroup]) -> list[tuple[Datum, list[float]]]:
        cfg = self.cfg
        groups = [f.group for f in sorted(finished, key=lambda f: f.index) if f.group is not None]
        used = [g for g in groups if not (cfg.remove_constant_reward_groups and is_constant(g.total_rewards))]
        return [p for g in used for p in group_datums(g, cfg.normalize_std)]

    async def train_step(self, step: int, rollouts: RolloutScheduler, run_frac: float = 0.0) -> dict[str, Any]:
        cfg, tc = self.cfg, self.tc
        assert self.samplers is not None
        k, per_batch = cfg.max_staleness, cfg.groups_per_batch
        sub_batch = -(-per_batch // cfg.num_minibatches)
        taken: list[FinishedGroup] = []
        waiting: list[FinishedGroup] = []
        submitted: list[tuple[APIFuture[ForwardBackwardOutput], list[tuple[Datum, list[float]]]]] = []
        behaviour: list[Sequence[float]] = []  # the sampler's log-probs of the submitted datums
        correction: Correction | None = None  # the off-policy weights applied, when correcting
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
                pairs = self.datums(waiting)
                if pairs and self.reference is not None:
                    pairs = await self.with_kl_penalty(pairs)
                if pairs:
                    behaviour.extend(d.loss_fn_inputs["logprobs"].data for d, _ in pairs)
                    if cfg.off_policy != "none" and k > 0:  # the proximal forward: see docs/recipes.md
                        pairs, c = await correct_batch(
                            tc, pairs, cfg.off_policy, cap=cfg.is_cap, low=cfg.is_mask_low, high=cfg.is_mask_high
                        )
                        correction = c if correction is None else correction + c
                    submitted.append((tc.forward_backward([d for d, _ in pairs], cfg.loss_fn, cfg.loss_fn_config), pairs))
                waiting = []
        t1 = time.perf_counter()
        taken.sort(key=lambda f: f.index)
        groups = [f.group for f in taken if f.group is not None]
        staleness = [step - f.version for f in taken]
        sampled = sum(len(x.ac.tokens) for g in groups for t in g.trajectories for x in t.transitions)
        sample_seconds = max((f.finished for f in taken), default=0.0) - min((f.started for f in taken), default=0.0)
        metrics: dict[str, Any] = {
            "progress/step": step,
            "progress/done_frac": (step + 1) / max(1, cfg.max_steps),
            **rollout_metrics(groups),
            "env/all/constant_reward_groups": sum(is_constant(g.total_rewards) for g in groups),
            "async/staleness_max": max(staleness, default=0),
            "async/staleness_min": min(staleness, default=0),
            "async/staleness_mean": sum(staleness) / max(1, len(staleness)),
            "async/requeued": requeued,
            "tokens/sampled": sampled,
            "tokens/train": sum(d.model_input.length for _, pairs in submitted for d, _ in pairs),
            "tokens/sampled_per_s": sampled / sample_seconds if sample_seconds > 0 else 0.0,
            "train/datums": sum(len(pairs) for _, pairs in submitted),
            "train/forward_backward_calls": len(submitted),
            "time/sample_batch": sample_seconds,
            "time/sample_wait": wait,
            "time/group_rollout": sum(f.finished - f.started for f in taken) / max(1, len(taken)),
        }
        if submitted:
            opt = tc.optim_step(cfg.adam(run_frac))
            later: list[APIFuture[Any]] = []  # the further epochs, queued in order behind the first
            for _ in range(cfg.epochs_per_batch - 1):
                later.extend(tc.forward_backward([d for d, _ in pairs], cfg.loss_fn, cfg.loss_fn_config) for _, pairs in submitted)
                later.append(opt)
                opt = tc.optim_step(cfg.adam(run_frac))
            sampler, probe, latency = await self.refresh(opt)
            outs = [await fut for fut, _ in submitted]
            for fut in later:
                await fut
            opt_out = await opt
            pairs = [p for _, ps in submitted for p in ps]
            trainer_lps = [o["logprobs"].data for out in outs for o in out.loss_fn_outputs]
            metrics.update(sample_train_kl(behaviour, trainer_lps, [m for _, m in pairs]))
            metrics.update(off_policy_metrics(behaviour, trainer_lps, [m for _, m in pairs], correction))
            metrics["optim/loss"] = sum(out.metrics.get("loss:sum", 0.0) for out in outs)
            metrics.update({f"optim/{k}": v for k, v in (opt_out.metrics or {}).items()})
            metrics.update(await self.verify(step + 1, probe, sampler, latency))
        else:  # no signal in this batch: the weights stay as they are
            sampler = self.samplers.client
        await self.samplers.publish(step + 1, sampler)
        rollouts.trained([f.index for f in taken])
        metrics["time/train"] = time.perf_counter() - t1
        metrics["tokens/train_per_s"] = metrics["tokens/train"] / metrics["time/train"] if metrics["time/train"] > 0 else 0.0
        return metrics

    async def refresh(self, opt: APIFuture[Any] | None) -> tuple[SamplingClient, APIFuture[ForwardBackwardOutput] | None, float]:
        """A sampler on the weights after ``opt``, the trainer's probe of those weights (submitted before the save, so
        on the same weights) and the refresh latency: seconds from ``opt`` done to the sampler ready."""
        done: list[float] = []
        if opt is not None:
            opt.add_done_callback(lambda _: done.append(time.perf_counter()))
        probe = self.probe.submit(self.tc) if self.probe is not None else None
        sampler = await self.tc.save_weights_and_get_sampling_client()
        ready = time.perf_counter()
        return sampler, probe, max(0.0, ready - done[0]) if done else 0.0

    async def verify(
        self, version: int, probe: APIFuture[ForwardBackwardOutput] | None, sampler: SamplingClient, latency: float | None
    ) -> dict[str, Any]:
        """The refresh's metrics; :class:`~asyncsess.errors.SamplerRefreshError` if ``sampler`` does not serve ``version``."""
        metrics: dict[str, Any] = {} if latency is None else {"time/refresh_latency": latency}
        if self.probe is not None and probe is not None:
            metrics.update((await self.probe.check(version, probe, sampler)).metrics())
        return metrics

    async def with_kl_penalty(self, pairs: list[tuple[Datum, list[float]]]) -> list[tuple[Datum, list[float]]]:
        """The datums with the KL penalty against the base model in their advantages (averaged over ``pairs``)."""
        assert self.reference is not None
        futures = [self.reference.compute_logprobs(datum_tokens(d)) for d, _ in pairs]
        refs = [[float(x or 0.0) for x in (await f)[1:]] for f in futures]
        sampler = [d.loss_fn_inputs["logprobs"].data for d, _ in pairs]
        deltas = kl_penalty(sampler, refs, [m for _, m in pairs], self.cfg.kl_penalty_coef)
        out = []
        for (d, m), delta in zip(pairs, deltas):
            adv = [a + x for a, x in zip(d.loss_fn_inputs["advantages"].data, delta)]
            inputs = {**d.loss_fn_inputs, "advantages": TensorData.model_construct(data=adv, dtype="float32", shape=[len(adv)])}
            out.append((Datum.model_construct(model_input=d.model_input, loss_fn_inputs=inputs), m))
        return out

    async def checkpoint(self, step: int, cursor: int, finished: list[FinishedGroup], final: bool) -> CheckpointRecord:
        """Save the state (and at the end the sampler weights) with the position in the stream of groups
        (``cursor``, the next group never started) and the groups sampled but not trained (``pending-<step>.json``);
        a stateful dataset's state from which those groups are drawn again goes in the record (``dataset``)."""
        extra: dict[str, Any] = {"cursor": cursor}
        if isinstance(self.train, DrawnBatches):
            extra["dataset"] = self.train.state(min((f.index for f in finished), default=cursor))
        else:
            extra["data"] = self.train.identity()
        if finished:
            extra["pending_file"] = f"pending-{step:06d}.json"
            groups = [{"index": f.index, "version": f.version, "group": f.group.to_dict()} for f in finished if f.group is not None]
            write_whole(self.path / extra["pending_file"], json.dumps(groups))  # a resumed run may rewrite a recorded one
        name = f"{'final' if final else 'step'}-{step:06d}"
        return await save_checkpoint(self.tc, self.path, name, step, kind="both" if final else "state", final=final, extra=extra)
