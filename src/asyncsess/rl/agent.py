"""RL for any OpenAI-speaking agent: ``async def agent(client: openai.AsyncOpenAI, task) -> reward``.

Each rollout gets its own ``openai.AsyncOpenAI`` whose calls go in-process to an
:class:`~asyncsess.serve.openai_front.OpenAIFront` bound to the sampler (weight version) the loop chose for
that group, tagged with the rollout's id. When the agent returns its reward, the calls it made are merged into
a trajectory (:func:`asyncsess.rl.capture.build_trajectory`: only sampled tokens trained, re-tokenization drift
split and counted), ``group_size`` rollouts of one task form a group with centred advantages, and the datums
are trained by the one RL loop (:func:`asyncsess.rl.train.train_rl`, through its ``play_group`` hook): staleness bound,
``metrics.jsonl`` (plus ``env/all/calls`` and ``env/all/drift`` per episode), checkpoints and resume.

Every finished rollout is appended to ``trajectories.jsonl`` in the run directory (calls, merged segments
with masks and log-probs, drift, reward) for offline SFT / DPO; read it with
:func:`asyncsess.rl.capture.read_trajectories`. The loop's ``temperature`` (0 for the held-out evaluation)
replaces what the agent asks for, so the sampled tokens follow the policy the loop trains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
from pydantic import Field

from ..backends.base import Tokenizer
from ..client import SamplingClient
from ..errors import InvalidInputError
from .capture import AgentTrajectory, build_trajectory, trajectories_file
from .grading import AGENT_TIMEOUTS, MAX_GRADER_TIMEOUT_S
from .problem_env import ProblemDataset
from .train import LearningRate, LoraAlpha, LoraRank, MaxTokens, RLConfig, RLResult, Steps, train_rl
from .types import Env, EnvGroupBuilder, RLDataset, TrajectoryGroup, check_reward

__all__ = ["Agent", "AgentRLConfig", "AgentGroupBuilder", "train_agent_rl"]

# (an openai.AsyncOpenAI for this rollout, the task) -> reward
Agent = Callable[[Any, Any], Awaitable[float]]
AGENT_TIMEOUT_S = 600.0  # a rollout's default time limit: long tool-using episodes, yet a hung agent ends
log = logging.getLogger("asyncsess.rl")


class AgentRLConfig(RLConfig):
    """RL settings (defaults for long agent turns), plus the model name the agent's requests use and the front's ``n`` bound."""

    lora_rank: LoraRank = 32
    lora_alpha: LoraAlpha = 64.0
    learning_rate: LearningRate = 4e-5
    max_tokens: MaxTokens = 512
    loss_fn: str = "cispo"
    max_steps: Steps = 50
    model_name: str = Field(default="policy", min_length=1, max_length=256)
    max_n: int = Field(default=64, ge=1, le=1000)
    # seconds one rollout (the agent's call) may take; past it the agent is cancelled, the rollout scores 0 and counts in
    # env/all/agent_timeouts. None: no limit. An agent that blocks the event loop (time.sleep) cannot be cancelled.
    agent_timeout_s: float | None = Field(default=AGENT_TIMEOUT_S, gt=0.0, le=MAX_GRADER_TIMEOUT_S, allow_inf_nan=False)


class AgentGroupBuilder(EnvGroupBuilder):
    """``group_size`` rollouts of one task; played by the agent loop, not as envs."""

    def __init__(self, task: Any, group_size: int) -> None:
        self.task, self.group_size = task, group_size

    async def make_envs(self) -> Sequence[Env]:
        raise TypeError("agent groups are played by train_agent_rl, not as Envs")


class _AgentRunner:
    def __init__(self, cfg: AgentRLConfig, agent: Agent, path: Path) -> None:
        from ..serve.openai_front import OpenAIFront  # needs the serve extra (FastAPI)

        self.cfg, self.agent = cfg, agent
        self.front = OpenAIFront(model_name=cfg.model_name, max_n=cfg.max_n, max_tokens=cfg.max_tokens, context_window=cfg.context_window)
        self.jsonl = trajectories_file(path / "trajectories.jsonl")
        self.warned = False  # about an agent past its time limit, once per run

    async def rollout(
        self, task: Any, sampler: SamplingClient, temperature: float, version: int, index: int = 0
    ) -> tuple[AgentTrajectory, bool]:
        """The rollout's trajectory, and whether the agent ran out of time (then it scores 0 with the calls it made)."""
        rid = f"rollout-{uuid.uuid4().hex}"
        # a seed from the run, the weights, the task and the rollout's place in its group: the same tokens
        # whatever order the group's concurrent calls reach the sampler in
        key = f"{self.cfg.seed}:{version}:{_jsonable(task)!r}:{index}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 2
        self.front.bind(rid, sampler, version, temperature, seed=seed)
        try:
            name = f"the agent {getattr(self.agent, '__qualname__', 'agent')}"
            reward = 0.0
            async with self.front.openai_client(rid) as client:
                with anyio.move_on_after(self.cfg.agent_timeout_s) as limit:
                    reward, _ = check_reward(await self.agent(client, task), {}, name)
            if limit.cancelled_caught and not self.warned:
                self.warned = True
                log.warning(
                    "%s did not return within %g s: such rollouts score 0 and count in env/all/%s (raise agent_timeout_s "
                    "if it needs longer)",
                    name,
                    self.cfg.agent_timeout_s,
                    AGENT_TIMEOUTS,
                )
        finally:
            self.front.unbind(rid)
            calls = self.front.captures.pop(rid)
        return build_trajectory(rid, calls, reward), limit.cancelled_caught

    async def play(self, builder: EnvGroupBuilder, sampler: SamplingClient, temperature: float, version: int) -> TrajectoryGroup:
        if not isinstance(builder, AgentGroupBuilder):
            raise TypeError(f"expected an AgentGroupBuilder, got {type(builder).__name__}")
        done: list[tuple[AgentTrajectory, bool] | None] = [None] * builder.group_size
        errors: list[Exception] = []

        async def one(i: int) -> None:
            try:
                done[i] = await self.rollout(builder.task, sampler, temperature, version, i)
            except Exception as err:  # raised below as itself, not inside an ExceptionGroup
                errors.append(err)

        async with anyio.create_task_group() as tg:
            for i in range(builder.group_size):
                tg.start_soon(one, i)
        if errors:
            raise errors[0]
        played = [t for t in done if t is not None]
        with open(self.jsonl, "a", encoding="utf-8") as f:
            for t, late in played:
                line = {**t.record(), "temperature": temperature, "task": _jsonable(builder.task), **({"timed_out": True} if late else {})}
                f.write(json.dumps(line) + "\n")
        metrics = [{AGENT_TIMEOUTS: 1.0} if late else {} for _, late in played]
        return TrajectoryGroup([t.trajectory() for t, _ in played], [0.0] * len(played), metrics, version)


def _jsonable(task: Any) -> Any:
    try:
        json.dumps(task)
        return task
    except TypeError:
        return repr(task)


async def train_agent_rl(
    config: AgentRLConfig,
    agent: Agent,
    tasks: Sequence[Any],
    test_tasks: Sequence[Any],
    run_dir: str | Path,
    *,
    if_exists: Literal["resume", "overwrite", "raise"] = "resume",
    progress: bool = True,
) -> RLResult:
    """GRPO on ``agent``: ``groups_per_batch`` tasks per step, ``group_size`` rollouts each; ``test_tasks`` are
    played once each, greedily, before the first step, every ``eval_every`` steps and after the last."""
    if not tasks:
        raise InvalidInputError("no tasks", field="tasks", fix="pass at least one training task")
    runner: list[_AgentRunner] = []

    def make_datasets(tokenizer: Tokenizer) -> tuple[RLDataset, Sequence[EnvGroupBuilder]]:
        data = ProblemDataset(tasks, config.groups_per_batch, lambda t: AgentGroupBuilder(t, config.group_size), config.seed)
        return data, [AgentGroupBuilder(t, 1) for t in test_tasks]

    async def play(builder: EnvGroupBuilder, sampler: SamplingClient, temperature: float, version: int) -> TrajectoryGroup:
        if not runner:
            runner.append(_AgentRunner(config, agent, Path(run_dir)))
        return await runner[0].play(builder, sampler, temperature, version)

    return await train_rl(config, make_datasets, run_dir, play_group=play, if_exists=if_exists, progress=progress)
