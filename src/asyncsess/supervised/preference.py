"""Preference losses as custom losses for ``forward_backward_custom`` (spec/losses.md §4.3): DPO on
chosen/rejected pairs and KTO on binary feedback, plus the datum and reference-log-prob helpers.

The loss functions run on torch tensors handed over by the client; torch is imported only when
they are called, so importing this module stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..chat import Message
from ..client import SamplingClient, TrainingClient
from ..custom_loss import CustomLossFn
from ..rl.data import datum_tokens
from ..types import Datum
from .sft import conversation_datum

__all__ = ["completion_datum", "reference_sums", "policy_sums", "dpo_loss", "kto_loss"]


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
