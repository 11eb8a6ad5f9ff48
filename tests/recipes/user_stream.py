"""A user's own stateful RL dataset, written the way a user would: problems read from an endless source
through a shuffle buffer with its own ``random.Random``; its state is the read cursor, the buffer, the number
of batches served and the generator's state (as JSON lists). Each drawn batch is appended to ``log``
(``{"batch": n, "problems": [...]}``) so a test can see the data order. Also a script entry point
(:func:`main`) for the kill-and-resume test."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from asyncsess.rl import Problem, ProblemGroupBuilder, PromptRenderer, RLConfig, RLResult, train_rl

from .helpers import digit_share

PROBLEMS = [Problem(f"Code {i}:", "0") for i in range(12)]
BASE = RLConfig(url="mock://", groups_per_batch=4, group_size=4, max_tokens=8, learning_rate=0.3, lora_rank=4, seed=5)


class ShuffleBufferStream:
    def __init__(self, source: list[Problem], batch_size: int, make_builder, seed: int, log: Path, buffer: int = 5) -> None:
        self.source, self.batch_size, self.make_builder, self.log, self.size = source, batch_size, make_builder, log, buffer
        self.read = 0  # the next record of the source (it wraps around: a new epoch of the file)
        self.buffer: list[int] = []
        self.served = 0
        self.rng = random.Random(seed)

    def _next(self) -> Problem:
        while len(self.buffer) < self.size:
            self.buffer.append(self.read)
            self.read += 1
        return self.source[self.buffer.pop(self.rng.randrange(len(self.buffer))) % len(self.source)]

    def next_batch(self) -> list[ProblemGroupBuilder]:
        problems = [self._next() for _ in range(self.batch_size)]
        with self.log.open("a") as f:
            f.write(json.dumps({"batch": self.served, "problems": [p.question for p in problems]}) + "\n")
        self.served += 1
        stall_after = os.environ.get("STALL_AFTER_CHECKPOINT")  # the kill test freezes the run here, to kill it
        if stall_after is not None and _checkpointed(self.log.parent, int(stall_after)):
            (self.log.parent / "stalled").write_text("")
            time.sleep(600)
        return [self.make_builder(p) for p in problems]

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"read": self.read, "buffer": list(self.buffer), "served": self.served, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.read, self.buffer, self.served = state["read"], list(state["buffer"]), state["served"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def _checkpointed(run_dir: Path, step: int) -> bool:
    path = run_dir / "checkpoints.jsonl"
    return path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line.strip())


def stream_datasets(cfg: RLConfig, log: Path, test: list[Problem] = PROBLEMS[:4]):
    def make(tokenizer):
        renderer = PromptRenderer(tokenizer)

        def build(p: Problem, size: int = cfg.group_size) -> ProblemGroupBuilder:
            return ProblemGroupBuilder(renderer, p, digit_share, size)

        return ShuffleBufferStream(PROBLEMS, cfg.groups_per_batch, build, cfg.seed, log), [build(p, 1) for p in test]

    return make


def drawn(log: Path) -> dict[int, list[str]]:
    """Batch number -> its problems, from the draw log; a batch drawn again (after a resume) must be the same."""
    out: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        row = json.loads(line)
        assert out.setdefault(row["batch"], row["problems"]) == row["problems"], f"batch {row['batch']} drawn differently"
    return out


async def run(cfg: RLConfig, run_dir: Path, **kwargs: Any) -> RLResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    return await train_rl(cfg, stream_datasets(cfg, run_dir / "draws.jsonl"), run_dir, progress=False, **kwargs)


def main(config_json: str, run_dir: str) -> None:
    """``python -c 'from tests.recipes.user_stream import main; main(CONFIG_JSON, RUN_DIR)'``: train (or resume)."""
    backend = os.environ.get("ASYNCSESS_ANYIO_BACKEND", "asyncio")
    result = anyio.run(run, RLConfig.model_validate_json(config_json), Path(run_dir), backend=backend)
    sys.stdout.write(result.final_checkpoint.model_dump_json() + "\n")
