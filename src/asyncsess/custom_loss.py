"""Custom losses lowered to ``cross_entropy`` with ``weights = -dL/dlogp`` (docs/losses.md, "Custom losses").

Any backend with real-valued, sum-reduced cross-entropy therefore supports any differentiable loss
of the per-token log-probs, including losses that couple datums (DPO, KTO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import InvalidInputError
from .types import Datum, ForwardBackwardOutput, TensorData

__all__ = ["CustomLossFn", "ce_view", "linearize", "with_weights"]

# (data, per-datum torch log-prob tensors) -> (scalar loss tensor, metrics)
CustomLossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]


def ce_view(data: Sequence[Datum]) -> tuple[Datum, ...]:
    """The datums as ``cross_entropy`` sees them: ``target_tokens`` and ``weights`` (zeros if absent)."""
    out = []
    for d in data:
        inputs = d.loss_fn_inputs
        target = inputs["target_tokens"]
        zeros = [0.0] * len(target.data)
        weights = inputs.get("weights") or TensorData.model_construct(data=zeros, dtype="float32", shape=target.shape or [len(zeros)])
        out.append(
            Datum.model_construct(model_input=d.model_input, loss_fn_inputs={"target_tokens": inputs["target_tokens"], "weights": weights})
        )
    return tuple(out)


def linearize(
    data: Sequence[Datum], forward: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[float, dict[str, float], list[list[float]]]:
    """Evaluate ``loss_fn`` on leaf tensors of the forward log-probs; return (loss, metrics, -dL/dp per datum)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        raise InvalidInputError(
            "forward_backward_custom needs torch to differentiate the loss", field="loss_fn", fix="pip install torch"
        ) from None
    leaves = [
        torch.tensor(o["logprobs"].data, dtype=torch.float32).reshape(o["logprobs"].shape or [-1]).requires_grad_()
        for o in forward.loss_fn_outputs
    ]  # (N,) log-probs, or (N, K) for K targets per position
    result = loss_fn(list(data), leaves)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InvalidInputError("must return (loss_tensor, metrics_dict)", field="loss_fn")
    loss, metrics = result
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise InvalidInputError("must return a scalar tensor computed from the log-probs", field="loss_fn")
    loss.backward()
    weights = [(-leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).reshape(-1).tolist() for leaf in leaves]
    return float(loss.detach()), {k: float(v) for k, v in (metrics or {}).items()}, weights


def with_weights(data: Sequence[Datum], weights: Sequence[Sequence[float]]) -> tuple[Datum, ...]:
    return tuple(
        Datum.model_construct(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": TensorData.model_construct(
                    data=list(w), dtype="float32", shape=d.loss_fn_inputs["target_tokens"].shape or [len(w)]
                ),
            },
        )
        for d, w in zip(data, weights)
    )
