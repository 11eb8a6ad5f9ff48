"""Preference training: DPO on chosen/rejected pairs and KTO on binary feedback, as custom losses for
``forward_backward_custom``, the datum and reference-log-prob helpers, and one loop for both
(:func:`train_preference`, which examples/dpo.py and examples/kto.py run).

The reference is the session's own weights at step 0; its log-probs come from ``compute_logprobs``. The
loss functions run on torch tensors handed over by the client; torch is imported only when they are
called, so importing this module stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..chat import Message
from ..client import SamplingClient, TrainingClient
from ..custom_loss import CustomLossFn
from ..errors import InvalidInputError
from ..rl.data import datum_tokens
from ..runs.checkpoints import open_run_dir, read_run_config, save_checkpoint
from ..runs.metrics import MetricsLogger
from ..tasks.rows import RowError, load_rows, need
from ..types import MAX_LEARNING_RATE, AdamParams, Datum
from .sft import conversation_datum

__all__ = [
    "completion_datum",
    "reference_sums",
    "policy_sums",
    "dpo_loss",
    "kto_loss",
    "preference_accuracy",
    "PreferenceConfig",
    "train_preference",
]


def completion_datum(tokenizer: Any, prompt: Sequence[Message], completion: str, max_length: int | None = None) -> Datum:
    """``prompt`` followed by the assistant ``completion``; weight 1 on the completion's tokens."""
    messages = [*prompt, {"role": "assistant", "content": completion}]
    return conversation_datum(tokenizer, messages, train_on="last_assistant_message", max_length=max_length)


async def reference_sums(reference: SamplingClient, data: Sequence[Datum]) -> list[float]:
    """Σ over each datum's weighted tokens of the reference model's log-prob (via ``compute_logprobs``)."""
    futures = [reference.compute_logprobs(datum_tokens(d)) for d in data]
    out = []
    for d, fut in zip(data, futures):
        lps = (await fut)[1:]
        out.append(sum(w * float(lp or 0.0) for w, lp in zip(d.loss_fn_inputs["weights"].data, lps)))
    return out


async def policy_sums(tc: TrainingClient, data: Sequence[Datum]) -> list[float]:
    """The same sums under the training session's current weights (a ``forward`` pass, no gradients)."""
    out = await tc.forward(list(data), "cross_entropy")
    return [sum(w * lp for w, lp in zip(d.loss_fn_inputs["weights"].data, o["logprobs"].data)) for d, o in zip(data, out.loss_fn_outputs)]


def _sums(data: Sequence[Datum], logprobs: Sequence[Any]) -> Any:
    import torch

    return torch.stack([(lp * torch.tensor(d.loss_fn_inputs["weights"].data, dtype=lp.dtype)).sum() for d, lp in zip(data, logprobs)])


def dpo_loss(ref: Sequence[float], beta: float = 0.1) -> CustomLossFn:
    """DPO over data ordered ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]`` with reference sums ``ref``
    in the same order: mean over pairs of ``-log σ(β·((p_c - ref_c) - (p_r - ref_r)))``."""

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch
        import torch.nn.functional as F

        if len(data) % 2 or len(data) != len(ref):
            raise ValueError("DPO needs chosen/rejected pairs and one reference sum per datum")
        delta = _sums(data, logprobs) - torch.tensor(list(ref), dtype=torch.float32)
        chosen, rejected = beta * delta[0::2], beta * delta[1::2]
        z = chosen - rejected
        loss = -F.logsigmoid(z).mean()
        return loss, {
            "dpo_loss": float(loss.detach()),
            "accuracy": float((z > 0).float().mean()),
            "margin": float(z.detach().mean()),
            "chosen_reward": float(chosen.detach().mean()),
            "rejected_reward": float(rejected.detach().mean()),
        }

    return loss_fn


def kto_loss(
    ref: Sequence[float], desirable: Sequence[bool], beta: float = 0.1, lambda_d: float = 1.0, lambda_u: float = 1.0
) -> CustomLossFn:
    """KTO (arXiv 2402.01306) on single completions labelled desirable or not: with ``r = Σ(p - ref)``
    and the reference point ``z0 = max(0, mean r)`` over the batch (detached; our estimator of the
    policy-reference KL), desirable examples cost ``λ_D·(1 - σ(β(r - z0)))`` and undesirable ones
    ``λ_U·(1 - σ(β(z0 - r)))``; the loss is their mean."""

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        if not (len(data) == len(ref) == len(desirable)):
            raise ValueError("KTO needs one reference sum and one label per datum")
        r = _sums(data, logprobs) - torch.tensor(list(ref), dtype=torch.float32)
        z0 = r.detach().mean().clamp(min=0.0)
        good = torch.tensor([bool(x) for x in desirable])
        per = torch.where(good, lambda_d * (1 - torch.sigmoid(beta * (r - z0))), lambda_u * (1 - torch.sigmoid(beta * (z0 - r))))
        loss = per.mean()
        rd = r.detach()
        return loss, {
            "kto_loss": float(loss.detach()),
            "kl_ref_point": float(z0),
            "reward_desirable": float((beta * rd[good]).mean()) if good.any() else 0.0,
            "reward_undesirable": float((beta * rd[~good]).mean()) if (~good).any() else 0.0,
        }

    return loss_fn


def preference_accuracy(
    method: Literal["dpo", "kto"], policy: Sequence[float], ref: Sequence[float], labels: Sequence[bool], tie: float = 1e-3
) -> float:
    """Held-out accuracy of the implicit reward ``p - ref``. DPO: the share of pairs whose margin
    ``(p_c - ref_c) - (p_r - ref_r)`` is positive; KTO: the share of examples whose reward has the label's
    sign. A value within ``tie`` of 0 (float noise between the two passes) counts half."""
    if method == "dpo":
        values = [(policy[i] - ref[i]) - (policy[i + 1] - ref[i + 1]) for i in range(0, len(policy), 2)]
        signs = [True] * len(values)
    else:
        values, signs = [p - r for p, r in zip(policy, ref)], list(labels)
    scores = [0.5 if abs(v) <= tie else float((v > 0) == good) for v, good in zip(values, signs)]
    return sum(scores) / max(1, len(scores))


class PreferenceConfig(BaseModel):
    """One preference run. ``data`` is JSONL: DPO rows ``{"prompt", "chosen", "rejected"}``, KTO rows
    ``{"prompt", "completion", "label"}``; the last quarter (of pairs, for DPO) is held out."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: Literal["dpo", "kto"]
    data: str
    url: str = "mock://"
    base_model: str = "mock/bigram-tiny"
    lora_rank: int = Field(32, ge=1)
    learning_rate: float = Field(1e-5, gt=0, le=MAX_LEARNING_RATE)
    adam: AdamParams = AdamParams(beta1=0.9, beta2=0.95, eps=1e-8)  # learning_rate above overrides adam's
    beta: float = Field(0.1, gt=0)
    batch_size: int = Field(8, ge=1, description="datums per step (a DPO pair is two)")
    lambda_desirable: float = Field(1.0, ge=0)  # KTO only
    lambda_undesirable: float = Field(1.0, ge=0)  # KTO only
    num_epochs: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, le=2**32 - 1)

    @model_validator(mode="after")
    def _pairs_stay_whole(self) -> PreferenceConfig:
        if self.method == "dpo" and self.batch_size % 2:
            raise ValueError(f"batch_size={self.batch_size}: DPO batches hold whole chosen/rejected pairs; use an even number")
        return self


_METRICS = {
    "dpo": ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward"),
    "kto": ("kto_loss", "kl_ref_point", "reward_desirable", "reward_undesirable"),
}


# per method, each key of a row: its type and how a message says it
_KEYS: dict[str, dict[str, tuple[type, str]]] = {
    "dpo": {"prompt": (list, "a list of chat messages"), "chosen": (str, "a string"), "rejected": (str, "a string")},
    "kto": {"prompt": (list, "a list of chat messages"), "completion": (str, "a string"), "label": (bool, "true or false")},
}


def _rows(cfg: PreferenceConfig) -> list[dict[str, Any]]:
    """The rows of ``cfg.data``, each checked (:func:`asyncsess.tasks.rows.load_rows`: JSON, the method's keys and
    their types), and enough of them for one training batch after the held-out quarter; an InvalidInputError naming
    ``data`` (file:line, ``data.<key>``) or ``batch_size``."""
    keys = _KEYS[cfg.method]

    def parse(row: dict[str, Any], index: int) -> dict[str, Any]:
        for key, (kind, what) in keys.items():
            value = need(row, key, kind, what)
            if kind is list and not all(isinstance(m, dict) for m in value):
                raise RowError(key, f"{key} is {value!r:.60}, not {what}")
        return row

    example = "{" + ", ".join(f'"{k}": ...' for k in keys) + "} per line"
    rows = load_rows(cfg.data, parse, f"use a JSONL file of {example}", name="data")
    per_row = 2 if cfg.method == "dpo" else 1  # datums
    train = (len(rows) - max(1, len(rows) // 4)) * per_row
    if train < cfg.batch_size:
        raise InvalidInputError(
            f"{cfg.data} holds {len(rows)} rows: {max(train, 0)} training datums once the last quarter is held out, "
            f"fewer than one batch of {cfg.batch_size} (the run would train nothing)",
            field="batch_size",
            fix="lower batch_size or add rows",
        )
    return rows


def _examples(cfg: PreferenceConfig, rows: list[dict[str, Any]], tokenizer: Any) -> tuple[list[Datum], list[bool], int]:
    """The datums, their labels, and where the held-out part starts."""
    held_out = max(1, len(rows) // 4)
    if cfg.method == "dpo":
        data = [completion_datum(tokenizer, r["prompt"], r[key]) for r in rows for key in ("chosen", "rejected")]
        return data, [True, False] * len(rows), 2 * (len(rows) - held_out)
    data = [completion_datum(tokenizer, r["prompt"], r["completion"]) for r in rows]
    return data, [bool(r["label"]) for r in rows], len(rows) - held_out


def _loss(cfg: PreferenceConfig, ref: Sequence[float], labels: Sequence[bool]) -> CustomLossFn:
    if cfg.method == "dpo":
        return dpo_loss(ref, cfg.beta)
    return kto_loss(ref, labels, cfg.beta, cfg.lambda_desirable, cfg.lambda_undesirable)


async def train_preference(cfg: PreferenceConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train with DPO or KTO, log ``metrics.jsonl`` (the loss's metrics, ``test/accuracy`` before and after)
    and save a final checkpoint in ``run_dir``; return the summary. ``run_dir`` is emptied first (a preference run
    does not resume); the data is checked before that, and a directory of another recipe's run is refused."""
    rows = _rows(cfg)  # before the run directory is emptied
    if Path(run_dir).is_dir() and (old := read_run_config(Path(run_dir))) is not None and old.get("method") not in _KEYS:
        raise InvalidInputError(
            f"{run_dir} holds a run of another recipe (its config.json names no DPO/KTO method); a preference run empties its directory",
            field="run_dir",
            fix="pick a new run directory (or delete that run yourself)",
        )
    with open_run_dir(run_dir, cfg, if_exists="overwrite") as (path, _):
        return await _train_preference(cfg, rows, path)


async def _train_preference(cfg: PreferenceConfig, rows: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    from ..client import ServiceClient

    adam = cfg.adam.model_copy(update={"learning_rate": cfg.learning_rate})
    async with ServiceClient(cfg.url) as svc:
        tc = await svc.create_lora_training_client(cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed)
        data, labels, cut = _examples(cfg, rows, tc.get_tokenizer())
        ref = await reference_sums(await tc.save_weights_and_get_sampling_client(), data)
        starts = [i for _ in range(cfg.num_epochs) for i in range(0, cut - cfg.batch_size + 1, cfg.batch_size)]
        with MetricsLogger(path) as log:
            before = preference_accuracy(cfg.method, await policy_sums(tc, data[cut:]), ref[cut:], labels[cut:])
            for step, i in enumerate(starts):
                j = i + cfg.batch_size
                fb = tc.forward_backward_custom(data[i:j], _loss(cfg, ref[i:j], labels[i:j]))
                opt = tc.optim_step(adam)
                out = await fb
                await opt
                log.log(step, {**{k: out.metrics[k] for k in _METRICS[cfg.method]}, **({"test/accuracy": before} if step == 0 else {})})
            after = preference_accuracy(cfg.method, await policy_sums(tc, data[cut:]), ref[cut:], labels[cut:])
            log.log(len(starts), {"test/accuracy": after})
        await save_checkpoint(tc, path, "final", len(starts), kind="both", final=True)
    return {"steps": len(starts), "test/accuracy_before": before, "test/accuracy_after": after}
