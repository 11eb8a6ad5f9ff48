"""The URL registry: a backend is a class with an entry point in group ``asyncsess.backends``, named after its scheme."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from ..errors import InvalidInputError
from .base import Backend, ParsedURL, parse_url

__all__ = ["available_schemes", "check_url", "load_backend"]


def available_schemes() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="asyncsess.backends")}


def check_url(url: str) -> ParsedURL:
    """``url`` parsed, refused (``field="url"``) unless an installed backend serves its scheme."""
    parsed = parse_url(url)
    eps = available_schemes()
    if parsed.scheme not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise InvalidInputError(
            f"no backend for scheme {parsed.scheme!r} (installed: {known})",
            field="url",
            fix="install the backend package, e.g. pip install -e backends/mock",
        )
    return parsed


def load_backend(url: str, **options: Any) -> Backend:
    """Find the backend for ``url``'s scheme through the ``asyncsess.backends`` entry points."""
    parsed = check_url(url)
    cls = available_schemes()[parsed.scheme].load()
    return cls.from_url(parsed, **options)
