"""DPO on chosen/rejected pairs, through ``forward_backward_custom`` (spec/losses.md §4.3).

The reference is the session's own weights at step 0 (``save_weights_and_get_sampling_client``);
its log-probs come from ``compute_logprobs``. The loss is lowered to ``cross_entropy`` by the client,
so it runs on every backend (needs torch on the client). Held-out pairs give ``test/accuracy``
(how often the policy prefers the chosen answer more than the reference does).

    python examples/dpo.py                                  # mock://, seconds
    python examples/dpo.py url=local:// base_model=smollm2 learning_rate=1e-5 num_epochs=3
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
from asyncsess.supervised.preference import completion_datum, dpo_loss, policy_sums, reference_sums

DATA = Path(__file__).parent / "data" / "preferences.jsonl"


class DPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    data: str = str(DATA)
    lora_rank: int = 32
    learning_rate: float = 1e-5
    beta: float = 0.1
    pairs_per_batch: int = 4
    num_epochs: int = 1
    seed: int = 0


def accuracy(policy: list[float], ref: list[float], tie: float = 1e-3) -> float:
    """Fraction of pairs whose implicit reward margin ``(p_c - ref_c) - (p_r - ref_r)`` is positive;
    a margin within ``tie`` of 0 (float noise between the two passes) counts half."""
    margins = [(policy[i] - ref[i]) - (policy[i + 1] - ref[i + 1]) for i in range(0, len(policy), 2)]
    return sum(1.0 if m > tie else 0.5 if m >= -tie else 0.0 for m in margins) / max(1, len(margins))


async def main(args: list[str]) -> dict[str, Any]:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/dpo")
    cfg = DPOConfig.model_validate(opts)
    path, _ = prepare_run_dir(run_dir, cfg, if_exists="overwrite")
    rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines() if line.strip()]
    async with ServiceClient(cfg.url) as svc:
        tc = await svc.create_lora_training_client(cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed)
        tok = tc.get_tokenizer()
        data = [completion_datum(tok, r["prompt"], r[key]) for r in rows for key in ("chosen", "rejected")]
        reference = await tc.save_weights_and_get_sampling_client()
        ref = await reference_sums(reference, data)
        cut = 2 * (len(rows) - max(1, len(rows) // 4))  # hold out the last quarter of the pairs
        test, test_ref = data[cut:], ref[cut:]
        width = 2 * cfg.pairs_per_batch
        steps = [(e, i) for e in range(cfg.num_epochs) for i in range(0, cut - width + 1, width)]
        with MetricsLogger(path) as log:
            before = accuracy(await policy_sums(tc, test), test_ref)
            for step, (_, i) in enumerate(steps):
                fb = tc.forward_backward_custom(data[i : i + width], dpo_loss(ref[i : i + width], cfg.beta))
                opt = tc.optim_step(AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8))
                out = await fb
                await opt
                names = ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward")
                log.log(step, {**{k: out.metrics[k] for k in names}, **({"test/accuracy": before} if step == 0 else {})})
            after = accuracy(await policy_sums(tc, test), test_ref)
            log.log(len(steps), {"test/accuracy": after})
        await save_checkpoint(tc, path, "final", len(steps), kind="both", final=True)
    summary = {"steps": len(steps), "test/accuracy_before": before, "test/accuracy_after": after}
    print(summary)
    return summary


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
