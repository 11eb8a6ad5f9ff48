"""The GRPO loop behind the RL recipes and ``asyncsess demo``.

Each step: take the step's batch of groups from the rollout pipeline (``groups_per_batch`` problems ×
``group_size`` samples), give every sample its group-centred advantage (optionally std-normalised;
constant-reward groups skipped), queue ``forward_backward`` and ``optim_step`` together, refresh the
sampler, and log one line of ``metrics.jsonl``. Held-out greedy accuracy is measured before the first
step and after the last; checkpoints go to ``checkpoints.jsonl`` and a rerun in the same directory
resumes from the last one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
from pydantic import ConfigDict, Field

from ..client import SamplingClient, ServiceClient, TrainingClient
from ..runs.checkpoints import CheckpointRecord, RecoveryConfig, open_training_client, prepare_run_dir, run_recovering, save_checkpoint
from ..runs.metrics import MetricsLogger, read_metrics
from ..runs.progress import progress_bar
from ..types import AdamParams, Datum, TensorData
from .data import datum_tokens, is_constant, kl_penalty, sample_train_kl
from .rollout_pipeline import RolloutPipeline, sampler_step_for
from .rollouts import Grader, Group, Problem, PromptRenderer, evaluate, problems_for_step, sample_group

__all__ = ["RLConfig", "RLResult", "train_rl"]


class RLConfig(RecoveryConfig):
    """Settings of a GRPO run (written to ``config.json``); a lost session is recovered (:class:`RecoveryConfig`)."""

    model_config = ConfigDict(extra="forbid")

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    lora_rank: int = 16
    lora_alpha: float | None = 32.0
    train_unembed: bool = False
    seed: int = 0
    learning_rate: float = 1e-4
    groups_per_batch: int = 8
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    loss_fn: str = "ppo"
    loss_fn_config: dict[str, float] | None = None
    normalize_std: bool = True
    remove_constant_reward_groups: bool = True
    max_staleness: int = Field(default=0, ge=0)
    kl_penalty_coef: float = 0.0
    max_steps: int = Field(default=100, ge=0)
    max_minutes: float | None = None
    eval_every: int = 0
    save_every: int = 0


@dataclass
class RLResult:
    run_dir: Path
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    train_seconds: float
    final_checkpoint: CheckpointRecord


class _Samplers:
    """Sampling clients by weight version (optimizer steps); versions no batch needs any more are stopped."""

    def __init__(self) -> None:
        self.by_step: dict[int, SamplingClient] = {}

    async def drop_before(self, step: int) -> None:
        old = [s for s in self.by_step if s < step]
        keep = {id(c) for s, c in self.by_step.items() if s >= step}
        for s in old:
            client = self.by_step.pop(s)
            if id(client) not in keep:
                keep.add(id(client))
                await client.stop()


async def train_rl(
    config: RLConfig,
    train: Sequence[Problem],
    test: Sequence[Problem],
    grader: Grader,
    run_dir: str | Path,
    *,
    if_exists: Literal["resume", "overwrite", "raise"] = "resume",
    progress: bool = True,
) -> RLResult:
    """Run (or resume) GRPO on ``train``, measuring greedy accuracy on ``test`` before and after."""
    cfg = config

    async def attempt(mode: Literal["resume", "overwrite", "raise"], recovered: dict[str, float]) -> RLResult:
        path, record = prepare_run_dir(run_dir, cfg, mode)
        start = record.step if record else 0
        with MetricsLogger(path, resume_step=start if record or recovered else None) as log:
            async with ServiceClient(cfg.url) as svc:
                tc = await open_training_client(svc, cfg, record)
                loop = _Loop(cfg, svc, tc, PromptRenderer(tc.get_tokenizer()), list(train), list(test), grader, path, log)
                loop.pending_metrics = dict(recovered)
                return await loop.run(start, record, progress)

    return await run_recovering(attempt, if_exists, url=cfg.url, run_dir=run_dir, recovery=cfg)


class _Loop:
    def __init__(
        self,
        cfg: RLConfig,
        svc: ServiceClient,
        tc: TrainingClient,
        renderer: PromptRenderer,
        train: list[Problem],
        test: list[Problem],
        grader: Grader,
        path: Path,
        log: MetricsLogger,
    ) -> None:
        self.cfg, self.svc, self.tc, self.renderer = cfg, svc, tc, renderer
        self.train, self.test, self.grader, self.path, self.log = train, test, grader, path, log
        self.samplers = _Samplers()
        self.reference: SamplingClient | None = None
        self.pending_metrics: dict[str, float] = {}  # logged with the next step (a recovery's figures)

    async def sample_batch(self, step: int, sampler: SamplingClient, sampler_step: int) -> list[Group]:
        cfg = self.cfg
        problems = problems_for_step(self.train, step, cfg.groups_per_batch, cfg.seed)
        groups: list[Group | None] = [None] * len(problems)

        async def one(i: int) -> None:
            params = self.renderer.params(cfg.max_tokens, cfg.temperature, seed=cfg.seed * 1_000_003 + step * 1_000 + i)
            groups[i] = await sample_group(sampler, self.renderer, problems[i], self.grader, cfg.group_size, params, sampler_step)

        async with anyio.create_task_group() as tg:
            for i in range(len(problems)):
                tg.start_soon(one, i)
        return [g for g in groups if g is not None]

    async def evaluate(self, sampler: SamplingClient) -> dict[str, float]:
        if not self.test:
            return {}
        metrics, _ = await evaluate(sampler, self.renderer, self.test, self.grader, self.cfg.max_tokens)
        return {f"test/env/all/{k}": v for k, v in metrics.items()}

    async def run(self, start: int, record: CheckpointRecord | None, progress: bool) -> RLResult:
        cfg, tc = self.cfg, self.tc
        k = cfg.max_staleness
        self.samplers.by_step[start] = await tc.save_weights_and_get_sampling_client()
        if cfg.kl_penalty_coef:
            self.reference = await self.svc.create_sampling_client(base_model=tc.base_model)
        train_seconds = 0.0
        if start == 0:
            before = await self.evaluate(self.samplers.by_step[0])
        else:  # the evaluation before step 0, and the training time spent so far, from the run's own records
            records = [r for r in read_metrics(self.path) if r["step"] < start]
            before = next((_test(r) for r in records if r["step"] == 0), {})
            train_seconds = next((r["time/total"] for r in reversed(records) if r.get("time/total") is not None), 0.0)
        pending = {}
        if record is not None and "pending_file" in record.extra:
            saved = json.loads((self.path / record.extra["pending_file"]).read_text())
            pending = {int(s): [Group.from_dict(g) for g in gs] for s, gs in saved.items()}

        step, eval_metrics, step_seconds = start, before if start == 0 else {}, 0.0
        async with anyio.create_task_group() as tg:
            pipe = RolloutPipeline(tg, self.sample_batch, k)
            for s, groups in pending.items():
                pipe.preload(s, groups)
            with progress_bar("GRPO", total=cfg.max_steps if cfg.max_minutes is None else None, enabled=progress) as bar:
                bar.advance(start)
                while step < cfg.max_steps:
                    if cfg.max_minutes is not None and train_seconds + step_seconds >= 60 * cfg.max_minutes:
                        break
                    t0 = time.perf_counter()
                    for b in range(step, step + k + 1):
                        if not pipe.launched(b):
                            v = sampler_step_for(b, k)
                            v = v if v in self.samplers.by_step else step  # only without saved in-flight batches
                            pipe.launch(b, self.samplers.by_step[v], v)
                    metrics = await self.train_step(step, pipe)
                    step += 1
                    await self.samplers.drop_before(sampler_step_for(step, k))
                    step_seconds = time.perf_counter() - t0
                    train_seconds += step_seconds
                    metrics.update({"time/step": step_seconds, "time/total": train_seconds, **eval_metrics, **self.pending_metrics})
                    self.pending_metrics = {}
                    self.log.log(step - 1, metrics)
                    bar.advance(status=f"reward {metrics['env/all/reward/total']:.3f}")
                    eval_metrics = {}
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                        eval_metrics = await self.evaluate(self.samplers.by_step[step])
                    if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                        await self.checkpoint(step, pipe, final=False)
            after = await self.evaluate(self.samplers.by_step[step])
            self.log.log(step, {"progress/step": step, **after})
            final = await self.checkpoint(step, pipe, final=True)
            tg.cancel_scope.cancel()
        return RLResult(self.path, step, before, after, train_seconds, final)

    async def train_step(self, step: int, pipe: RolloutPipeline) -> dict[str, Any]:
        cfg, tc = self.cfg, self.tc
        t0 = time.perf_counter()
        groups, sample_seconds = await pipe.get(step)
        t_wait = time.perf_counter() - t0
        staleness = [step - g.sampler_step for g in groups]
        used = [g for g in groups if not (cfg.remove_constant_reward_groups and is_constant(g.rewards))]
        pairs = [p for g in used for p in g.datums(cfg.normalize_std)]
        if cfg.kl_penalty_coef and pairs:
            pairs = await self.with_kl_penalty(pairs)
        datums = [d for d, _ in pairs]
        masks = [m for _, m in pairs]
        rollouts = [r for g in groups for r in g.rollouts]
        n = max(1, len(rollouts))
        sampled = sum(len(r.tokens) for r in rollouts)
        metrics: dict[str, Any] = {
            "progress/step": step,
            "progress/done_frac": (step + 1) / max(1, cfg.max_steps),
            "env/all/reward/total": sum(r.reward for r in rollouts) / n,
            "env/all/ac_tokens_per_turn": sampled / n,
            "env/all/constant_reward_groups": sum(is_constant(g.rewards) for g in groups),
            "stop/completed": sum(r.stop_reason == "stop" for r in rollouts) / n,
            "stop/max_tokens": sum(r.stop_reason == "length" for r in rollouts) / n,
            "async/staleness_max": max(staleness, default=0),
            "async/staleness_min": min(staleness, default=0),
            "async/staleness_mean": sum(staleness) / max(1, len(staleness)),
            "tokens/sampled": sampled,
            "tokens/train": sum(d.model_input.length for d in datums),
            "tokens/sampled_per_s": sampled / sample_seconds if sample_seconds > 0 else 0.0,
            "time/sample_batch": sample_seconds,
            "time/sample_wait": t_wait,
        }
        for key in sorted({k for r in rollouts for k in r.metrics}):
            metrics[f"env/all/{key}"] = sum(r.metrics.get(key, 0.0) for r in rollouts) / n
        t1 = time.perf_counter()
        if datums:
            fb = tc.forward_backward(datums, cfg.loss_fn, cfg.loss_fn_config)
            opt = tc.optim_step(AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8))
            self.samplers.by_step[step + 1] = await tc.save_weights_and_get_sampling_client()
            out, opt_out = await fb, await opt
            trainer_lps = [o["logprobs"].data for o in out.loss_fn_outputs]
            sampler_lps = [d.loss_fn_inputs["logprobs"].data for d in datums]
            metrics.update(sample_train_kl(sampler_lps, trainer_lps, masks))
            metrics["optim/loss"] = out.metrics.get("loss:sum", 0.0)
            metrics.update({f"optim/{k}": v for k, v in (opt_out.metrics or {}).items()})
        else:  # no signal in this batch: the weights stay as they are
            self.samplers.by_step[step + 1] = self.samplers.by_step[step]
        metrics["time/train"] = time.perf_counter() - t1
        metrics["tokens/train_per_s"] = metrics["tokens/train"] / metrics["time/train"] if metrics["time/train"] > 0 else 0.0
        return metrics

    async def with_kl_penalty(self, pairs: list[tuple[Datum, list[float]]]) -> list[tuple[Datum, list[float]]]:
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

    async def checkpoint(self, step: int, pipe: RolloutPipeline, final: bool) -> CheckpointRecord:
        extra: dict[str, Any] = {}
        in_flight = await pipe.in_flight()
        if in_flight:
            name = f"pending-{step:06d}.json"
            (self.path / name).write_text(json.dumps({s: [g.to_dict() for g in gs] for s, gs in in_flight.items()}))
            extra["pending_file"] = name
        name = f"{'final' if final else 'step'}-{step:06d}"
        return await save_checkpoint(self.tc, self.path, name, step, kind="both" if final else "state", final=final, extra=extra)


def _test(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("test/")}
