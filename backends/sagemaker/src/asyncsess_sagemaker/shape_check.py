"""Check a JSON value against a botocore shape: types, required members, unions, min/max, enums, patterns.

botocore's own ``ParamValidator`` skips maximums, enums and patterns; the real services enforce them.
The emulator runs this on every request (and, in strict mode, on its own responses); the driver runs it
before sending so bad input fails with the field's path instead of a round trip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from botocore.model import Shape

__all__ = ["ShapeError", "check_shape", "INTEGER_RANGE"]

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
        return re.compile(pattern)
    except re.error:  # Java-only syntax such as \p{L}: not checkable with ``re``
        return None


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


def _is_timestamp(value: Any) -> bool:
    if isinstance(value, datetime):
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return False
        return True
    return False
