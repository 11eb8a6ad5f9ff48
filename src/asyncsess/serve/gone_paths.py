"""Backend paths (or backend ids, naming every path under them) a door no longer serves (a 404, as a path never
issued), kept per API key and bounded."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["GonePaths"]


class GonePaths:
    """Paths by the key whose data they held. :meth:`add` keeps at most ``cap`` per key, forgetting that key's
    oldest past it, so one key's traffic never grows the record without end nor pushes out another key's paths.
    The door deletes the backend copy of each path it adds, so one forgotten long after names nothing there."""

    def __init__(self) -> None:
        self._owner: dict[str, str | None] = {}
        self._by_key: dict[str | None, OrderedDict[str, None]] = {}

    def __contains__(self, path: object) -> bool:
        return path in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def held(self, owner: str | None) -> int:
        """How many of ``owner``'s paths are kept."""
        return len(self._by_key.get(owner, ()))

    def add(self, path: str, owner: str | None, cap: int) -> None:
        self.discard(path)
        mine = self._by_key.setdefault(owner, OrderedDict())
        mine[path], self._owner[path] = None, owner
        while len(mine) > cap:
            del self._owner[mine.popitem(last=False)[0]]

    def discard(self, path: str) -> None:
        if path in self._owner:
            del self._by_key[self._owner.pop(path)][path]
