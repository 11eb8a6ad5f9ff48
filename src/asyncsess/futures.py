"""APIFuture: the handle every operation returns at call time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import anyio

from .errors import DeadlineExceededError, OperationCancelledError, WrongEventLoopError
from .validation import check_timeout

__all__ = ["APIFuture", "InvalidStateError"]

log = logging.getLogger("asyncsess")

T = TypeVar("T")


class InvalidStateError(RuntimeError):
    """The future has no result yet (await it), or it was cancelled."""


class APIFuture(Generic[T]):
    """The pending result of one operation, created when the method is called.

    ``await fut`` (or ``await fut.result_async(timeout)``, or ``fut.coroutine()``) waits for the value and raises
    the op's error if it failed. ``cancel()`` stops work that can still be withdrawn (sampling requests, ops
    not yet sent); an ordered training op already sent keeps its place and ``cancel()`` returns False.
    ``future()`` is the outcome as a ``concurrent.futures.Future`` (Tinker's ``APIFuture.future()``).
    """

    __slots__ = (
        "_cancel_requested",
        "_cancel_scope",
        "_callbacks",
        "_cf",
        "_done",
        "_error",
        "_event",
        "_loop",
        "_result",
        "_withdrawable",
        "operation",
        "seq",
    )

    def __init__(self, operation: str, seq: int | None = None) -> None:
        self.operation = operation
        self.seq = seq
        self._event: anyio.Event | None = None  # made on first wait: most pipelined results are done by then
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._cancel_scope: anyio.CancelScope | None = None
        self._cancel_requested = False  # cancel() before its task started: the task withdraws it on starting
        self._withdrawable = True
        self._callbacks: list[Callable[[APIFuture[T]], None]] = []
        self._cf: concurrent.futures.Future[T] | None = None
        self._loop = loop_token()  # where it settles: waiting for it from another loop would never wake

    def __repr__(self) -> str:
        state = "pending" if not self._done else "cancelled" if self.cancelled() else "failed" if self._error else "done"
        seq = f" seq={self.seq}" if self.seq is not None else ""
        return f"<APIFuture {self.operation}{seq} {state}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} is a handle on work in this process and cannot be pickled: pickle its result (await it first)")

    # ------------------------------------------------------------------ waiting

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    async def result_async(self, timeout: float | None = None) -> T:
        """Wait for the value; raise :class:`DeadlineExceededError` after ``timeout`` seconds (``None`` or ``inf``: no
        limit; NaN, a negative or a non-number is an :class:`InvalidInputError` naming ``timeout``)."""
        timeout = check_timeout(timeout)
        if not self._done:
            if self._loop is not None and loop_token() is not self._loop:
                raise WrongEventLoopError(
                    f"{self!r} belongs to another event loop (or thread): await it there, or use its `future()` "
                    "(a concurrent.futures.Future) from this one",
                    operation=self.operation,
                    seq=self.seq,
                )
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
        if self._done or not self._withdrawable:
            return False
        self._cancel_requested = True
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()
        return True

    def future(self) -> concurrent.futures.Future[T]:
        """The op's outcome as a ``concurrent.futures.Future`` (Tinker's ``APIFuture.future()``), for
        ``concurrent.futures.wait``, ``as_completed`` and libraries that take one. Cancelling it calls
        :meth:`cancel` (on this future's event loop when cancelled from another thread under asyncio; from
        another thread under trio the work is not withdrawn), and the Future reads cancelled either way.
        Call it on the event loop that runs the client."""
        if self._cf is None:
            cf: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._cf = cf
            cf.add_done_callback(self._withdrawer())
            self.add_done_callback(_mirror_into(cf))
        return self._cf

    def _withdrawer(self) -> Callable[[concurrent.futures.Future[T]], None]:
        """What cancelling the ``concurrent.futures.Future`` does: :meth:`cancel`, on the loop's thread."""
        thread = threading.get_ident()
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # trio, or no loop running in this thread
            loop = None

        def withdraw(cf: concurrent.futures.Future[T]) -> None:
            if not cf.cancelled() or self._done:
                return
            if threading.get_ident() == thread:
                self.cancel()
            elif loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.cancel)

        return withdraw

    def get_telemetry(self) -> None:
        """Tinker's telemetry handle: always ``None`` (asyncsess collects none)."""
        return None

    def add_done_callback(self, fn: Callable[[APIFuture[T]], None]) -> None:
        """Call ``fn(self)`` once the future is done (now, if it is); an exception ``fn`` raises is logged, as asyncio's
        callbacks' are, so that it never keeps the other callbacks or waiters from seeing the outcome."""
        if self._done:
            _call(fn, self)
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
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)


def loop_token() -> object:
    """The running event loop (asyncio) or trio run (its token), or ``None`` outside any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    if "trio" in sys.modules:
        import trio

        try:
            return trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
    return None


def _call(fn: Callable[[APIFuture[T]], None], fut: APIFuture[T]) -> None:
    try:
        fn(fut)
    except Exception:
        log.exception("a done-callback of %r raised", fut)


def _mirror_into(cf: concurrent.futures.Future[T]) -> Callable[[APIFuture[T]], None]:
    """A done-callback that copies the op's outcome into ``cf`` (unless ``cf`` was cancelled meanwhile)."""

    def mirror(fut: APIFuture[T]) -> None:
        try:
            if fut._error is None:
                cf.set_result(fut._result)
            else:
                cf.set_exception(fut._error)
        except concurrent.futures.InvalidStateError:  # cancelled by its holder: the outcome is not wanted
            pass

    return mirror
