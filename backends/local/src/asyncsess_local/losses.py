"""The built-in losses in torch, exactly as docs/losses.md defines them: per datum, summed over tokens.

Every function takes ``p`` (the trainer's fp32 log-probs of the target tokens, shape ``(N,)``, with
gradient) and the datum's other inputs as fp32 tensors, and returns a scalar. Datums are summed by the
caller. Weights and advantages are used as given (any real value, never clamped). The RL losses accept
an optional ``weights`` mask (SageMaker datums carry one) that multiplies each token's term.

``clip_low_threshold`` / ``clip_high_threshold`` may also come per token in the inputs (shape ``(N,)``);
they then replace the config's bounds. ``cross_entropy`` and ``importance_sampling`` take ``(N, K)``
targets (:data:`MULTI_TARGET_LOSSES`): ``p`` and every other input then have shape ``(N, K)`` and each of
the ``N·K`` entries is one term of the sum, exactly as in the mock. The log-ratio ``p − q`` is capped at
``MAX_LOG_RATIO`` (20) before ``exp`` (:func:`_ratio`), so no ratio overflows to inf (and no ``inf·0`` to NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from asyncsess.validation import MAX_LOG_RATIO

__all__ = ["LOSSES", "MULTI_TARGET_LOSSES", "DEFAULT_CLIP_LOW", "DEFAULT_CLIP_HIGH", "DEFAULT_DRO_BETA", "datum_loss"]

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.1  # not published by Tinker; the miles Tinker executor uses 0.1

MULTI_TARGET_LOSSES = frozenset({"cross_entropy", "importance_sampling"})  # take (N, K) target_tokens

Inputs = Mapping[str, Tensor]
Config = Mapping[str, float]


def _mask(inputs: Inputs) -> Tensor | float:
    w = inputs.get("weights")
    return 1.0 if w is None else w


def _clip(inputs: Inputs, config: Config) -> tuple[Tensor | float, Tensor | float]:
    """The ratio bounds: per-token inputs when given, else the config's, else the defaults."""
    lo = inputs.get("clip_low_threshold")
    hi = inputs.get("clip_high_threshold")
    return (
        float(config.get("clip_low_threshold", DEFAULT_CLIP_LOW)) if lo is None else lo,
        float(config.get("clip_high_threshold", DEFAULT_CLIP_HIGH)) if hi is None else hi,
    )


def _clamp(x: Tensor, lo: Tensor | float, hi: Tensor | float) -> Tensor:
    """``clamp(x, lo, hi)`` for float or per-token bounds (the same autograd rule either way)."""
    if isinstance(lo, float) and isinstance(hi, float):
        return x.clamp(lo, hi)
    return x.clamp(torch.as_tensor(lo, dtype=x.dtype, device=x.device), torch.as_tensor(hi, dtype=x.dtype, device=x.device))


def _ratio(p: Tensor, q: Tensor) -> Tensor:
    """``exp(min(p − q, MAX_LOG_RATIO))``: past the cap the ratio has no gradient (as in the mock)."""
    return torch.exp((p - q).clamp(max=MAX_LOG_RATIO))


def cross_entropy(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """``L = Σ −w·p``."""
    return -(inputs["weights"] * p).sum()


def importance_sampling(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """``L = −Σ r·A`` with ``r = exp(p − q)`` unclipped."""
    ratio = _ratio(p, inputs["logprobs"])
    return -(ratio * inputs["advantages"] * _mask(inputs)).sum()


def ppo(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """``L = −Σ min(r·A, clamp(r, lo, hi)·A)`` (absolute ratio bounds)."""
    lo, hi = _clip(inputs, config)
    adv = inputs["advantages"]
    ratio = _ratio(p, inputs["logprobs"])
    objective = torch.minimum(ratio * adv, _clamp(ratio, lo, hi) * adv)
    return -(objective * _mask(inputs)).sum()


def cispo(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """``L = −Σ sg[clamp(r, lo, hi)]·p·A``: the clip bounds the coefficient, the gradient always flows."""
    lo, hi = _clip(inputs, config)
    coef = _clamp(_ratio(p, inputs["logprobs"]), lo, hi).detach()
    return -(coef * p * inputs["advantages"] * _mask(inputs)).sum()


def dro(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """``L = −Σ (p·A − ½β(p − q)²)``; the ``weights`` mask (when given) also masks the penalty."""
    beta = float(config.get("beta", DEFAULT_DRO_BETA))
    objective = p * inputs["advantages"] - 0.5 * beta * (p - inputs["logprobs"]) ** 2
    return -(objective * _mask(inputs)).sum()


def gspo(p: Tensor, inputs: Inputs, config: Config) -> Tensor:
    """GSPO-token: one sequence ratio ``s = exp(mean_M(sg[p] − q))`` per datum, clipped like PPO.

    ``M`` is ``sequence_ratio_mask`` (default: every token). Per token ``s_t = sg[s]·exp(p − sg[p])``
    has value ``s`` and the gradient of the token's own log-prob.
    """
    lo, hi = _clip(inputs, config)
    adv = inputs["advantages"]
    mask = inputs.get("sequence_ratio_mask")
    if mask is None:
        mask = torch.ones_like(p)
    count = mask.sum()  # the mean over M, weighted by the mask; an empty M gives s = 1
    log_ratio = ((p.detach() - inputs["logprobs"]) * mask).sum() / count if bool(count > 0) else p.new_zeros(())
    s_t = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)) * torch.exp(p - p.detach())
    objective = torch.minimum(s_t * adv, _clamp(s_t, lo, hi) * adv)
    return -(objective * _mask(inputs)).sum()


LOSSES: dict[str, Callable[[Tensor, Inputs, Config], Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}


def datum_loss(loss_fn: str, p: Tensor, inputs: Inputs, config: Config | None = None) -> Tensor:
    """The loss of one datum (a scalar), summed over its tokens."""
    return LOSSES[loss_fn](p, inputs, config or {})
