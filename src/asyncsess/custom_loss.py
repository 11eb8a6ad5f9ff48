"""Custom losses lowered to ``cross_entropy`` with ``weights = -dL/dlogp`` (docs/losses.md, "Custom losses").

Any backend with real-valued, sum-reduced cross-entropy therefore supports any differentiable loss
of the per-token log-probs, including losses that couple datums (DPO, KTO).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import InvalidInputError
from .types import Datum, ForwardBackwardOutput, TensorData
from .validation import MAX_TOKEN_SCALE

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
    copies = [d.model_copy(deep=True) for d in data]  # the loss may mutate them; the backward sends the originals
    try:
        result = loss_fn(copies, leaves)
    except Exception as err:
        raise InvalidInputError(
            f"raised {type(err).__name__}: {err}"[:500], field="loss_fn", fix="fix loss_fn (its exception is this error's __cause__)"
        ) from err
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InvalidInputError(f"returned {type(result).__name__}", field="loss_fn", fix=_FIX)
    loss, metrics = result
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidInputError(f"returned {got} as the loss, not a scalar tensor computed from the log-probs", field="loss_fn", fix=_FIX)
    value = float(loss.detach().float().reshape(()))
    if not math.isfinite(value):
        raise InvalidInputError(f"returned a loss of {value}", field="loss_fn", fix="return a finite loss")
    metrics_out = _metrics(metrics)
    try:
        loss.reshape(()).backward()
    except RuntimeError as err:
        raise InvalidInputError(f"its loss cannot be differentiated: {err}"[:500], field="loss_fn", fix=_FIX) from err
    weights = []
    for leaf in leaves:
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        if not bool(torch.isfinite(grad).all()) or (grad.numel() and float(grad.abs().max()) > MAX_TOKEN_SCALE):
            raise InvalidInputError(
                f"its gradient holds NaN, inf or a value beyond {MAX_TOKEN_SCALE:g} per token",
                field="loss_fn",
                fix="keep the loss's gradient finite and bounded (clamp log-ratios before exp, avoid log(0))",
            )
        weights.append((-grad).reshape(-1).tolist())
    return value, metrics_out, weights


_FIX = "loss_fn(data, logprobs) must return (scalar loss tensor computed from logprobs, dict of str to float)"


def _metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidInputError(f"returned {type(metrics).__name__} as metrics", field="loss_fn", fix=_FIX)
    out = {}
    for k, v in metrics.items():
        try:
            if not isinstance(k, str) or isinstance(v, (str, bytes, bool)):
                raise TypeError
            out[k] = float(v)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidInputError(f"metric {k!r:.40} is {type(v).__name__} {v!r:.40}, not a number", field="loss_fn", fix=_FIX) from None
    return out


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
