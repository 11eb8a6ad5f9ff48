"""The staleness-bounded rollout pipeline: sampling for the next steps overlaps training.

Batch ``s`` is sampled from the weights after ``max(0, s - k)`` optimizer steps, so while step ``s``
trains, batches ``s+1 … s+k`` are already being sampled, and no group used for training is more than
``k`` steps old. ``k = 0`` is the synchronous on-policy loop. The lag is fixed rather than
free-running (tinker-cookbook's async mode lets each group take whatever sampler is newest), which
keeps a run deterministic for a given seed and therefore resumable bit for bit: the batches still in
flight at a checkpoint are saved with it and replayed on resume.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from ..client import SamplingClient
from .rollouts import Group

__all__ = ["RolloutPipeline", "sampler_step_for"]

# (step, sampler, sampler_step) -> the step's groups
BatchSampler = Callable[[int, SamplingClient, int], Awaitable[list[Group]]]


def sampler_step_for(step: int, max_staleness: int) -> int:
    """Which weights (after how many optimizer steps) batch ``step`` is sampled from."""
    return max(0, step - max_staleness)


@dataclass
class _Batch:
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    groups: list[Group] | None = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class RolloutPipeline:
    """Launches each step's sampling as a task in ``tg`` and hands batches to the trainer in step order."""

    def __init__(self, tg: TaskGroup, sample_batch: BatchSampler, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self._tg = tg
        self._sample_batch = sample_batch
        self._batches: dict[int, _Batch] = {}

    def launched(self, step: int) -> bool:
        return step in self._batches

    def launch(self, step: int, sampler: SamplingClient, sampler_step: int) -> None:
        batch = self._batches[step] = _Batch()
        self._tg.start_soon(self._run, batch, step, sampler, sampler_step)

    def preload(self, step: int, groups: list[Group]) -> None:
        """A batch sampled before a checkpoint, replayed on resume."""
        batch = self._batches[step] = _Batch(finished=time.perf_counter(), groups=groups)
        batch.done.set()

    async def _run(self, batch: _Batch, step: int, sampler: SamplingClient, sampler_step: int) -> None:
        try:
            batch.groups = await self._sample_batch(step, sampler, sampler_step)
        except Exception as err:
            batch.error = err
        finally:
            batch.finished = time.perf_counter()
            batch.done.set()

    async def get(self, step: int) -> tuple[list[Group], float]:
        """Batch ``step`` (waiting for it) and the wall time its sampling took."""
        batch = self._batches.pop(step)
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        assert batch.groups is not None and batch.finished is not None
        return batch.groups, batch.finished - batch.started

    async def in_flight(self) -> dict[int, list[Group]]:
        """Wait for every launched batch and return them (to save with a checkpoint); they stay queued."""
        out = {}
        for step in sorted(self._batches):
            batch = self._batches[step]
            await batch.done.wait()
            if batch.error is not None:
                raise batch.error
            assert batch.groups is not None
            out[step] = batch.groups
        return out
