"""Checks on what a caller hands a sandbox (limits, code and stdin text, extra files), shared by every sandbox:
bad input is an InvalidInputError naming the field and the fix, raised before anything runs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import TypeVar

from asyncsess.errors import InvalidInputError

__all__ = ["check_limit", "encode_text", "check_file_name", "check_files"]

NAME_MAX, PATH_MAX = 255, 1024
Number = TypeVar("Number", int, float)

LIMITS = {  # field: (integer only, largest accepted value)
    "max_concurrency": (True, 1 << 16),
    "timeout_s": (False, 86_400.0),
    "memory_mb": (True, 1 << 24),
    "max_output_bytes": (True, 1 << 40),
    "max_processes": (True, 1 << 16),
    "workdir_mb": (True, 1 << 20),
    "cpus": (False, 4096.0),
    "request_slack_s": (False, 86_400.0),
}


def check_limit(field: str, value: Number) -> Number:
    """``value`` if it is a number in (0, limit] (an int where the field counts something), else InvalidInputError."""
    integer, limit = LIMITS[field]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= limit:  # NaN fails the bounds
        kind = "an int" if integer else "a finite number"
        raise InvalidInputError(f"must be {kind} in (0, {limit}], got {value!r}", field=field, fix=f"pass {field} > 0")
    return value


def encode_text(field: str, text: str, what: str = "") -> bytes:
    """``text`` as UTF-8, or InvalidInputError (not a str, or a lone surrogate)."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{what}not encodable as UTF-8 at position {exc.start} ({exc.reason})", field=field, fix="remove lone surrogates"
        ) from None
    except AttributeError:
        raise InvalidInputError(f"expected str, got {type(text).__name__}", field=field, fix="pass a str") from None


def check_file_name(name: object, reserved: str | None = None) -> str:
    """The normalised relative path of a ``files`` key, or InvalidInputError naming what is wrong with it."""
    fix = "use a relative path like 'data/input.txt': no NUL, no '..', no absolute path" + (f", not {reserved}" if reserved else "")
    if not isinstance(name, str):
        raise InvalidInputError(f"file name {name!r} is a {type(name).__name__}", field="files", fix=fix)
    raw = encode_text("files", name)
    path = PurePosixPath(name)
    checks = (
        ("\0" in name, "contains NUL"),
        (path.is_absolute(), "is absolute"),
        (".." in path.parts, "contains '..'"),
        (not path.parts or name.endswith("/"), "names no file"),
        (len(raw) > PATH_MAX, f"is longer than {PATH_MAX} bytes"),
        (any(len(part.encode()) > NAME_MAX for part in path.parts), f"has a part longer than {NAME_MAX} bytes"),
    )
    problem = next((why for failed, why in checks if failed), None)
    if problem:
        raise InvalidInputError(f"file name {name!r} {problem}", field="files", fix=fix)
    return str(path)


def check_files(files: Mapping[str, str | bytes] | None, *, reserved: str | None = None) -> dict[str, bytes]:
    """``files`` as normalised relative path -> bytes, or InvalidInputError: a bad name, a name that is also another
    file's directory (or is ``reserved``, where the sandbox puts the code), or content that is not text or bytes."""
    contents: dict[str, bytes] = {}
    taken = {reserved} if reserved else set()  # every file and every directory a file needs
    for name, content in (files or {}).items():
        path = check_file_name(name, reserved)
        parents = [str(p) for p in PurePosixPath(path).parents][:-1]  # without "."
        if path in taken or any(p in contents or p == reserved for p in parents):
            raise InvalidInputError(
                f"file name {name!r} collides with another file or directory" + (f" (or with {reserved})" if reserved else ""),
                field="files",
                fix="give every file its own path; a file cannot also be a directory",
            )
        taken.update([path, *parents])
        if not isinstance(content, (str, bytes, bytearray, memoryview)):
            raise InvalidInputError(f"content of {name!r} is a {type(content).__name__}", field="files", fix="pass str or bytes")
        contents[path] = encode_text("files", content, f"content of {name!r} is ") if isinstance(content, str) else bytes(content)
    return contents
