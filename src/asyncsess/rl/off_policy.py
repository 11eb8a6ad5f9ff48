"""Off-policy correction for stale RL groups (numpy, torch-free).

A group sampled ``s`` optimizer steps ago carries the sampler's (behaviour) log-probs ``q``; the trainer's
log-probs ``p`` at the current weights (the *proximal* policy) come from one ``forward`` per batch. The
ratio ``r = exp(p - q)`` corrects for the gap, in one of these modes (names as in verl's rollout
correction and SkyRL's ``off_policy_correction``):

- ``tis``: token-level truncated IS, ``w_t = min(r_t, C)`` (``C`` = ``is_cap``);
- ``mis``: token masking, ``w_t = 1`` when ``lo ≤ r_t ≤ hi``, else 0;
- ``seq_tis``: sequence-level truncated IS, ``w = min(exp(Σ_t (p_t - q_t)), C)`` for every token of the datum;
- ``seq_mis``: sequence masking, the whole datum is dropped when ``exp(Σ_t (p_t - q_t))`` is outside ``[lo, hi]``;
- ``geo_mask``: geometric sequence masking, dropped when ``exp(mean_t (p_t - q_t))`` is outside ``[lo, hi]``.

Sums and means run over the loss mask (the sampled tokens). With the correction on, a datum's
``logprobs`` anchor becomes ``p`` and its advantages are multiplied by ``w`` (0 off the mask and on dropped
tokens): :func:`correct_datums`. For ``importance_sampling``, ``ppo`` and ``cispo`` this is exactly
the decoupled objective ``w_t · ℓ(p_θ / p, A_t)``, because those losses are linear in ``A_t`` per token and
``w_t ≥ 0`` keeps the sign of ``A_t`` (so ppo's min/clip picks the same branch). Ratios are taken in log
space, so no ``exp`` overflows; a NaN or infinite log-prob on a sampled token is an error, not a NaN weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..custom_loss import ce_view
from ..errors import InvalidInputError
from ..types import Datum, TensorData

if TYPE_CHECKING:
    from ..client import TrainingClient

__all__ = [
    "OFF_POLICY_MODES",
    "OffPolicyMode",
    "Correction",
    "importance_weights",
    "correct_datums",
    "off_policy_metrics",
    "correct_batch",
]

OffPolicyMode = Literal["none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask"]
OFF_POLICY_MODES: tuple[str, ...] = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask")


@dataclass(frozen=True)
class Correction:
    """Per datum, per token: the importance weight (0 off the loss mask), whether the ratio was truncated
    to the cap, and whether the token was dropped by a mask."""

    weights: list[np.ndarray] = field(default_factory=list)
    truncated: list[np.ndarray] = field(default_factory=list)
    dropped: list[np.ndarray] = field(default_factory=list)

    def __add__(self, other: Correction) -> Correction:
        return Correction(self.weights + other.weights, self.truncated + other.truncated, self.dropped + other.dropped)


def _arrays(
    behaviour: Sequence[Sequence[float]], proximal: Sequence[Sequence[float]], masks: Sequence[Sequence[float]]
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per datum ``(q, p, mask as bool)``, checked: equal lengths and finite log-probs on the mask."""
    if not len(behaviour) == len(proximal) == len(masks):
        raise InvalidInputError(
            f"{len(behaviour)} behaviour, {len(proximal)} proximal and {len(masks)} mask rows",
            field="proximal",
            fix="give one row of log-probs and one mask per datum",
        )
    out = []
    for i, (q, p, m) in enumerate(zip(behaviour, proximal, masks)):
        qa, pa, ma = np.asarray(q, np.float64), np.asarray(p, np.float64), np.asarray(m, np.float64) > 0
        if not qa.shape == pa.shape == ma.shape or qa.ndim != 1:
            raise InvalidInputError(
                f"datum {i}: {qa.size} behaviour log-probs, {pa.size} proximal, {ma.size} mask values",
                field=f"proximal[{i}]",
                fix="give one value per target token in each",
            )
        for name, a in (("behaviour", qa), ("proximal", pa)):
            bad = ~np.isfinite(a) & ma
            if bad.any():
                t = int(np.argmax(bad))
                raise InvalidInputError(
                    f"{name} log-prob {a[t]} at datum {i}, token {t} is not finite",
                    field=f"{name}[{i}][{t}]",
                    fix="sampled tokens need finite log-probs (check the sampler's and the trainer's outputs)",
                )
        out.append((qa, pa, ma))
    return out


def importance_weights(
    behaviour: Sequence[Sequence[float]],
    proximal: Sequence[Sequence[float]],
    masks: Sequence[Sequence[float]],
    mode: OffPolicyMode,
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """The per-token importance weights of ``mode`` (module docstring) for datums with behaviour log-probs
    ``q``, proximal log-probs ``p`` and loss masks; ``none`` gives weight 1 on the mask."""
    if mode not in OFF_POLICY_MODES:
        raise InvalidInputError(f"unknown mode {mode!r}", field="off_policy", fix=f"use one of {', '.join(OFF_POLICY_MODES)}")
    log_cap = math.log(cap) if cap > 0 else -math.inf
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high > 0 else -math.inf
    out = Correction()
    for q, p, m in _arrays(behaviour, proximal, masks):
        d = np.where(m, p - q, 0.0)  # log-ratio on the sampled tokens
        w = m.astype(np.float64)
        truncated = np.zeros_like(m)
        dropped = np.zeros_like(m)
        if mode == "tis":
            truncated = m & (d > log_cap)
            w = np.where(m, np.exp(np.minimum(d, log_cap)), 0.0)
        elif mode == "mis":
            dropped = m & ((d < log_low) | (d > log_high))
        elif mode in ("seq_tis", "seq_mis", "geo_mask"):
            s = float(d.sum())
            if mode == "geo_mask":
                s = s / max(1, int(m.sum()))
            if mode == "seq_tis":
                truncated = m & (s > log_cap)
                w = np.where(m, math.exp(min(s, log_cap)), 0.0)
            elif s < log_low or s > log_high:
                dropped = m.copy()
        w = np.where(dropped, 0.0, w)
        out.weights.append(w)
        out.truncated.append(truncated)
        out.dropped.append(dropped)
    return out


def correct_datums(datums: Sequence[Datum], proximal: Sequence[Sequence[float]], correction: Correction) -> list[Datum]:
    """The datums with ``logprobs`` = the proximal log-probs and advantages multiplied by the weights."""
    out = []
    for d, p, w in zip(datums, proximal, correction.weights):
        n = len(w)
        adv = (np.asarray(d.loss_fn_inputs["advantages"].data, np.float64) * w).tolist()
        inputs = {
            **d.loss_fn_inputs,
            "logprobs": TensorData.model_construct(data=[float(x) for x in p], dtype="float32", shape=[n]),
            "advantages": TensorData.model_construct(data=adv, dtype="float32", shape=[n]),
        }
        out.append(Datum.model_construct(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def off_policy_metrics(
    behaviour: Sequence[Sequence[float]],
    proximal: Sequence[Sequence[float]],
    masks: Sequence[Sequence[float]],
    correction: Correction | None = None,
) -> dict[str, float]:
    """``off_policy/kl``: the sampler-trainer KL(q‖p) by the k3 estimator ``mean((r - 1) - log r)`` over the
    sampled tokens (unbiased for samples from ``q``, never negative), ``off_policy/ratio_max`` (the largest raw
    ``r``, capped at ``e^700``: what an uncorrected ``importance_sampling`` loss multiplies by); with a correction also
    ``off_policy/is_weight_mean`` and ``_max`` (over the sampled tokens, dropped ones as 0),
    ``off_policy/clip_frac`` (share of sampled tokens whose weight was truncated to the cap) and
    ``off_policy/mask_frac`` (share dropped by a mask). Empty when no token is sampled."""
    rows = _arrays(behaviour, proximal, masks)
    m = np.concatenate([r[2] for r in rows]) if rows else np.zeros(0, bool)
    if not m.any():
        return {}
    d = np.concatenate([r[1] - r[0] for r in rows])[m]
    ratio = np.exp(np.minimum(d, 700.0))
    metrics = {"off_policy/kl": float(np.mean(ratio - 1.0 - d)), "off_policy/ratio_max": float(ratio.max())}
    if correction is not None:
        w = np.concatenate(correction.weights)[m]
        metrics.update(
            {
                "off_policy/is_weight_mean": float(w.mean()),
                "off_policy/is_weight_max": float(w.max()),
                "off_policy/clip_frac": float(np.concatenate(correction.truncated)[m].mean()),
                "off_policy/mask_frac": float(np.concatenate(correction.dropped)[m].mean()),
            }
        )
    return metrics


async def correct_batch(
    tc: TrainingClient, pairs: list[tuple[Datum, list[float]]], mode: OffPolicyMode, *, cap: float, low: float, high: float
) -> tuple[list[tuple[Datum, list[float]]], Correction]:
    """One ``forward`` (``cross_entropy``, weights 0) gives the proximal log-probs ``p`` of the (datum, mask)
    pairs at the current weights; the pairs come back corrected (:func:`correct_datums`) with the weights."""
    datums = [d for d, _ in pairs]
    behaviour = [d.loss_fn_inputs["logprobs"].data for d in datums]
    _arrays(behaviour, behaviour, [m for _, m in pairs])  # bad sampler log-probs fail before the forward is sent
    out = await tc.forward(list(ce_view(datums)), "cross_entropy")
    proximal = [o["logprobs"].data for o in out.loss_fn_outputs]
    correction = importance_weights(behaviour, proximal, [m for _, m in pairs], mode, cap=cap, low=low, high=high)
    return list(zip(correct_datums(datums, proximal, correction), [m for _, m in pairs])), correction
