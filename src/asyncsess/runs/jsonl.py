"""The JSONL files of a run directory (``checkpoints.jsonl``, ``metrics.jsonl``) as a killed process leaves them.

Each record is one line ending in ``\\n``, written by one append. A process killed mid-write leaves its last
line without the ``\\n`` (a torn line: part of a record, or the NUL bytes a crashed filesystem fills in): it is
dropped on reading, with a warning, and cut off before the next append, so the run resumes from the last whole
record. Anything else that is not a record (bad UTF-8, bad JSON, a non-finite number, a wrong type) is an
:class:`~asyncsess.errors.InvalidInputError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..errors import InvalidInputError

__all__ = ["JsonlLine", "json_data", "open_for_append", "parse_line", "read_jsonl", "refuse", "write_whole"]

log = logging.getLogger("asyncsess.runs")
MAX_FILE_BYTES = 1 << 30  # a run's JSONL files hold a line per step; a bigger one is not a run's
JsonlLine = tuple[int, dict[str, Any]]  # (line number, counting from 1; the record)


def refuse(path: Path, line: int | None, field: str | None, message: str, fix: str, name: str | None = None) -> InvalidInputError:
    """The error for what ``path`` holds at ``line`` (``None``: the whole file); its field is ``<name>.<field>``, where
    ``name`` is the file's name unless given (the config field that holds the path, say)."""
    where = f"{path}" if line is None else f"{path}:{line}"
    return InvalidInputError(f"{where}: {message}", field=f"{name or path.name}{'' if field is None else f'.{field}'}", fix=fix)


def _non_finite(value: Any, where: str = "") -> str | None:
    """The key path of the first NaN or infinite number in ``value``, if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where or "(value)"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (found := _non_finite(v, f"{where}.{k}" if where else str(k))) is not None:
            return found
    return None


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_surrogate(v) for v in value)


def parse_line(path: Path, number: int, raw: bytes, fix: str, name: str | None = None) -> dict[str, Any]:
    """Line ``number`` of ``path`` as a JSON object: not UTF-8, not JSON (or too deep, or a too long int), not an
    object, a NaN or a lone surrogate is an InvalidInputError naming the file and the line (see :func:`refuse`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse(path, number, None, "the line is not UTF-8", fix, name) from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:  # bad JSON, an int of more than 4300 digits, deep nesting
        raise refuse(path, number, None, f"the line is not JSON ({str(err)[:80]})", fix, name) from None
    if not isinstance(value, dict):
        raise refuse(path, number, None, f"the line holds a JSON {type(value).__name__}, not an object", fix, name)
    if (key := _non_finite(value)) is not None:
        raise refuse(path, number, key, "NaN or an infinite number (JSON has none)", fix, name)
    if _has_surrogate(value):
        raise refuse(path, number, None, "a string holds a lone surrogate (not text)", fix, name)
    return value


def _scan(path: Path, check: Callable[[int, dict[str, Any]], object], fix: str) -> tuple[list[JsonlLine], int | None, bool]:
    """The records of ``path``; where a torn last line starts (``None``: none); whether the file lacks its last ``\\n``."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise refuse(path, None, None, f"{size} bytes is too big for a run file", fix)
        data = path.read_bytes()
    except IsADirectoryError:
        raise refuse(path, None, None, "is a directory, not a file", fix) from None
    except OSError as err:
        raise refuse(path, None, None, f"cannot be read ({err.strerror or err})", fix) from None
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last "\n": empty when the file ends in one
    out: list[JsonlLine] = []
    for i, raw in enumerate(lines, start=1):
        if raw.strip():
            record = parse_line(path, i, raw, fix)
            check(i, record)
            out.append((i, record))
    if not tail.strip(b" \t\r"):
        return out, None, bool(tail)
    try:  # an unterminated last line: a whole record whose "\n" was not written, or a torn one
        record = parse_line(path, len(lines) + 1, tail, fix)
        check(len(lines) + 1, record)
    except InvalidInputError as err:
        log.warning("%s: dropping its torn last line (a process killed while writing it?): %s", path, err)
        return out, len(data) - len(tail), True
    out.append((len(lines) + 1, record))
    return out, None, True


def read_jsonl(path: Path, check: Callable[[int, dict[str, Any]], object], fix: str) -> list[JsonlLine]:
    """The records of ``path`` (none if it is missing), each passed to ``check(line, record)``, which raises
    (see :func:`refuse`) for a record it refuses; a torn last line is left out."""
    if not path.exists():
        return []
    return _scan(path, check, fix)[0]


def open_for_append(path: Path, check: Callable[[int, dict[str, Any]], object], fix: str) -> IO[str]:
    """``path`` opened to append lines, after cutting off a torn last line (or ending the last one with ``\\n``)."""
    if path.exists():
        _, torn_at, unterminated = _scan(path, check, fix)
        if torn_at is not None:
            os.truncate(path, torn_at)
        elif unterminated:
            with path.open("ab") as f:
                f.write(b"\n")
    return path.open("a", encoding="utf-8")


def json_data(value: Any, key: str, field: str) -> Any:
    """``value`` as JSON data a run reads back: numpy scalars and arrays as Python numbers and lists, NaN and
    infinities (at any depth) as null (JSON has none, and a line holding them is refused on reading). Anything
    else that is not JSON data is an InvalidInputError naming ``field`` and ``key``."""
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_data(v, key, field) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: json_data(v, f"{key}.{k}", field) for k, v in value.items()}
    raise InvalidInputError(
        f"{key!r:.60} is of type {type(value).__name__}, not JSON data", field=field, fix="use numbers, strings, lists and str-keyed dicts"
    )


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file beside it, then renamed over it): a process killed
    mid-write leaves the old file, never part of the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
