"""Chat SFT: train on the assistant tokens of conversations, with a held-out NLL evaluator and
submit-ahead pipelining (step k+1 is queued before step k's results are read).

Data: a JSONL file of ``{"messages": [...]}`` (default: examples/data/chat_sft.jsonl), or a Hugging
Face dataset with a ``messages`` column when online (``dataset=HuggingFaceH4/no_robots``). The last
10% is held out for ``test/nll``.

    python examples/sft_chat.py                                       # mock://, seconds
    python examples/sft_chat.py url=local:// base_model=smollm2 num_epochs=3 run_dir=runs/sft
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Literal

import anyio
from pydantic import ConfigDict, Field

from asyncsess import AdamParams, ServiceClient
from asyncsess.errors import InvalidInputError
from asyncsess.runs.checkpoints import (
    CheckpointRecord,
    RecoveryConfig,
    open_run_dir,
    parse_overrides,
    reopen_training_client,
    run_recovering,
    save_checkpoint,
)
from asyncsess.runs.metrics import MetricsLogger
from asyncsess.supervised.sft import SubmitAhead, conversation_datum, learning_rate, mean_nll, nll
from asyncsess.types import MAX_LEARNING_RATE

DATA = Path(__file__).parent / "data" / "chat_sft.jsonl"


class SFTConfig(RecoveryConfig):
    """Settings of a supervised run; a lost session is recovered from the last checkpoint (RecoveryConfig)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    data: str = str(DATA)
    dataset: str | None = None
    lora_rank: int = Field(default=32, ge=1)
    learning_rate: float = Field(default=1e-4, ge=0.0, le=MAX_LEARNING_RATE)
    lr_schedule: Literal["linear", "cosine", "constant"] = "linear"
    batch_size: int = Field(default=8, ge=1)
    num_epochs: int = Field(default=1, ge=1)
    max_steps: int | None = Field(default=None, ge=0)
    submit_ahead: int = Field(default=1, ge=0)
    eval_every: int = Field(default=5, ge=0)
    save_every: int = Field(default=0, ge=0)
    max_length: int = Field(default=512, ge=2)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)


def load_conversations(cfg: SFTConfig) -> list[list[dict[str, str]]]:
    if cfg.dataset:
        import datasets  # type: ignore[import-not-found]

        return [list(row["messages"]) for row in datasets.load_dataset(cfg.dataset, split="train")]
    return [json.loads(line)["messages"] for line in Path(cfg.data).read_text().splitlines() if line.strip()]


def batches(n: int, cfg: SFTConfig) -> list[list[int]]:
    """Datum indices of every step: ``num_epochs`` seeded shuffles cut into ``batch_size`` pieces
    (the learning-rate schedule spans all of them; ``max_steps`` only stops early)."""
    out = []
    for epoch in range(cfg.num_epochs):
        order = list(range(n))
        random.Random(cfg.seed * 1_000 + epoch).shuffle(order)
        out += [order[i : i + cfg.batch_size] for i in range(0, n - cfg.batch_size + 1, cfg.batch_size)]
    return out


async def main(args: list[str]) -> dict[str, Any]:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/sft_chat")
    cfg = SFTConfig.model_validate(opts)

    async def attempt(mode: Literal["resume", "overwrite", "raise"], recovered: dict[str, float]) -> dict[str, Any]:
        with open_run_dir(run_dir, cfg, mode) as (path, record):  # held while it runs: a second run on it is refused
            return await train(path, record, recovered)

    async def train(path: Path, record: CheckpointRecord | None, recovered: dict[str, float]) -> dict[str, Any]:
        start = record.step if record else 0
        async with ServiceClient(cfg.url) as svc:
            if record is not None:
                tc = await reopen_training_client(svc, record)
            else:
                tc = await svc.create_lora_training_client(cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed)
            tok = tc.get_tokenizer()
            convs = load_conversations(cfg)
            cut = len(convs) - max(1, len(convs) // 10)
            train = [conversation_datum(tok, m, max_length=cfg.max_length) for m in convs[:cut]]
            test = [conversation_datum(tok, m, max_length=cfg.max_length) for m in convs[cut:]]
            plan = batches(len(train), cfg)
            if not plan:  # a run of 0 steps would look like a finished one
                raise InvalidInputError(
                    f"{len(train)} training conversations (the last 10% held out) are fewer than one batch of {cfg.batch_size}",
                    field="batch_size",
                    fix="lower batch_size or add conversations",
                )
            end = min(len(plan), cfg.max_steps) if cfg.max_steps is not None else len(plan)
            before = await nll(tc, test)
            evals = {start: before}  # step -> test/nll of the weights before that step
            pipe = SubmitAhead(cfg.submit_ahead)
            with MetricsLogger(path, resume_step=start) as log:  # before a first checkpoint: from step 0 again

                def write(done: list) -> None:
                    for s, out, opt in done:
                        metrics = {"train/nll": mean_nll(out, [train[i] for i in plan[s]]), "optim/lr": opt.metrics["learning_rate"]}
                        metrics.update({"optim/grad_norm": opt.metrics.get("grad_norm", 0.0), "progress/done_frac": (s + 1) / end})
                        log.log(s, {**metrics, **({"test/nll": evals.pop(s)} if s in evals else {}), **recovered})
                        recovered.clear()

                for step in range(start, end):
                    lr = learning_rate(cfg.learning_rate, step, len(plan), cfg.lr_schedule)
                    fb = tc.forward_backward([train[i] for i in plan[step]], "cross_entropy")
                    opt = tc.optim_step(AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8))
                    write(await pipe.push(step, fb, opt))
                    if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                        evals[step + 1] = await nll(tc, test)
                    if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
                        write(await pipe.drain())
                        await save_checkpoint(tc, path, f"step-{step + 1:06d}", step + 1)
                write(await pipe.drain())
                final_nll = evals.pop(end, None)
                final_nll = await nll(tc, test) if final_nll is None else final_nll
                log.log(end, {"test/nll": final_nll})
            await save_checkpoint(tc, path, f"final-{end:06d}", end, kind="both", final=True)
        return {"steps": end, "test/nll_before": before, "test/nll_after": final_nll}

    summary = await run_recovering(attempt, "resume", url=cfg.url, run_dir=run_dir, recovery=cfg)
    print(summary)
    return summary


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
