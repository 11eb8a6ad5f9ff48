"""The built-in losses in numpy, exactly as docs/losses.md defines them.

Every loss is sum-reduced over tokens and datums and returns ``(loss, g)`` with ``g = −∂L/∂p`` per token
(stop-gradient terms frozen). Arrays are flat over the whole batch; ``seg`` gives each token's datum
index (only GSPO needs it). The log-ratio ``p − q`` is capped at ``MAX_LOG_RATIO`` (20) before ``exp``, so no
ratio overflows; a token past the cap gets no gradient through its ratio (the derivative of the cap). RL losses multiply each per-token term by ``weights`` when given (a mask;
SageMaker datums carry one); ``cross_entropy`` defaults ``weights`` to ones.

Config keys: ``clip_low_threshold`` / ``clip_high_threshold`` (ppo, cispo, gspo; absolute ratio bounds,
default 0.8 / 1.2, also accepted per token in ``loss_fn_inputs``) and ``beta`` (dro, default 0.1 — the
default is our choice, Tinker does not publish one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from asyncsess.errors import InvalidInputError, UnsupportedError
from asyncsess.validation import MAX_LOG_RATIO

__all__ = ["LOSSES", "REQUIRED_INPUTS", "MULTI_TARGET_LOSSES", "compute_loss", "parse_config"]

Arrays = Mapping[str, np.ndarray]
LossFn = Callable[[np.ndarray, Arrays, Mapping[str, float], "np.ndarray | None"], tuple[float, np.ndarray]]

_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": _CLIP_DEFAULTS,
    "cispo": _CLIP_DEFAULTS,
    "gspo": _CLIP_DEFAULTS,
    "dro": {"beta": 0.1},
}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {name: _RL_INPUTS for name in _CONFIG_DEFAULTS} | {"cross_entropy": ("target_tokens",)}
MULTI_TARGET_LOSSES = frozenset({"cross_entropy", "importance_sampling"})  # accept (N, K) targets


def parse_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults merged with ``config``; unknown keys are an error rather than silently ignored."""
    if loss_fn not in _CONFIG_DEFAULTS:
        raise UnsupportedError(f"unknown loss {loss_fn!r}", field="loss_fn", fix=f"use one of {', '.join(_CONFIG_DEFAULTS)}")
    allowed = _CONFIG_DEFAULTS[loss_fn]
    out = dict(allowed)
    for key, value in (config or {}).items():
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise InvalidInputError(f"{loss_fn} takes no config key {key!r}", field="loss_fn_config", fix=f"known keys: {known}")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise InvalidInputError(f"{key}={value!r} is not a number", field=f"loss_fn_config[{key!r}]") from None
    return out


def compute_loss(
    loss_fn: str, p: np.ndarray, inputs: Arrays, config: Mapping[str, float] | None = None, seg: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """Loss value and ``g = −∂L/∂p`` for trainer log-probs ``p`` (float64, flat over the batch)."""
    return LOSSES[loss_fn](p, inputs, parse_config(loss_fn, config), seg)


def _weights(inputs: Arrays) -> np.ndarray | float:
    w = inputs.get("weights")
    return 1.0 if w is None else w


def _clip_bounds(inputs: Arrays, cfg: Mapping[str, float]) -> tuple[np.ndarray | float, np.ndarray | float]:
    lo = inputs.get("clip_low_threshold", cfg["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", cfg["clip_high_threshold"])
    return lo, hi


def _ratio(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``r = exp(min(p − q, MAX_LOG_RATIO))`` and the mask where the cap is not hit (there ``∂r/∂p = r``, else 0)."""
    log_ratio = p - q
    return np.exp(np.minimum(log_ratio, MAX_LOG_RATIO)), log_ratio <= MAX_LOG_RATIO


def _pessimistic(ratio: np.ndarray, adv: np.ndarray, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """``min(ratio·A, clip(ratio)·A)`` and the mask where the unclipped branch (the one with gradient) is taken."""
    unclipped = ratio * adv
    clipped = np.clip(ratio, lo, hi) * adv
    flows = ((adv >= 0) & (ratio <= hi)) | ((adv < 0) & (ratio >= lo))
    return np.minimum(unclipped, clipped), flows


def cross_entropy(p, inputs, cfg, seg):
    w = _weights(inputs)
    return float(-(w * p).sum()), np.broadcast_to(w, p.shape).astype(np.float64)


def importance_sampling(p, inputs, cfg, seg):
    ratio, live = _ratio(p, inputs["logprobs"])
    term = _weights(inputs) * ratio * inputs["advantages"]
    return float(-term.sum()), np.where(live, term, 0.0)


def ppo(p, inputs, cfg, seg):
    adv, w = inputs["advantages"], _weights(inputs)
    ratio, live = _ratio(p, inputs["logprobs"])
    objective, flows = _pessimistic(ratio, adv, *_clip_bounds(inputs, cfg))
    return float(-(w * objective).sum()), np.where(flows & live, w * ratio * adv, 0.0)


def cispo(p, inputs, cfg, seg):
    adv, w = inputs["advantages"], _weights(inputs)
    coeff = w * np.clip(_ratio(p, inputs["logprobs"])[0], *_clip_bounds(inputs, cfg)) * adv
    return float(-(coeff * p).sum()), coeff


def dro(p, inputs, cfg, seg):
    adv, q, w, beta = inputs["advantages"], inputs["logprobs"], _weights(inputs), cfg["beta"]
    term = w * (p * adv - 0.5 * beta * (p - q) ** 2)
    return float(-term.sum()), w * (adv - beta * (p - q))


def gspo(p, inputs, cfg, seg):
    adv, w = inputs["advantages"], _weights(inputs)
    seg = np.zeros(p.size, dtype=np.int64) if seg is None else seg
    mask = inputs.get("sequence_ratio_mask")
    mask = np.ones(p.size) if mask is None else mask
    n_seg = int(seg.max()) + 1 if seg.size else 0
    num = np.bincount(seg, weights=mask * (p - inputs["logprobs"]), minlength=n_seg)
    den = np.bincount(seg, weights=mask, minlength=n_seg)
    seq_ratio = np.exp(np.minimum(np.divide(num, den, out=np.zeros(n_seg), where=den != 0), MAX_LOG_RATIO))[seg]
    objective, flows = _pessimistic(seq_ratio, adv, *_clip_bounds(inputs, cfg))
    return float(-(w * objective).sum()), np.where(flows, w * seq_ratio * adv, 0.0)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
