"""Check a JSON value against a botocore shape: types, required members, unions, min/max, enums, patterns.

botocore's own ``ParamValidator`` skips maximums, enums and patterns; the real services enforce them.
The emulator runs this on every request (and, in strict mode, on its own responses); the driver runs it
before sending so bad input fails with the field's path instead of a round trip.
"""

from __future__ import annotations

import math
import re
import sys
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cache, lru_cache
from typing import Any

from botocore.model import Shape

__all__ = ["ShapeError", "check_shape", "epoch_seconds", "java_regex", "INTEGER_RANGE"]

# Smithy's integer is 32-bit and long 64-bit: the service cannot read a larger number into the member.
INTEGER_RANGE = {"integer": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


@dataclass
class ShapeError(Exception):
    """``path`` names the member (``operationConfig.forward.datumList[0]``); ``constraint`` what it broke."""

    path: str
    constraint: str
    value: Any = None

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        where = self.path or "input"
        return f"1 validation error detected: Value {shown} at '{where}' failed to satisfy constraint: {self.constraint}"


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(java_regex(pattern), re.ASCII)  # Java's \d, \w and \s are ASCII-only, as re.ASCII makes them
    except (re.error, KeyError):  # syntax the translation does not cover (none in the served operations' inputs)
        return None


_PROPERTY = re.compile(r"\\([pP])\{(\w+)\}")
_JAVA_DOT = r"[^\n\r\x85\u2028\u2029]"  # Java's '.' stops at every line terminator, Python's at \n only


def java_regex(pattern: str) -> str:
    """A service-model (Java) regex as Python's ``re`` (with ``re.ASCII``) reads it the same way: ``\\p{L}``-style
    Unicode general categories (and ``\\p{Alnum}``) become the code point ranges they name, ``.`` stops at
    Java's line terminators. Raises KeyError for a property it does not know."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        prop = _PROPERTY.match(pattern, i)
        if prop:
            negate, ranges = prop[1] == "P", _property_ranges(prop[2])
            if in_class and negate:
                raise KeyError(prop[0])
            out.append(ranges if in_class else f"[{'^' if negate else ''}{ranges}]")
            i = prop.end()
            continue
        char = pattern[i : i + 2] if pattern[i] == "\\" else pattern[i]
        in_class = (in_class or char == "[") and char != "]"
        out.append(_JAVA_DOT if char == "." and not in_class else char)
        i += len(char)
    return "".join(out)


@cache
def _property_ranges(name: str) -> str:
    """The class body (``\\U0000xxxx-\\U0000yyyy...``) of a Unicode general category (L, Lu, ...) or of Alnum."""
    if name == "Alnum":
        return "a-zA-Z0-9"
    spans = sorted(span for category, got in _category_spans().items() if category.startswith(name) for span in got)
    if not spans:
        raise KeyError(name)
    return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in spans)


@cache
def _category_spans() -> dict[str, list[tuple[int, int]]]:
    """Every general category (Lu, Ll, ...) as spans of code points, from one pass over :mod:`unicodedata`."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for cp in range(sys.maxunicode + 1):
        got = spans.setdefault(unicodedata.category(chr(cp)), [])
        if got and got[-1][1] == cp - 1:
            got[-1] = (got[-1][0], cp)
        else:
            got.append((cp, cp))
    return spans


def check_shape(value: Any, shape: Shape | None, path: str = "") -> None:
    """Raise :class:`ShapeError` at the first violation. ``shape=None`` (an operation without input or output,
    such as DeleteModelPackage's answer) admits only an empty object."""
    if shape is None:
        if value:
            raise ShapeError(path, "Member must be empty: the operation has no members here", value)
        return
    _check(value, shape, path)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _bounds(value: float, shape: Shape, path: str, shown: Any) -> None:
    lo, hi = shape.metadata.get("min"), shape.metadata.get("max")
    if lo is not None and value < lo:
        raise ShapeError(
            path, f"Member must have {'length' if isinstance(shown, (str, list, dict)) else 'value'} greater than or equal to {lo}", shown
        )
    if hi is not None and value > hi:
        raise ShapeError(
            path, f"Member must have {'length' if isinstance(shown, (str, list, dict)) else 'value'} less than or equal to {hi}", shown
        )


def _check(value: Any, shape: Shape, path: str) -> None:
    kind = shape.type_name
    if shape.metadata.get("document"):
        return
    if kind == "structure":
        if not isinstance(value, dict):
            raise ShapeError(path, "Member must be an object", value)
        members = shape.members  # type: ignore[attr-defined]
        unknown = set(value) - set(members)
        if unknown:
            raise ShapeError(_join(path, sorted(unknown)[0]), "Member is not part of the request shape", value[sorted(unknown)[0]])
        for name in shape.required_members:  # type: ignore[attr-defined]
            if value.get(name) is None:
                raise ShapeError(_join(path, name), "Member must not be null", None)
        present = [k for k, v in value.items() if v is not None]
        if shape.metadata.get("union") and len(present) != 1:
            raise ShapeError(path, f"Member must set exactly one of {', '.join(members)} (got {len(present)})", sorted(present))
        for name in present:
            _check(value[name], members[name], _join(path, name))
    elif kind == "list":
        if not isinstance(value, list):
            raise ShapeError(path, "Member must be a list", value)
        _bounds(len(value), shape, path, value)
        for i, item in enumerate(value):
            if item is None and shape.member.type_name == "double":  # type: ignore[attr-defined]
                continue  # log-prob lists carry null for the first prompt token (it has no context)
            _check(item, shape.member, f"{path}[{i}]")  # type: ignore[attr-defined]
    elif kind == "map":
        if not isinstance(value, dict):
            raise ShapeError(path, "Member must be a map", value)
        _bounds(len(value), shape, path, value)
        for key, item in value.items():
            _check(key, shape.key, f"{path}.key")  # type: ignore[attr-defined]
            _check(item, shape.value, f"{path}[{key!r}]")  # type: ignore[attr-defined]
    elif kind == "string":
        if not isinstance(value, str):
            raise ShapeError(path, "Member must be a string", value)
        _bounds(len(value), shape, path, value)
        if shape.enum and value not in shape.enum:  # type: ignore[attr-defined]
            raise ShapeError(path, f"Member must satisfy enum value set: [{', '.join(shape.enum)}]", value)  # type: ignore[attr-defined]
        pattern = shape.metadata.get("pattern")
        rx = _regex(pattern) if pattern else None
        if rx is not None and not rx.fullmatch(value):
            raise ShapeError(path, f"Member must satisfy regular expression pattern: {pattern}", value)
    elif kind in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShapeError(path, "Member must be an integer", value)
        low, high = INTEGER_RANGE[kind]
        if not low <= value <= high:
            raise ShapeError(path, f"Member must be a {'32' if kind == 'integer' else '64'}-bit integer, in [{low}, {high}]", value)
        _bounds(value, shape, path, value)
    elif kind in ("double", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ShapeError(path, "Member must be a number", value)
        if not _is_finite(value):  # JSON has no NaN or Infinity; NaN also slipped past min and max
            raise ShapeError(path, "Member must be a finite number", value)
        _bounds(value, shape, path, value)
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise ShapeError(path, "Member must be a boolean", value)
    elif kind == "timestamp":
        if not _is_timestamp(value):
            raise ShapeError(path, "Member must be a timestamp: finite epoch seconds or an ISO 8601 string", value)
    elif kind == "blob":
        if not isinstance(value, (str, bytes, bytearray)):
            raise ShapeError(path, "Member must be a blob", value)


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer literal past the floats
        return False


def _is_timestamp(value: Any) -> bool:
    try:
        epoch_seconds(value)
    except ValueError:
        return False
    return True


def epoch_seconds(value: Any) -> float:
    """A timestamp member's value (epoch seconds, an ISO 8601 string: UTC unless it names an offset, or a datetime)
    as finite epoch seconds; ValueError when it is none."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not _is_finite(value):
            raise ValueError(f"{value} is no time")
        return float(value)
    if isinstance(value, str):
        return epoch_seconds(datetime.fromisoformat(value.replace("Z", "+00:00")))
    raise ValueError(f"{value!r} is no time")
