"""The URL registry: a backend is a class with an entry point in group ``asyncsess.backends``, named after its scheme."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from ..errors import InvalidInputError
from .base import Backend, parse_url

__all__ = ["available_schemes", "load_backend"]


def available_schemes() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="asyncsess.backends")}


def load_backend(url: str, **options: Any) -> Backend:
    """Find the backend for ``url``'s scheme through the ``asyncsess.backends`` entry points."""
    parsed = parse_url(url)
    eps = available_schemes()
    ep = eps.get(parsed.scheme)
    if ep is None:
        known = ", ".join(sorted(eps)) or "none installed"
        raise InvalidInputError(
            f"no backend for scheme {parsed.scheme!r} (installed: {known})",
            field="url",
            fix="install the backend package, e.g. pip install -e backends/mock",
        )
    cls = ep.load()
    return cls.from_url(parsed, **options)
