"""Learning-rate schedules shared by the supervised and RL loops (the cookbook's: linear, cosine, constant)."""

from __future__ import annotations

import math
from typing import Literal

from ..errors import InvalidInputError

__all__ = ["LRSchedule", "decayed_lr"]

LRSchedule = Literal["linear", "cosine", "constant"]


def decayed_lr(base: float, done: float, schedule: LRSchedule) -> float:
    """``base`` decayed to 0 as the fraction of the run ``done`` goes from 0 to 1 (clamped to that range); a
    ``schedule`` that is none of the three is an InvalidInputError (a misspelt one trained at a constant rate)."""
    frac = min(1.0, max(0.0, done))
    if schedule == "linear":
        return base * (1.0 - frac)
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "constant":
        return base
    raise InvalidInputError(f"{schedule!r:.40} is not a schedule", field="schedule", fix="pass 'linear', 'cosine' or 'constant'")
