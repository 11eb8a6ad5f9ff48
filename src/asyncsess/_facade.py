"""Runtime of the generated sync facade: one background event loop per process, and blocking futures.

The loop (an anyio blocking portal on a daemon thread) starts on first use and is shut down at
interpreter exit, after every facade ServiceClient still open has been closed. A child made by ``os.fork()``
starts its own loop on first use; the parent's clients are refused there (``WrongEventLoopError``). Calls hop onto it with
``portal.call``; no thread is made per call.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import functools
import inspect
import os
import threading
from collections.abc import Callable, Coroutine, Generator
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import anyio
import sniffio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .errors import DeadlineExceededError, FacadeMisuseError
from .futures import APIFuture
from .validation import check_timeout

__all__ = ["SyncFuture", "call", "call_async", "submit", "open_service", "close_service", "shutdown", "reopen_sampler"]

T = TypeVar("T")

_lock = threading.Lock()
_portal: BlockingPortal | None = None
_portal_cm: AbstractContextManager[BlockingPortal] | None = None
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: int | None = None
_services: dict[int, AbstractContextManager[Any]] = {}
_abandoned: list[Any] = []  # a forked child's copies of the parent's loop objects (see _forget_after_fork)


def _get_portal() -> BlockingPortal:
    global _portal, _portal_cm, _loop, _loop_thread
    if _portal is None:
        with _lock:
            if _portal is None:
                cm = start_blocking_portal(backend="asyncio", name="asyncsess-loop")
                portal = cm.__enter__()
                _loop_thread = portal.call(threading.get_ident)
                _loop = portal.call(asyncio.get_running_loop)
                _portal_cm, _portal = cm, portal
                atexit.register(shutdown)
    return _portal


def _check_thread(what: str) -> None:
    if _loop_thread is not None and threading.get_ident() == _loop_thread:
        raise FacadeMisuseError(
            f"{what} was called on the asyncsess.sync event loop, where blocking would deadlock; "
            "inside async code use the async API (`await fut`) instead of asyncsess.sync"
        )


def _on_loop(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Run a plain function on the loop thread (one hop, no task; at once when called there, e.g. from a done-callback,
    where waiting for the hop would deadlock); its outcome lands in the future."""
    _get_portal()
    assert _loop is not None
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:
            done.set_exception(err)

    if threading.get_ident() == _loop_thread:
        run()
    else:
        _loop.call_soon_threadsafe(run, context=_loop_context())
    return done


def _loop_context() -> contextvars.Context:
    """The caller's context for work on the facade's loop, less sniffio's record of the caller's async library (a
    call from a trio run would otherwise make anyio take the facade's asyncio loop for trio)."""
    ctx = contextvars.copy_context()
    ctx.run(sniffio.current_async_library_cvar.set, None)
    return ctx


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (sync or async) on the facade's loop and return its result."""
    _check_thread(getattr(fn, "__qualname__", "a blocking call"))
    if inspect.iscoroutinefunction(fn):
        return _get_portal().call(functools.partial(fn, *args, **kwargs))
    return _on_loop(lambda: fn(*args, **kwargs)).result()


def submit(method: Callable[..., APIFuture[T]], *args: Any, **kwargs: Any) -> SyncFuture[T]:
    """Call an op method on the loop (it is numbered and sent now) and return its blocking future."""
    _check_thread(getattr(method, "__qualname__", "an op"))

    def start() -> SyncFuture[T]:
        return SyncFuture(method(*args, **kwargs))

    return _on_loop(start).result()  # type: ignore[no-any-return]


async def call_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await the async client method ``fn`` on the facade's loop from any asyncio loop or trio run (Tinker's
    ``*_async`` methods of its blocking clients); an op's ``APIFuture`` comes back as a :class:`SyncFuture`."""

    async def run() -> Any:
        value = await fn(*args, **kwargs)
        return SyncFuture(value) if isinstance(value, APIFuture) else value

    _get_portal()
    assert _loop is not None
    done = _loop_context().run(asyncio.run_coroutine_threadsafe, run(), _loop)
    try:
        await _wait(done)
    except BaseException:
        done.cancel()  # cancelled while waiting: withdraw the call on the facade's loop
        raise
    return done.result()


async def _wait(done: concurrent.futures.Future[Any], timeout: float | None = None) -> None:
    """Wait for ``done`` (settled on the facade's loop) on the caller's asyncio loop or trio run, without a worker
    thread (a wait per thread ran out of anyio's 40 and stalled every later one); return at ``timeout`` s."""
    if done.done():
        return
    event = anyio.Event()
    schedule: Callable[[Callable[[], None]], object]
    if sniffio.current_async_library() == "asyncio":
        schedule = asyncio.get_running_loop().call_soon_threadsafe
    else:
        import trio

        schedule = trio.lowlevel.current_trio_token().run_sync_soon

    def wake(_: concurrent.futures.Future[Any]) -> None:
        try:
            schedule(event.set)
        except RuntimeError:  # the waiting loop has ended
            pass

    done.add_done_callback(wake)
    with anyio.move_on_after(timeout):
        await event.wait()


def open_service(service: Any) -> Any:
    """Enter an async ServiceClient on the loop; it stays open until :func:`close_service`."""
    _check_thread("ServiceClient()")
    cm = _get_portal().wrap_async_context_manager(service)
    cm.__enter__()
    _services[id(service)] = cm
    return service


def close_service(service: Any, exc_info: tuple[Any, Any, Any] = (None, None, None)) -> None:
    cm = _services.pop(id(service), None)
    if cm is not None:
        _check_thread("ServiceClient.close()")
        cm.__exit__(*exc_info)


def reopen_sampler(handle: Any) -> Any:
    """Unpickle an ``asyncsess.sync.SamplingClient``: open a ServiceClient for the handle's URL on this
    process's loop (closed at exit) and reopen the sampler on it."""
    from . import client, sync

    svc = open_service(client.ServiceClient(handle.url, heartbeat_interval=0, **handle.options))
    inner = call(client.SamplingClient.from_sampler_handle(handle).attach, svc)
    return sync.SamplingClient._wrap(inner)


def _forget_after_fork() -> None:
    """In a child made by ``os.fork()``: the loop thread was not copied, so the next call starts a new loop (the
    parent's clients are refused there with ``WrongEventLoopError``), and exit does not wait on the parent's."""
    global _lock, _portal, _portal_cm, _loop, _loop_thread
    # kept, never finalized: closing the portal's context manager would wait here for a thread that is not
    _abandoned.append((_portal_cm, _portal, dict(_services)))
    _lock = threading.Lock()
    _portal = _portal_cm = _loop = _loop_thread = None
    _services.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def shutdown() -> None:
    """Close open facade ServiceClients (stopping their sessions) and stop the loop thread."""
    global _portal, _portal_cm, _loop, _loop_thread
    for key in list(_services):
        cm = _services.pop(key)
        try:
            cm.__exit__(None, None, None)
        except Exception:
            pass
    with _lock:
        if _portal_cm is not None:
            _portal_cm.__exit__(None, None, None)
        _portal = _portal_cm = _loop = _loop_thread = None


class SyncFuture(Generic[T]):
    """Blocking view of an :class:`APIFuture`: the op was submitted, in order, when it was created.

    Made on the loop thread; ``result()`` waits on the op's ``APIFuture.future()`` (a
    ``concurrent.futures.Future``, which ``future()`` returns: cancelling it withdraws the op where it can still
    be withdrawn) without another hop onto the loop. Awaitable too, as Tinker's futures are.
    """

    __slots__ = ("_done", "_fut")

    def __init__(self, fut: APIFuture[T]) -> None:
        self._fut = fut
        self._done: concurrent.futures.Future[T] = fut.future()

    def __repr__(self) -> str:
        return repr(self._fut).replace("APIFuture", "SyncFuture", 1)

    def __reduce__(self) -> Any:
        return self._fut.__reduce__()  # refused by name: a handle on work in this process

    @property
    def seq(self) -> int | None:
        return self._fut.seq

    def result(self, timeout: float | None = None) -> T:
        """Block until the value is ready; raise ``DeadlineExceededError`` after ``timeout`` seconds (``None`` or ``inf``:
        no limit; NaN, a negative or a non-number is an ``InvalidInputError`` naming ``timeout``)."""
        _check_thread("SyncFuture.result()")
        timeout = check_timeout(timeout)
        try:
            return self._done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceededError(f"no result within {timeout:g}s", operation=self._fut.operation, seq=self._fut.seq) from None

    def done(self) -> bool:
        return self._done.done()

    async def result_async(self, timeout: float | None = None) -> T:
        """Wait without blocking the caller's event loop; ``DeadlineExceededError`` after ``timeout`` s."""
        timeout = check_timeout(timeout)
        if not self._done.done():
            await _wait(self._done, timeout)
            if not self._done.done():
                raise DeadlineExceededError(f"no result within {timeout:g}s", operation=self._fut.operation, seq=self._fut.seq)
        return self._done.result()

    def coroutine(self) -> Coroutine[Any, Any, T]:
        """A coroutine that waits for the value (Tinker's ``APIFuture.coroutine()``, for ``create_task``)."""
        return self.result_async()

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def get_telemetry(self) -> None:
        """Tinker's telemetry handle: always ``None`` (asyncsess collects none)."""
        return None

    def future(self) -> concurrent.futures.Future[T]:
        """The op's outcome as a ``concurrent.futures.Future`` (Tinker's ``APIFuture.future()``); cancelling it
        withdraws the op where :meth:`cancel` could, and reads cancelled either way."""
        return self._done

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until done; return the op's error (or None). Raise ``DeadlineExceededError`` on timeout."""
        _check_thread("SyncFuture.exception()")
        timeout = check_timeout(timeout)
        try:
            return self._done.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceededError(f"not done within {timeout:g}s", operation=self._fut.operation, seq=self._fut.seq) from None

    def cancel(self) -> bool:
        """Withdraw the work if it can still be withdrawn (see ``APIFuture.cancel``)."""
        return bool(_on_loop(self._fut.cancel).result())

    def cancelled(self) -> bool:
        return self._done.cancelled() or self._fut.cancelled()
