"""The client under users' concurrency: cancellation, raising callbacks, bad timeouts, other loops, closed clients.

Every wait is on an event or on ``wait_all_tasks_blocked`` (no sleep-then-assert).
"""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import sys
import textwrap
import threading

import anyio
import pytest

from asyncsess import ClientClosedError, DeadlineExceededError, InvalidInputError, RetryPolicy, ServiceClient, WrongEventLoopError
from asyncsess.errors import RetriesExhaustedError, TransientError
from asyncsess.sampling import SamplingLimiter
from asyncsess_mock import MockBackend

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


async def test_a_client_used_from_another_event_loop_is_refused_before_numbering():
    """An op called from another loop (another thread's asyncio.run) took a sequence number, was started on the
    owner's loop from the wrong thread, and its awaiter never woke (a hang)."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        sc = await svc.create_sampling_client(base_model="m")
        errors: list[BaseException] = []

        async def elsewhere() -> None:
            for call in (lambda: tc.forward_backward([sft_datum([1, 40, 41])]), lambda: sc.sample([1, 2]), svc.get_server_capabilities):
                try:
                    await call()
                except BaseException as err:
                    errors.append(err)

        await anyio.to_thread.run_sync(asyncio.run, elsewhere())
        assert [type(e) for e in errors] == [WrongEventLoopError] * 3, errors
        assert "another event loop" in str(errors[0]) and errors[0].operation == "forward_backward"
        assert tc.current_sequence_number == 0
        assert (await tc.forward_backward([sft_datum([1, 40, 41])])).loss > 0  # seq 1: nothing skipped
        await tc.stop()


async def test_a_pending_future_awaited_from_another_event_loop_is_refused_not_hung():
    """A future handed to another loop (another thread's asyncio.run) and awaited there waited on an event that its
    own loop sets: the waiter never woke. Its ``future()`` is the way across, and still works."""
    async with ServiceClient("mock://?latency_ms=60000") as svc:
        sc = await svc.create_sampling_client(base_model="m")
        pending = sc.sample([1, 2])
        async with ServiceClient("mock://") as quick_svc:
            quick = await quick_svc.create_sampling_client(base_model="m")
            done = quick.sample([1, 2])
            first = await done
        errors: list[BaseException] = []
        results: list[object] = []

        async def elsewhere() -> None:
            results.append(await done)  # a finished future's value is readable anywhere
            try:
                await pending
            except BaseException as err:
                errors.append(err)

        await anyio.to_thread.run_sync(asyncio.run, elsewhere())
        assert results == [first]
        assert [type(e) for e in errors] == [WrongEventLoopError], errors
        assert "another event loop" in str(errors[0]) and errors[0].operation == "sample"
        cf = pending.future()
        assert pending.cancel() and (await anyio.to_thread.run_sync(lambda: cf.cancelled() or cf.exception(timeout=60)))


async def test_a_closed_or_reentered_service_client_is_refused_typed():
    lazy = ServiceClient("mock://")
    await lazy.create_sampling_client(base_model="m")  # Tinker's style, no `async with`: the first call opens it
    with pytest.raises(ClientClosedError, match="already open"):
        await lazy.__aenter__()
    await lazy.close()
    svc = ServiceClient("mock://")
    async with svc:
        sc = await svc.create_sampling_client(base_model="m")
        with pytest.raises(ClientClosedError, match="already open"):
            await svc.__aenter__()
    for call in (lambda: sc.sample([1, 2]), lambda: svc.create_sampling_client(base_model="m"), svc.get_server_capabilities):
        with pytest.raises(ClientClosedError, match="was closed: open a new one") as err:
            await call()
        assert isinstance(err.value, RuntimeError)  # what it was before it was typed
    with pytest.raises(ClientClosedError, match="was closed"):
        async with svc:
            pass


def test_a_forked_child_refuses_the_parents_sync_clients_and_opens_its_own(tmp_path):
    """In a child made by os.fork(), the sync facade's loop thread is gone: a call on the parent's client hung for
    good, and so did the child's own new clients and its exit."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        from asyncsess import WrongEventLoopError
        from asyncsess.sync import ServiceClient
        with ServiceClient("mock://") as svc:
            sc = svc.create_sampling_client(base_model="m")
            sc.sample([1, 2]).result()
            pid = os.fork()
            if pid == 0:
                signal.alarm(120)  # a broken build fails instead of hanging the suite
                try:
                    sc.sample([1, 2])
                except WrongEventLoopError as err:
                    print("refused:", err, flush=True)
                with ServiceClient("mock://") as own:
                    print("own:", len(own.create_sampling_client(base_model="m").sample([1, 2]).result().sequences), flush=True)
                sys.exit(0)  # a normal exit: atexit runs the facade's shutdown
            _, status = os.waitpid(pid, 0)
            print("child exit:", os.waitstatus_to_exitcode(status), flush=True)
            print("parent:", len(sc.sample([1, 2]).result().sequences), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("refused: this ServiceClient was opened in process") and "before os.fork()" in out[0]
    assert out[1:] == ["own: 1", "child exit: 0", "parent: 1"]


class _HeldCapabilities(MockBackend):
    """mock:// whose capabilities call waits on ``gate`` once ``entered`` is set (a slow remote backend)."""

    gate: anyio.Event | None = None
    entered: anyio.Event | None = None

    async def capabilities(self):
        if self.gate is not None and self.entered is not None:
            self.entered.set()
            await self.gate.wait()
        return await super().capabilities()


async def test_a_training_client_cancelled_while_it_is_being_set_up_stops_its_session():
    """A timeout around create_lora_training_client that fired after the session was created (while the client read
    the model's limits) left that session open past the ServiceClient's close: nobody held it."""
    backend = _HeldCapabilities()
    await backend.open()
    try:
        async with ServiceClient("mock://", backend=backend) as svc:
            before = set(MockBackend.open_sessions())
            backend.entered, backend.gate = anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.create_lora_training_client, "a-model-new-to-the-backend")
                await backend.entered.wait()
                tg.cancel_scope.cancel()
            assert backend.calls["create_training_session"] == 1
            assert set(MockBackend.open_sessions()) == before
            backend.gate = None
            tc = await svc.create_lora_training_client("m", rank=4)  # the client is still usable
            await tc.stop()
    finally:
        await backend.aclose()


class _LosesCreates(MockBackend):
    """mock:// whose creates fail transiently (``lose``) or wait on ``gate``; records the keys it saw and was told of."""

    lose = True
    gate: anyio.Event | None = None

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []
        self.abandoned: list[str] = []
        self.told = anyio.Event()

    async def create_training_session(self, spec):
        self.sent.append(spec.idempotency_key)
        if self.gate is not None:
            await self.gate.wait()
        if self.lose:
            raise TransientError("every reply lost")
        return await super().create_training_session(spec)

    async def abandon_create(self, idempotency_key: str) -> None:
        self.abandoned.append(idempotency_key)
        self.told.set()


async def test_a_create_given_up_on_tells_the_backend_its_key_in_the_background():
    """A create that failed for good or was cancelled told the backend nothing, so a session it may have made without
    an answer (sagemaker://) ran until close. The backend now gets ``abandon_create(key)`` with the key every attempt
    sent; not for a create that succeeded."""
    backend = _LosesCreates()
    await backend.open()
    try:
        async with ServiceClient("mock://", backend=backend, retry=RetryPolicy(max_attempts=2, initial_backoff=0.0, jitter=0.0)) as svc:
            with pytest.raises(RetriesExhaustedError):
                await svc.create_lora_training_client("m", rank=4)
            with anyio.fail_after(30):  # a hang guard only
                await backend.told.wait()
            assert len(backend.sent) == 2 and backend.abandoned == backend.sent[:1] == backend.sent[1:]
            backend.told, backend.gate = anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as tg:  # cancelled while the backend works on it
                tg.start_soon(svc.create_lora_training_client, "m", 4)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
            with anyio.fail_after(30):  # a hang guard only
                await backend.told.wait()
            assert backend.abandoned == [backend.sent[0], backend.sent[2]]
            backend.lose, backend.gate = False, None
            tc = await svc.create_lora_training_client("m", rank=4)
            await tc.stop()
        assert len(backend.sent) == 4 and len(backend.abandoned) == 2
    finally:
        await backend.aclose()


def test_sync_clients_left_open_at_exit_are_stopped_without_a_false_garbage_collection_warning():
    """At interpreter exit the clients' finalizers ran before the facade closed them, and warned that a client still
    referenced 'was garbage-collected while open' (an error under -W error)."""
    script = textwrap.dedent(
        """
        import atexit
        from asyncsess_mock import MockBackend
        atexit.register(lambda: print("left open:", MockBackend.open_sessions(), flush=True))  # runs last
        from asyncsess.rl.data import sft_datum
        from asyncsess.sync import ServiceClient
        svc = ServiceClient("mock://?latency_ms=60000")
        tc = svc.create_lora_training_client("m", rank=4)
        sc = svc.create_sampling_client(base_model="m")
        pending = [tc.forward_backward([sft_datum([1, 40], [41])]), sc.sample([1, 2])]
        print("exiting", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == ["exiting", "left open: []"]


def test_a_sync_future_cancelled_from_a_done_callback_does_not_deadlock_the_facade(monkeypatch):
    """``SyncFuture.cancel()`` hopped onto the facade's loop and waited; called from a done-callback (which runs on
    that loop) it waited for itself, and every blocking call of the process hung."""
    from asyncsess import OperationCancelledError
    from asyncsess.sync import ServiceClient as SyncServiceClient

    with SyncServiceClient("mock://") as svc:
        sc = svc.create_sampling_client(base_model="m")
        backend = svc._async.backend
        real = backend.sample

        gate = threading.Event()

        async def sample(sampler_id, request):
            if request.prompt == (1, 2):
                await anyio.sleep_forever()  # ends only when cancelled
            await anyio.to_thread.run_sync(gate.wait)  # done only once its callback is added: it runs on the loop
            return await real(sampler_id, request)

        monkeypatch.setattr(backend, "sample", sample)
        held = sc.sample([1, 2])
        said: list[bool] = []
        fast = sc.sample([1])
        fast.future().add_done_callback(lambda _: said.append(held.cancel()))
        gate.set()
        fast.result()
        with pytest.raises(OperationCancelledError):
            held.result()
        assert said == [True] and held.cancelled()


async def test_closing_the_service_client_from_a_nested_task_while_ops_are_in_flight():
    """``await svc.close()`` from a task group nested in the ``async with`` block (or from another task) exited the
    client's own task group out of order: a bare RuntimeError from anyio's internals on asyncio, trio's
    'Nursery misnesting detected' on trio. Each awaiter now gets a typed error and the pool is empty."""
    from asyncsess import OperationCancelledError

    errors: list[BaseException] = []
    async with ServiceClient("mock://?latency_ms=60000") as svc:
        sc = await svc.create_sampling_client(base_model="m")
        tc = await svc.create_lora_training_client("m", rank=4)
        futs = [sc.sample([1, 2]) for _ in range(5)] + [tc.forward_backward([sft_datum([1, 40, 41])])]
        ids = {sc.sampler_id, tc.model_id}

        async def wait(fut) -> None:
            try:
                await fut
            except OperationCancelledError as err:
                errors.append(err)

        async with anyio.create_task_group() as tg:
            for fut in futs:
                tg.start_soon(wait, fut)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(svc.close)
        assert sc.stats().in_flight == 0 and not ids & set(MockBackend.open_sessions())
    assert len(errors) == 6 and all("the ServiceClient was closed before it finished" in str(e) for e in errors)


async def test_the_blocking_clients_async_twins_can_be_awaited_under_trio_too():
    """Tinker's ``*_async`` methods of the blocking clients awaited an asyncio future: under trio that was a
    TypeError from trio's internals ('unrecognized yield message'); and the facade's loop ran the call in the trio
    caller's context, where anyio took that asyncio loop for trio."""
    from asyncsess.sync import ServiceClient as SyncServiceClient

    with SyncServiceClient("mock://") as svc:
        sc = svc.create_sampling_client(base_model="m")
        assert len(sc.sample([1, 2], 2).result().sequences) == 2  # a blocking call made in a trio run, too
        assert len((await sc.sample_async([1, 2], 2)).sequences) == 2
        assert (await svc.get_server_capabilities_async()).supported_models
        tc = svc.create_lora_training_client("m", rank=4)
        fut = await tc.forward_backward_async([sft_datum([1, 40, 41])])
        assert (await fut).loss > 0 and fut.seq == 1


async def test_cancel_that_said_true_always_ends_cancelled_even_when_the_answer_was_already_on_its_way(monkeypatch):
    """A sample whose answer had arrived (its task woken, not yet run) when ``cancel()`` was called: cancel() said
    True, and on trio the future then ended with the result."""
    from asyncsess import OperationCancelledError

    async with ServiceClient("mock://") as svc:
        sc = await svc.create_sampling_client(base_model="m")
        real = svc.backend.sample
        gate, entered = anyio.Event(), anyio.Event()

        async def sample(sampler_id, request):
            answer = await real(sampler_id, request)
            entered.set()
            await gate.wait()
            return answer

        monkeypatch.setattr(svc.backend, "sample", sample)
        fut = sc.sample([1, 2])
        await entered.wait()
        gate.set()  # the answer is on its way: the task is woken...
        assert fut.cancel() is True  # ...and cancelled before it runs again
        with pytest.raises(OperationCancelledError):
            await fut
        assert fut.cancelled() and sc.stats().in_flight == 0


async def test_awaiting_many_blocking_futures_takes_no_worker_threads(monkeypatch):
    """Each ``await`` of an ``asyncsess.sync`` future waited in a worker thread: 40 of them held anyio's 40 threads,
    so the 41st await (and any other ``to_thread`` work of the program) stalled until one of them finished."""
    from asyncsess.sync import ServiceClient as SyncServiceClient

    with SyncServiceClient("mock://") as svc:
        sc = svc.create_sampling_client(base_model="m")
        backend = svc._async.backend
        real = backend.sample

        async def sample(sampler_id, request):
            if request.prompt == (1, 2):
                await anyio.sleep_forever()  # held until cancelled
            return await real(sampler_id, request)

        monkeypatch.setattr(backend, "sample", sample)
        held = [sc.sample([1, 2]) for _ in range(41)]
        async with anyio.create_task_group() as tg:
            for fut in held:
                tg.start_soon(fut.result_async)
            await anyio.wait_all_tasks_blocked()
            assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
            assert (await sc.sample([1]).result_async()).sequences
            tg.cancel_scope.cancel()
        assert all(fut.cancel() for fut in held)
