"""A JSONL file of rows as a user may hand it over (a task's problems, the preference loop's pairs): each row is
checked when the file is loaded, before any training op, and what is not a row is an
:class:`~asyncsess.errors.InvalidInputError` naming the file, the line (``path:line``), the key (``field``:
``<file name>.<key>``, or ``<name>.<key>`` for a config field ``name`` that holds the path) and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import InvalidInputError
from ..runs.jsonl import parse_line, refuse

__all__ = ["RowError", "load_rows", "need", "check_limit"]

T = TypeVar("T")
MAX_LINE_BYTES = 1 << 28  # one problem, its tests included; a line past this is not one (a file with no newlines)


class RowError(InvalidInputError):
    """What is wrong with one row: ``key`` (a dotted path into it) and ``detail``; :func:`load_rows` adds the file
    and the line."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(detail, field=key)
        self.key, self.detail = key, detail


def need(row: Any, key: str, kind: type | tuple[type, ...], what: str, at: str = "") -> Any:
    """``row[key]``, which must be a ``kind`` (``what`` says so in words); ``at``: the dotted path of ``row``."""
    name = f"{at}.{key}" if at else key
    if not isinstance(row, dict):
        raise RowError(at, f"{at} is {row!r:.60}, not an object")
    if key not in row:
        raise RowError(name, f"{at} has no {key!r}" if at else f"the row has no {key!r}")
    value = row[key]
    if not isinstance(value, kind):
        raise RowError(name, f"{name} is {value!r:.60}, not {what}")
    return value


def check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidInputError(f"{limit!r:.40} problems", field="limit", fix="pass a positive number of problems, or None for all")


def load_rows(path: str | Path, parse: Callable[[dict[str, Any], int], T | None], fix: str, name: str | None = None) -> list[T]:
    """``parse(row, index)`` of each non-blank line of ``path`` (``index`` counts rows from 0), leaving out the rows
    it maps to ``None``. A file that is missing, a directory, unreadable or holds no rows, a line that is not a JSON
    object and a row ``parse`` refuses (a :class:`RowError`) are InvalidInputErrors naming the file, the line and the
    key (``field``: ``<name>.<key>``, ``name`` being the file's name unless given), with ``fix``."""
    p = Path(path)
    out: list[T] = []
    index = 0
    try:
        with p.open("rb") as f:  # a line at a time: a file of GBs is never held twice (bytes and text)
            for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(raw) > MAX_LINE_BYTES:
                    raise refuse(p, number, None, f"the line is longer than {MAX_LINE_BYTES} bytes", fix, name)
                if not raw.strip():
                    continue
                row = parse_line(p, number, raw, fix, name)
                try:
                    item = parse(row, index)
                except RowError as err:
                    raise refuse(p, number, err.key or None, err.detail, fix, name) from None
                index += 1
                if item is not None:
                    out.append(item)
    except IsADirectoryError:
        raise refuse(p, None, None, "is a directory, not a file", fix, name) from None
    except FileNotFoundError:
        raise refuse(p, None, None, "does not exist", fix, name) from None
    except OSError as err:
        raise refuse(p, None, None, f"cannot be read ({err.strerror or err})", fix, name) from None
    if index == 0:
        raise refuse(p, None, None, "holds no rows (it is empty)", fix, name)
    return out
