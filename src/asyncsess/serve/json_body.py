"""JSON request bodies too large for the event loop: decoded (and checked) in a worker thread.

A body of up to the servers' 256 MB limit takes seconds to decode and validate; on the event loop that
stalls every other tenant's requests. :func:`off_loop` runs such work in a thread when the body is larger
than :data:`INLINE_BYTES` (a small one is cheaper to decode than a thread hop). A thread alone is not enough:
``json.loads`` is one C call that holds the GIL until it returns, so :func:`loads` decodes a large body with
Python hooks on its numbers and objects, where the interpreter can hand the GIL to the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

__all__ = ["INLINE_BYTES", "coding", "loads", "off_loop"]

T = TypeVar("T")

# bodies up to this size (bytes) are decoded and checked on the event loop: there ~1 ms of decoding costs less than
# a thread hop, which under load waits up to the GIL switch interval (5 ms) per hop
INLINE_BYTES = 64 * 1024


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


# Python-level hooks: each call is a point where another thread (the event loop) may take the GIL
_HOOKS: dict[str, Any] = {"parse_int": _int, "parse_float": _float, "object_pairs_hook": _object}
_YIELDING = json.JSONDecoder(**_HOOKS)


def loads(raw: bytes, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(raw, parse_constant=...)``, with the same results and exceptions; over :data:`INLINE_BYTES`,
    decoded so that the GIL is released between numbers and objects (about 3× slower, in a thread, against seconds of
    a frozen loop)."""
    if len(raw) <= INLINE_BYTES:
        return json.loads(raw, parse_constant=parse_constant)
    decoder = _YIELDING if parse_constant is None else json.JSONDecoder(**_HOOKS, parse_constant=parse_constant)
    return decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


def coding(headers: Any) -> str | None:
    """The ``Content-Encoding`` a JSON body was sent with, when it is one the doors cannot read (anything but none or
    ``identity``: a compressed body would be read as if it were plain JSON); None when the body is plain."""
    value = str(headers.get("content-encoding") or "").strip()
    return None if value.lower() in ("", "identity") else value


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: on the event loop when ``size`` (the body's bytes) is at most :data:`INLINE_BYTES`, else in a
    worker thread (exceptions propagate either way)."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)
