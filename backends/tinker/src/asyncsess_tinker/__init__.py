"""``tinker://host:port`` / ``tinkers://host``: an asyncsess backend that speaks Tinker's HTTP wire."""

from .backend import TinkerBackend

__all__ = ["TinkerBackend"]
