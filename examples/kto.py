"""KTO on binary feedback (each completion labelled desirable or not), through ``forward_backward_custom``.

Loss and reference point as in :func:`asyncsess.supervised.preference.kto_loss`; the reference is the session's
weights at step 0. Held-out examples give ``test/accuracy``: how often the implicit reward
``Σ(p - ref)`` is positive for desirable and negative for undesirable completions.

    python examples/kto.py                                  # mock://, seconds
    python examples/kto.py url=local:// base_model=smollm2 learning_rate=1e-5 num_epochs=3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict

from asyncsess import AdamParams, ServiceClient
from asyncsess.runs.checkpoints import parse_overrides, prepare_run_dir, save_checkpoint
from asyncsess.runs.metrics import MetricsLogger
from asyncsess.supervised.preference import completion_datum, kto_loss, policy_sums, reference_sums

DATA = Path(__file__).parent / "data" / "feedback.jsonl"


class KTOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    data: str = str(DATA)
    lora_rank: int = 32
    learning_rate: float = 1e-5
    beta: float = 0.1
    lambda_desirable: float = 1.0
    lambda_undesirable: float = 1.0
    batch_size: int = 8
    num_epochs: int = 1
    seed: int = 0


def accuracy(policy: list[float], ref: list[float], labels: list[bool], tie: float = 1e-3) -> float:
    """Fraction of examples whose implicit reward ``p - ref`` has the label's sign; within ``tie`` of 0 counts half."""
    signs = [0.5 if abs(p - r) <= tie else float((p - r > 0) == good) for p, r, good in zip(policy, ref, labels)]
    return sum(signs) / max(1, len(signs))


async def main(args: list[str]) -> dict[str, Any]:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/kto")
    cfg = KTOConfig.model_validate(opts)
    path, _ = prepare_run_dir(run_dir, cfg, if_exists="overwrite")
    rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines() if line.strip()]
    async with ServiceClient(cfg.url) as svc:
        tc = await svc.create_lora_training_client(cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed)
        tok = tc.get_tokenizer()
        data = [completion_datum(tok, r["prompt"], r["completion"]) for r in rows]
        labels = [bool(r["label"]) for r in rows]
        reference = await tc.save_weights_and_get_sampling_client()
        ref = await reference_sums(reference, data)
        cut = len(rows) - max(1, len(rows) // 4)
        steps = [i for _ in range(cfg.num_epochs) for i in range(0, cut - cfg.batch_size + 1, cfg.batch_size)]
        with MetricsLogger(path) as log:
            before = accuracy(await policy_sums(tc, data[cut:]), ref[cut:], labels[cut:])
            for step, i in enumerate(steps):
                j = i + cfg.batch_size
                loss = kto_loss(ref[i:j], labels[i:j], cfg.beta, cfg.lambda_desirable, cfg.lambda_undesirable)
                fb = tc.forward_backward_custom(data[i:j], loss)
                opt = tc.optim_step(AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8))
                out = await fb
                await opt
                names = ("kto_loss", "kl_ref_point", "reward_desirable", "reward_undesirable")
                log.log(step, {**{k: out.metrics[k] for k in names}, **({"test/accuracy": before} if step == 0 else {})})
            after = accuracy(await policy_sums(tc, data[cut:]), ref[cut:], labels[cut:])
            log.log(len(steps), {"test/accuracy": after})
        await save_checkpoint(tc, path, "final", len(steps), kind="both", final=True)
    summary = {"steps": len(steps), "test/accuracy_before": before, "test/accuracy_after": after}
    print(summary)
    return summary


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
