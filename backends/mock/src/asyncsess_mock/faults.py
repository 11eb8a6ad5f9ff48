"""Seeded latency and fault injection, configured from the ``mock://`` URL query.

Each training session and sampler gets its own :class:`Faults` with a generator seeded from the URL's
``seed`` and the object's ordinal in its backend, so a run with the same calls sees the same faults.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Any

import anyio

from asyncsess.backends import ParsedURL
from asyncsess.errors import InvalidInputError, TransientError

__all__ = ["MockConfig", "Faults"]


@dataclass(frozen=True)
class MockConfig:
    """Every ``mock://`` query parameter (documented in docs/backend-mock.md)."""

    seed: int = 0
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    slow_rate: float = 0.0
    slow_ms: float = 0.0
    fetch_ms: float = 0.0  # the round trip that answers a re-delivered op from the store (instead of the op's latency)
    fail_rate: float = 0.0
    fail_phase: str = "after"  # "after": a failure comes after the call's latency; "before": at once (refused)
    drop_response_rate: float = 0.0
    timeout_rate: float = 0.0
    hang_s: float = 3600.0
    duplicate_rate: float = 0.0
    stop_after_ops: int = 0
    gap_timeout_s: float = 60.0
    max_context: int = 512
    default_max_tokens: int = 32
    checkpoint_dir: str = ""  # also keep checkpoints on disk here, for another process to resume from
    # sampler refresh faults (0: off): the first sampler on the weights of optimizer step N serves the weights
    # before that step (drop) or with that step's update applied twice (repeat)
    drop_refresh_at: int = 0
    repeat_refresh_at: int = 0
    keep_samples: int = 1024  # answered samples each sampler keeps by request_id, for a retry to fetch

    @classmethod
    def from_url(cls, url: ParsedURL, options: dict[str, Any]) -> MockConfig:
        """Read the query; keyword ``options`` with the same names override it, other options are not ours."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(url.query) - set(known))
        if unknown:
            raise InvalidInputError(f"unknown parameter(s) {', '.join(unknown)}", field="url", fix=f"known: {', '.join(known)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            kind: type = {"int": int, "str": str}.get(str(getattr(f.type, "__name__", f.type)), float)
            default: Any = f.default
            if kind is str:
                values[name] = url.get_str(name, default)
            else:
                values[name] = url.get_int(name, default) if kind is int else url.get_float(name, default)
            if name in options:
                values[name] = kind(options[name])
        return cls(**values)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str):
                continue
            if not math.isfinite(value):  # a keyword option skips the URL's check: NaN failed anyio's sleep, inf slept forever
                raise InvalidInputError(f"{f.name}={value} is not finite", field=f"url ?{f.name}=", fix="use a finite value >= 0")
            if f.name.endswith("_rate") and not 0.0 <= value <= 1.0:
                raise InvalidInputError(f"{f.name}={value} is not a probability", field=f"url ?{f.name}=", fix="use a value in [0, 1]")
            if f.name != "seed" and value < 0:
                raise InvalidInputError(f"{f.name}={value} is negative", field=f"url ?{f.name}=", fix="use a value >= 0")
        if self.fail_phase not in ("before", "after"):
            raise InvalidInputError(
                f"fail_phase={self.fail_phase!r} is not a phase", field="url ?fail_phase=", fix="use fail_phase=before or fail_phase=after"
            )
        if self.drop_refresh_at and self.drop_refresh_at == self.repeat_refresh_at:
            raise InvalidInputError(
                f"drop_refresh_at and repeat_refresh_at are both {self.drop_refresh_at}",
                field="url ?repeat_refresh_at=",
                fix="inject one refresh fault per step",
            )
        if self.max_context < 2 or self.default_max_tokens < 1:
            raise InvalidInputError("context too small", field="url ?max_context=", fix="use max_context >= 2 and default_max_tokens >= 1")


class Faults:
    """Draws the faults for one session or sampler, in call order."""

    def __init__(self, cfg: MockConfig, key: str) -> None:
        self.cfg = cfg
        self._rng = random.Random(f"{cfg.seed}:{key}")

    def _hit(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    async def before(self, what: str, *, fetch: bool = False) -> None:
        """Latency, then maybe a failure before anything is applied, or a hang the caller's deadline must end.

        With ``fail_phase=before`` a failure comes at once, without the latency (a refusal: 503, throttle,
        connection refused). Calls made one at a time draw the same numbers in both phases, so the same calls fail.
        ``fetch``: the call is a re-delivery the backend answers from its store; it sleeps ``fetch_ms`` instead
        of the op's latency, jitter and slowness, and draws the same numbers as any call (so it can fail,
        hang or lose its answer like one, and the draws of later calls do not depend on which calls were fetches).
        """
        cfg = self.cfg
        delay = cfg.latency_ms + cfg.jitter_ms * self._rng.random() if cfg.jitter_ms else cfg.latency_ms
        if self._hit(cfg.slow_rate):
            delay += cfg.slow_ms
        if fetch:
            delay = cfg.fetch_ms
        refused = cfg.fail_phase == "before" and self._hit(cfg.fail_rate)
        if delay and not refused:
            await anyio.sleep(delay / 1000)
        if refused or (cfg.fail_phase == "after" and self._hit(cfg.fail_rate)):
            raise TransientError(f"injected failure before {what} (fail_rate={cfg.fail_rate}, fail_phase={cfg.fail_phase})", operation=what)
        if self._hit(cfg.timeout_rate):
            await anyio.sleep(cfg.hang_s)
            raise TransientError(f"injected timeout: no answer to {what} for {cfg.hang_s:g}s", operation=what)

    def duplicate(self) -> bool:
        return self._hit(self.cfg.duplicate_rate)

    def drop_response(self, what: str) -> None:
        """After the op was applied: maybe lose the answer, as a dropped connection would."""
        if self._hit(self.cfg.drop_response_rate):
            raise TransientError(
                f"injected lost response after {what} was applied (drop_response_rate={self.cfg.drop_response_rate})",
                operation=what,
                lost_response=True,
            )
