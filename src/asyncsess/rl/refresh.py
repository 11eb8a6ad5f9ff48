"""Proving a sampler refresh took: after each refresh, the new sampler's log-probs of a fixed short token
sequence are compared with the trainer's at the same weight version.

The probe is built once from the tokenizer (:func:`probe_tokens`, 12 tokens). At every refresh the loop
submits the trainer's ``forward`` (``cross_entropy``, weights 1) right after ``optim_step`` (ordered, so
it sees exactly the weights the sampler was saved from) and asks the new sampler for ``compute_logprobs``
of the same tokens. With ``d_now`` the largest difference from the trainer at this version and ``d_prev``
the largest difference from the trainer's previous probe (kept from the last refresh):

- ``d_now <= tol``: the refresh took (``ok``); if also ``d_prev <= tol`` the step barely moved the probe
  and a dropped refresh would have looked the same: ``inconclusive``, counted, never an alarm;
- ``d_now > tol`` and ``d_prev <= tol``: the sampler still serves the previous weights
  (:class:`SamplerRefreshError`, ``observed="previous"``);
- both above: it serves weights the trainer never had, e.g. the last update (or, after a resume, the
  whole adapter) applied twice (``observed="neither"``).

The check runs on the refresh itself, so a bad refresh fails the run at the step that made it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..backends.base import Tokenizer
from ..client import SamplingClient, TrainingClient
from ..errors import SamplerRefreshError
from ..futures import APIFuture
from ..types import ForwardBackwardOutput
from .data import sft_datum

__all__ = ["PROBE_TEXT", "PROBE_LENGTH", "TOLERANCES", "default_tolerance", "probe_tokens", "ProbeResult", "RefreshProbe"]

PROBE_TEXT = "The answer is 42, since 6 * 7 = 42 and 40 + 2 = 42."
PROBE_LENGTH = 12  # tokens: cheap to score, enough positions to see a LoRA update
# Largest log-prob difference between sampler and trainer at the same weights, by URL scheme.
# mock: both read the same float64 table, the trainer answers in float32 (~1e-6 at |logp| ~ 10).
# local/http: the torch sampler and the fp32 trainer run the same modules in different batch shapes
# (~1e-5 on CPU fp32); 2e-3 leaves room for TF32/bf16 on CUDA. Anything else (vLLM, SageMaker, Tinker)
# samples in bf16 with its own kernels: 5e-2.
TOLERANCES: dict[str, float] = {"mock": 1e-5, "local": 2e-3, "http": 2e-3, "https": 2e-3}
FALLBACK_TOLERANCE = 5e-2


def default_tolerance(url: str) -> float:
    """The probe tolerance for a backend URL (see :data:`TOLERANCES`)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else url.lower()
    return TOLERANCES.get(scheme, FALLBACK_TOLERANCE)


def probe_tokens(tokenizer: Tokenizer, length: int = PROBE_LENGTH) -> list[int]:
    """The first ``length`` tokens of :data:`PROBE_TEXT` (at least 2; padded by repeating the text)."""
    ids: list[int] = []
    while len(ids) < length:
        more = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        if not more:
            raise ValueError("the tokenizer encodes the probe text to no tokens")
        ids.extend(more)
    return [int(i) for i in ids[: max(2, length)]]


@dataclass(frozen=True)
class ProbeResult:
    """One refresh's check. ``step_change`` is how far the trainer's probe moved since the last check."""

    version: int
    status: Literal["ok", "inconclusive"]
    max_abs_diff: float
    step_change: float | None

    def metrics(self) -> dict[str, Any]:
        return {
            "refresh/version": self.version,
            "refresh/probe_ok": 1,
            "refresh/probe_inconclusive": int(self.status == "inconclusive"),
            "refresh/probe_max_abs_diff": self.max_abs_diff,
            "refresh/probe_step_change": self.step_change,
        }


class RefreshProbe:
    """Checks each refreshed sampler against the trainer; keeps the previous version's trainer log-probs."""

    def __init__(self, tokens: Sequence[int], tolerance: float) -> None:
        if len(tokens) < 2:
            raise ValueError("the probe needs at least 2 tokens")
        if not (math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"tolerance={tolerance}: use a finite value > 0")
        self.tokens = [int(t) for t in tokens]
        self.tolerance = float(tolerance)
        self._datum = sft_datum(self.tokens[:1], self.tokens[1:])
        self.previous: tuple[int, list[float]] | None = None  # (version, trainer log-probs) of the last check
        self.checks = 0
        self.inconclusive = 0

    def submit(self, tc: TrainingClient) -> APIFuture[ForwardBackwardOutput]:
        """The trainer's log-probs of the probe, as an ordered op: call it right after ``optim_step``."""
        return tc.forward([self._datum], "cross_entropy")

    async def check(self, version: int, trainer: APIFuture[ForwardBackwardOutput], sampler: SamplingClient) -> ProbeResult:
        """Compare ``sampler`` with the trainer's probe at ``version``; raise :class:`SamplerRefreshError` if it
        serves the previous version's weights or weights the trainer never had."""
        served = await sampler.compute_logprobs(self.tokens)
        out = await trainer
        want = [float(x) for x in out.loss_fn_outputs[0]["logprobs"].data]
        got = [float("nan") if x is None else float(x) for x in served[1:]]
        d_now = _max_abs_diff(got, want)
        prev = self.previous
        d_prev = _max_abs_diff(got, prev[1]) if prev is not None else math.inf
        step_change = _max_abs_diff(want, prev[1]) if prev is not None else None
        tol = self.tolerance
        self.checks += 1
        if not d_now <= tol:  # NaN counts as a mismatch
            observed = "previous" if d_prev <= tol else "neither"
            raise SamplerRefreshError(
                expected_version=version,
                previous_version=prev[0] if prev is not None else None,
                observed=observed,
                max_abs_diff=d_now,
                tolerance=tol,
            )
        self.previous = (version, want)
        status: Literal["ok", "inconclusive"] = "inconclusive" if d_prev <= tol else "ok"
        self.inconclusive += status == "inconclusive"
        return ProbeResult(version, status, d_now, step_change)


def _max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return math.inf
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
