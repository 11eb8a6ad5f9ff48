"""APIFuture: the handle every operation returns at call time."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import anyio

from .errors import DeadlineExceededError, OperationCancelledError

__all__ = ["APIFuture", "InvalidStateError"]

T = TypeVar("T")


class InvalidStateError(RuntimeError):
    """The future has no result yet (await it), or it was cancelled."""


class APIFuture(Generic[T]):
    """The pending result of one operation, created when the method is called.

    ``await fut`` (or ``await fut.result_async(timeout)``) waits for the value and raises the op's
    error if it failed. ``cancel()`` stops work that can still be withdrawn (sampling requests, ops
    not yet sent); an ordered training op already sent keeps its place and ``cancel()`` returns False.
    """

    __slots__ = ("_cancel_scope", "_callbacks", "_done", "_error", "_event", "_result", "_withdrawable", "operation", "seq")

    def __init__(self, operation: str, seq: int | None = None) -> None:
        self.operation = operation
        self.seq = seq
        self._event: anyio.Event | None = None  # made on first wait: most pipelined results are done by then
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._cancel_scope: anyio.CancelScope | None = None
        self._withdrawable = True
        self._callbacks: list[Callable[[APIFuture[T]], None]] = []

    def __repr__(self) -> str:
        state = "pending" if not self._done else "cancelled" if self.cancelled() else "failed" if self._error else "done"
        seq = f" seq={self.seq}" if self.seq is not None else ""
        return f"<APIFuture {self.operation}{seq} {state}>"

    # ------------------------------------------------------------------ waiting

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    async def result_async(self, timeout: float | None = None) -> T:
        """Wait for the value; raise :class:`DeadlineExceededError` after ``timeout`` seconds."""
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            if timeout is None:
                await self._event.wait()
            else:
                with anyio.move_on_after(timeout):
                    await self._event.wait()
                if not self._done:
                    raise DeadlineExceededError(f"no result within {timeout:g}s", operation=self.operation, seq=self.seq)
        return self.result()

    def coroutine(self) -> Any:
        """A coroutine that waits for the value (Tinker's ``APIFuture.coroutine()``, for ``create_task``)."""
        return self.result_async()

    def result(self, timeout: float | None = None) -> T:
        """The value of a finished future (use ``await`` to wait for it; ``asyncsess.sync`` blocks with ``timeout``)."""
        if not self._done:
            raise InvalidStateError(f"{self!r} is still running: await it (or use asyncsess.sync for blocking calls)")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._done and isinstance(self._error, OperationCancelledError)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            raise InvalidStateError(f"{self!r} is still running")
        return self._error

    def cancel(self) -> bool:
        """Withdraw the work if it can still be withdrawn; True if it was."""
        if self._done or not self._withdrawable or self._cancel_scope is None:
            return False
        self._cancel_scope.cancel()
        return True

    def add_done_callback(self, fn: Callable[[APIFuture[T]], None]) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    # ------------------------------------------------------------- settling (internal)

    def _set_result(self, value: T) -> None:
        if not self._done:
            self._result = value
            self._settle()

    def _set_exception(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._settle()

    def _settle(self) -> None:
        self._done = True
        if self._event is not None:
            self._event.set()
        for fn in self._callbacks:
            fn(self)
        self._callbacks.clear()
