"""JSON request bodies too large for the event loop: decoded (and checked) in a worker thread.

A body of up to the servers' 256 MB limit takes seconds to decode and validate; on the event loop that
stalls every other tenant's requests. :func:`off_loop` runs such work in a thread when the body is larger
than :data:`INLINE_BYTES` (a small one is cheaper to decode than a thread hop). A thread alone is not enough:
``json.loads`` is one C call that holds the GIL until it returns, so :func:`loads` decodes a large body with
Python hooks on its numbers and objects, where the interpreter can hand the GIL to the event loop. Strings,
arrays and ``true``/``false``/``null`` have no hook: a body made of millions of them (``["a","a",...]``,
``[[],[],...]``) is decoded by the pure-Python scanner, which yields between every value, and one of more than
:data:`MAX_CONTAINERS` arrays and objects is refused (each is a Python container the garbage collector walks,
with the GIL held, as they pile up).
"""

from __future__ import annotations

import email.message
import itertools
import json
import json.decoder
import json.scanner
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

__all__ = ["INLINE_BYTES", "MAX_CONTAINERS", "TooManyContainers", "coding", "foreign_type", "is_json", "loads", "nests_past", "off_loop"]

T = TypeVar("T")

# bodies up to this size (bytes) are decoded and checked on the event loop: there ~1 ms of decoding costs less than
# a thread hop, which under load waits up to the GIL switch interval (5 ms) per hop
INLINE_BYTES = 64 * 1024

MAX_CONTAINERS = 2**18  # arrays and objects in one body (a 1,024-datum forward_backward op holds ~20,000; 2**18 cost ~30 ms of GC)

# a large body with more values decoded without a hook than this (a string or a literal 1, an array 16: it costs as
# much, its garbage collection included) is decoded by the Python scanner: ~1 M of them hold the GIL ~20 ms; a
# 1,024-datum forward_backward op counts ~250,000 and keeps the C scanner (its numbers and objects yield)
SCAN_VALUES = 2**20
_ARRAY_COST = 16
_SLICE = 2**20  # bytes counted per C call: the GIL may pass to the event loop between two
_INERT = b"0123456789+-.eE,:]} \t\r\n"  # what numbers, separators, whitespace and closers are made of: never counted


class TooManyContainers(ValueError):
    """A body with more than :data:`MAX_CONTAINERS` arrays and objects."""


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


# Python-level hooks: each call is a point where another thread (the event loop) may take the GIL
_HOOKS: dict[str, Any] = {"parse_int": _int, "parse_float": _float, "object_pairs_hook": _object}
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]  # the Python scanner's string reader (C)


def _census(raw: bytes) -> tuple[int, int]:
    """Upper bounds of the arrays and objects in ``raw`` and of the cost of its hook-less values (strings, arrays,
    literals), counted a slice at a time. Text in strings only raises them."""
    quotes = arrays = objects = literals = 0
    for start in range(0, len(raw), _SLICE):
        rest = raw[start : start + _SLICE].translate(None, _INERT)  # a numeric slice leaves next to nothing
        quotes, arrays, objects = quotes + rest.count(b'"'), arrays + rest.count(b"["), objects + rest.count(b"{")
        literals += rest.count(b"l") + rest.count(b"u")  # true, false, null: each has an l or a u
    return arrays + objects, quotes // 2 + literals + _ARRAY_COST * arrays


def loads(raw: bytes, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(raw, parse_constant=...)``, with the same results and exceptions; over :data:`INLINE_BYTES`,
    decoded so that the GIL is released between numbers and objects (about 3× slower, in a thread, against seconds of
    a frozen loop), or between every value when hook-less values abound (:data:`SCAN_VALUES`), and refused with
    :class:`TooManyContainers` past :data:`MAX_CONTAINERS` arrays and objects."""
    if len(raw) <= INLINE_BYTES:
        return json.loads(raw, parse_constant=parse_constant)
    containers, hookless = _census(raw)
    decoder = json.JSONDecoder(**_HOOKS, parse_constant=parse_constant)
    if containers > MAX_CONTAINERS or hookless > SCAN_VALUES:
        _python_scanner(decoder)
    return decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


def _python_scanner(decoder: json.JSONDecoder) -> None:
    """Make ``decoder`` decode with the pure-Python scanner, which runs Python between every two values, counting the
    arrays and objects it makes: :class:`TooManyContainers` past :data:`MAX_CONTAINERS` (brackets in text, which
    :func:`_census` counts too, are not refused)."""
    made = itertools.count(1)

    def counted(make: Callable[..., Any]) -> Callable[..., Any]:
        def container(*args: Any) -> Any:
            if next(made) > MAX_CONTAINERS:
                raise TooManyContainers(f"the body holds more than {MAX_CONTAINERS:,} arrays and objects")
            return make(*args)

        return container

    # (the json module's own attributes, which typeshed does not declare)
    decoder.parse_string = _scanstring  # type: ignore[attr-defined]
    decoder.parse_array = counted(decoder.parse_array)  # type: ignore[attr-defined]
    decoder.object_pairs_hook = counted(_object)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]


def nests_past(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) holds arrays or objects more than ``limit`` levels deep. Iterative: a value
    decoded in a thread's short stack may nest too deep for the event loop's (``json.dumps``, ``repr``: a 500)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        if depth >= limit:
            return True
        todo.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))
    return False


def coding(headers: Any) -> str | None:
    """The ``Content-Encoding`` a JSON body was sent with, when it is one the doors cannot read (anything but none or
    ``identity``: a compressed body would be read as if it were plain JSON); None when the body is plain."""
    value = str(headers.get("content-encoding") or "").strip()
    return None if value.lower() in ("", "identity") else value


def media_type(content_type: str | None) -> str:
    """The ``type/subtype`` a ``Content-Type`` header names, lower case, parameters dropped (``""`` when absent;
    ``text/plain`` when malformed, as :mod:`email` reads it)."""
    if not content_type:
        return ""
    message = email.message.Message()
    message["content-type"] = content_type
    return message.get_content_type()


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI decodes a body of this ``Content-Type`` as JSON (``application/json`` or ``+json``, any
    parameters)."""
    main, _, subtype = media_type(content_type).partition("/")
    return main == "application" and (subtype == "json" or subtype.endswith("+json"))


def foreign_type(headers: Any) -> str | None:
    """The ``Content-Type`` a body was sent with when it declares something other than JSON (``text/plain``, a form,
    ...); None when it is JSON or there is none (the doors read an unlabelled body as JSON, as FastAPI does)."""
    value = str(headers.get("content-type") or "").strip()
    return None if not value or is_json(value) else value


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: on the event loop when ``size`` (the body's bytes) is at most :data:`INLINE_BYTES`, else in a
    worker thread (exceptions propagate either way)."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)
