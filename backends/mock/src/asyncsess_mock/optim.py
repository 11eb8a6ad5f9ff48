"""AdamW with decoupled weight decay, bias correction and optional global-norm clipping (torch's formulas)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from asyncsess.errors import NonFiniteGradientError
from asyncsess.types import AdamParams

__all__ = ["AdamState", "adamw_step"]


@dataclass
class AdamState:
    """First and second moments and the number of steps taken."""

    m: np.ndarray
    v: np.ndarray
    step: int = 0

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> AdamState:
        return cls(np.zeros(shape), np.zeros(shape), 0)

    def copy(self) -> AdamState:
        return AdamState(self.m.copy(), self.v.copy(), self.step)


def adamw_step(param: np.ndarray, grad: np.ndarray, state: AdamState, hp: AdamParams) -> dict[str, float]:
    """Update ``param`` and ``state`` in place; ``grad`` is read only. Returns ``grad_norm`` (before clipping) and ``learning_rate``.

    A gradient whose norm is NaN or infinite changes nothing and raises :class:`NonFiniteGradientError`.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` followed by ``torch.optim.AdamW``:
    clip by ``max_norm / (norm + 1e-6)`` when that is below 1; ``param *= 1 − lr·wd``;
    ``param −= lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + eps)``. ``lora_plus_lr_ratio`` has no meaning for a full table and is ignored.
    """
    norm = float(np.sqrt(np.vdot(grad, grad)))
    if not math.isfinite(norm):
        raise NonFiniteGradientError(norm)  # before anything changes
    if hp.grad_clip_norm > 0:
        coeff = hp.grad_clip_norm / (norm + 1e-6)
        if coeff < 1.0:
            grad = grad * coeff
    state.step += 1
    b1, b2, lr = hp.beta1, hp.beta2, hp.learning_rate
    state.m *= b1
    state.m += (1 - b1) * grad
    state.v *= b2
    state.v += (1 - b2) * grad * grad
    if hp.weight_decay:
        param *= 1 - lr * hp.weight_decay
    denom = np.sqrt(state.v) / math.sqrt(1 - b2**state.step) + hp.eps
    param -= (lr / (1 - b1**state.step)) * state.m / denom
    return {"grad_norm": norm, "learning_rate": lr}
