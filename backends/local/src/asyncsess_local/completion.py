"""A result made on the engine thread and awaited from any event loop (asyncio or trio)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["Completion"]


class Completion:
    """Set once from any thread; ``await wait()`` from any number of tasks, in any event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[Any, anyio.Event]] = []

    @property
    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._finish(value, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            self._value, self._error, self._done = value, error, True
            waiters, self._waiters = self._waiters, []
        for token, event in waiters:
            try:
                anyio.from_thread.run_sync(event.set, token=token)
            except Exception:  # that event loop is gone; nobody is waiting any more
                pass

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    async def wait(self) -> Any:
        with self._lock:
            if not self._done:
                event = anyio.Event()
                self._waiters.append((anyio.lowlevel.current_token(), event))
            else:
                event = None
        if event is not None:
            await event.wait()
        return self.result()
