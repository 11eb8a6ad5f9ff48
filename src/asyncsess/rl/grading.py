"""Graders under a time limit, and synchronous ones off the event loop.

A synchronous grader (a :data:`~asyncsess.rl.problem_env.Grader`) runs in a thread (:func:`grade_in_thread`), at
most :data:`GRADER_THREADS` at a time per event loop; one that takes more than :data:`INLINE_WAIT_S` is waited for
off the loop, so it never holds up sampling, training or the other episodes for longer. An async one (a tool
env's) runs on the loop under a cancel scope (:func:`grade_async`). A grader that has not returned ``timeout_s``
seconds after it started scores its episode 0 with the metric :data:`GRADER_TIMEOUTS` = 1 (summed over a step's
episodes), and a warning names it once; the run goes on. Python cannot stop a thread: a timed-out synchronous
grader runs on in a daemon thread, which never keeps the process alive, so a grader that hangs on every call
leaks one thread per episode until it is fixed.
"""

from __future__ import annotations

import logging
import numbers
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

from ..errors import InvalidInputError

__all__ = [
    "AGENT_TIMEOUTS",
    "COUNTED",
    "GRADER_TIMEOUT_S",
    "GRADER_THREADS",
    "GRADER_TIMEOUTS",
    "check_timeout",
    "grade_in_thread",
    "grade_async",
    "timed_out",
]

GRADER_TIMEOUT_S = 30.0  # seconds one grading may take; graders usually take milliseconds
MAX_GRADER_TIMEOUT_S = 86_400.0  # a day; a thread's wait refuses much more (threading.TIMEOUT_MAX)
GRADER_THREADS = 4  # synchronous graders running at once, per event loop
GRADER_TIMEOUTS = "grader_timeouts"  # the episode metric a timed-out grading reports (1.0), summed per step
AGENT_TIMEOUTS = "agent_timeouts"  # the same for an agent rollout past AgentRLConfig.agent_timeout_s
COUNTED = frozenset({GRADER_TIMEOUTS, AGENT_TIMEOUTS})  # episode metrics summed per step, not averaged
INLINE_WAIT_S = 0.2  # of a grading's wait, what blocks the loop thread (see grade_in_thread)

T = TypeVar("T")
log = logging.getLogger("asyncsess.rl")
_threads: RunVar[anyio.CapacityLimiter] = RunVar("asyncsess grader threads")
_warned: set[str] = set()


def grader_name(grader: object) -> str:
    return str(getattr(grader, "__qualname__", type(grader).__qualname__))


def check_timeout(value: object, field: str = "grader_timeout_s") -> float:
    """``value`` as a time limit in seconds: a real number > 0 and at most :data:`MAX_GRADER_TIMEOUT_S`; anything
    else is an InvalidInputError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < float(value) <= MAX_GRADER_TIMEOUT_S):
        raise InvalidInputError(
            f"{field} = {value!r:.40}",
            field=field,
            fix=f"pass a number of seconds > 0 and at most {MAX_GRADER_TIMEOUT_S:g}, e.g. {GRADER_TIMEOUT_S:g}",
        )
    return float(value)


def timed_out(grader: object, timeout_s: float | None) -> tuple[float, dict[str, float]]:
    """The ``(reward, metrics)`` of an episode whose grader ran out of time; warns once per grader."""
    name = grader_name(grader)
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "the grader %s did not return within %g s: such episodes score 0 and count in env/all/%s (raise grader_timeout_s "
            "if it needs longer)",
            name,
            timeout_s,
            GRADER_TIMEOUTS,
        )
    return 0.0, {GRADER_TIMEOUTS: 1.0}


async def grade_in_thread(grader: Callable[..., T], *args: Any, timeout_s: float) -> T | None:
    """``grader(*args)`` in a daemon thread, or ``None`` when it has not returned ``timeout_s`` seconds after it
    started (the wait for one of the :data:`GRADER_THREADS` does not count). Its exception is raised here.

    The first :data:`INLINE_WAIT_S` of the wait block the loop thread: a grader that returns by then (every
    usual one) is graded with no await, as it was on the loop, so a fixed-seed run plays out as it did; only a
    slower one is waited for off the loop."""
    try:
        limiter = _threads.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(GRADER_THREADS)
        _threads.set(limiter)
    try:
        limiter.acquire_nowait()  # no await while a thread is free
    except anyio.WouldBlock:
        await limiter.acquire()
    try:
        done = threading.Event()
        out: list[tuple[bool, Any]] = []

        def call() -> None:
            try:
                out.append((True, grader(*args)))
            except BaseException as err:  # raised on the loop, as if the grader had run there
                out.append((False, err))
            finally:
                done.set()

        threading.Thread(target=call, name=f"grader {grader_name(grader)}", daemon=True).start()
        first = min(INLINE_WAIT_S, timeout_s)
        if not done.wait(first) and timeout_s > first:
            try:  # a worker thread waits the rest, so that the loop does not
                await anyio.to_thread.run_sync(done.wait, timeout_s - first, abandon_on_cancel=True)
            finally:
                done.set()  # a cancelled wait ends its worker thread now
    finally:
        limiter.release()
    if not out:
        return None
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


async def grade_async(grader: Callable[..., Awaitable[T]], *args: Any, timeout_s: float | None) -> T | None:
    """``await grader(*args)``, or ``None`` when it has not returned within ``timeout_s`` (``None``: no limit)."""
    with anyio.move_on_after(timeout_s):
        return await grader(*args)
    return None
