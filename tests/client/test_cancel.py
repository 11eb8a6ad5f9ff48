"""The client under users' concurrency: cancellation, raising callbacks, bad timeouts, other loops, closed clients.

Every wait is on an event or on ``wait_all_tasks_blocked`` (no sleep-then-assert).
"""

from __future__ import annotations

import logging
import math

import anyio
import pytest

from asyncsess import DeadlineExceededError, InvalidInputError, ServiceClient
from asyncsess.sampling import SamplingLimiter

from .helpers import sft_datum

pytestmark = pytest.mark.anyio


async def test_a_raising_done_callback_does_not_keep_the_outcome_from_the_others(caplog):
    """A done-callback that raised stopped the loop over callbacks: the ``future()`` made after it never settled
    (blocking code waiting on it hung), and the error vanished."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        fut = tc.forward([sft_datum([1, 40, 41])])
        fut.add_done_callback(lambda f: 1 / 0)
        seen: list[int | None] = []
        fut.add_done_callback(lambda f: seen.append(f.seq))
        cf = fut.future()
        with caplog.at_level(logging.ERROR, logger="asyncsess"):
            out = await fut
        assert seen == [1] and cf.done() and cf.result() is out
        assert "done-callback" in caplog.text and "ZeroDivisionError" in caplog.text
        fut.add_done_callback(lambda f: 1 / 0)  # on a done future: called now, logged, not raised
        await tc.stop()


async def test_a_cancelled_waiter_lets_the_smaller_requests_behind_it_in():
    """A request queued at the head of the pool (too many bytes) that was cancelled left the requests behind it
    queued although they fit: they waited for an unrelated request to finish."""
    pool = SamplingLimiter(max_in_flight=4, max_bytes=100)
    await pool.acquire(24)
    admitted = anyio.Event()

    async def big(scope: anyio.CancelScope) -> None:
        with scope:
            await pool.acquire(152)

    async def small() -> None:
        await pool.acquire(16)
        admitted.set()

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        tg.start_soon(big, scope)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(small)
        await anyio.wait_all_tasks_blocked()
        assert pool.stats().queued == 2 and not admitted.is_set()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert admitted.is_set(), pool.stats()
    stats = pool.stats()
    assert (stats.in_flight, stats.bytes_in_flight, stats.queued) == (2, 40, 0)
    pool.release(16)
    pool.release(24)
    assert pool.stats().in_flight == 0


@pytest.mark.parametrize("timeout", [-1, -0.5, math.nan, "1", True])
async def test_a_wait_with_a_bad_timeout_is_refused_naming_it(timeout):
    """NaN was a bare ValueError from anyio's internals; a negative timeout read 'no result within -1s'."""
    async with ServiceClient("mock://?latency_ms=5") as svc:
        sc = await svc.create_sampling_client(base_model="m")
        fut = sc.sample([1, 2])
        with pytest.raises(InvalidInputError) as err:
            await fut.result_async(timeout)
        assert err.value.field == "timeout"
        assert (await fut.result_async(math.inf)).sequences  # inf: no limit
        with pytest.raises(DeadlineExceededError):
            await sc.sample([1, 2]).result_async(0)
