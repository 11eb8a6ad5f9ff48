"""The generated blocking facade: fresh, faithful to the async API, ordered, concurrent, thread-safe."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest

from asyncsess import FacadeMisuseError, client
from asyncsess import sync as sync_api
from asyncsess.rl.data import sft_datum

from ..client.helpers import count_concurrency

ROOT = Path(__file__).resolve().parents[2]


def test_generated_file_is_up_to_date():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_sync
    finally:
        sys.path.pop(0)
    assert gen_sync.generate() == (ROOT / "src/asyncsess/sync.py").read_text(), "run: python scripts/gen_sync.py"


@pytest.mark.parametrize("name", ["ServiceClient", "TrainingClient", "SamplingClient"])
def test_blocking_docstrings_do_not_tell_users_to_await(name):
    """Docstrings are copied from the async classes and rewritten for blocking use."""
    async_doc = inspect.getdoc(getattr(client, name)) or ""
    sync_cls = getattr(sync_api, name)
    docs = [inspect.getdoc(sync_cls) or ""] + [
        inspect.getdoc(m) or "" for m in vars(sync_cls).values() if callable(m) or isinstance(m, property)
    ]
    for doc in docs:
        for phrase in ("async with", "async for", "await "):
            assert phrase not in doc, (name, phrase, doc)
    if "async with" in async_doc:  # the rewrite kept the sentence, minus the async
        assert async_doc.replace("async with", "with") == inspect.getdoc(sync_cls)


@pytest.mark.parametrize("name", ["ServiceClient", "TrainingClient", "SamplingClient"])
def test_every_public_async_method_has_a_twin_with_the_same_parameters(name):
    async_cls, sync_cls = getattr(client, name), getattr(sync_api, name)
    renames = {"aclose": "close"}
    async_only = {"attach", "from_sampler_handle"}  # reopening an unpickled async client; the sync twin unpickles ready to use
    for attr, member in async_cls.__dict__.items():
        if attr.startswith("_") or not inspect.isfunction(member) or attr in async_only:
            continue
        twin = getattr(sync_cls, renames.get(attr, attr))
        if attr.endswith("_async"):  # the anchors' coroutine spellings, which Tinker's blocking clients have too
            assert inspect.iscoroutinefunction(twin), attr
            assert list(inspect.signature(member).parameters) == list(inspect.signature(twin).parameters), attr
            continue
        if attr in renames:
            continue
        if attr == "close":  # same parameters; the sync twin also closes the facade's hold on the client
            assert list(inspect.signature(member).parameters) == list(inspect.signature(twin).parameters)
            continue
        a, s = inspect.signature(member), inspect.signature(twin)
        assert [(p.name, p.kind, p.default) for p in a.parameters.values()] == [
            (p.name, p.kind, p.default) for p in s.parameters.values()
        ], attr
        assert inspect.getdoc(member) == inspect.getdoc(twin)
        assert not inspect.iscoroutinefunction(twin)
    a_init, s_init = inspect.signature(async_cls.__init__), inspect.signature(sync_cls.__init__)
    if name == "ServiceClient":
        assert list(a_init.parameters.items()) == list(s_init.parameters.items())


def _final_weights(path: str) -> np.ndarray:
    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_training_client_from_state(path)
        return svc.backend.weights(tc.model_id)


def test_blocking_loop_gives_the_same_weights_as_the_async_loop():
    from examples.grpo_toy import train
    from examples.sagemaker_grpo_sync import run

    sync_path = run("mock://", num_steps=4, learning_rate=0.3, seed=7)
    _, async_path = anyio.run(lambda: train("mock://", steps=4, lr=0.3, seed=7))
    w_sync, w_async = _final_weights(sync_path), _final_weights(async_path)
    assert np.abs(w_sync).max() > 0
    assert np.array_equal(w_sync, w_async)


def test_async_twins_run_from_another_event_loop():
    """Tinker's blocking clients also have ``*_async`` methods, which code on its own loop awaits
    (tinker-cookbook's ``save_checkpoint`` runs ``asyncio.run`` over ``save_state_async``): they run on the
    facade's loop, ops keep their order with blocking calls, and their futures are awaitable there too."""
    import asyncio

    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        datum = sft_datum([1, 40], [41])

        async def step():
            first = await tc.forward_backward_async([datum])
            optim = await tc.optim_step_async(sync_api.AdamParams(learning_rate=0.5))
            saved = await tc.save_state_async("after-one")
            sc = await tc.save_weights_and_get_sampling_client_async()
            sample = await sc.sample_async([1, 40], 1, sync_api.SamplingParams(max_tokens=2))
            return await first, await optim.result_async(), (await saved).path, sc, sample

        first, _, path, sc, sample = asyncio.run(step())
        again = tc.forward_backward([datum]).result()
        assert [seq for sid, seq, _ in svc.backend.applied_log if sid == tc.model_id] == [1, 2, 3, 4, 5]
        assert again.loss < first.loss, "the optimizer step ran between the two"
        assert path.endswith("after-one") and isinstance(sc, sync_api.SamplingClient)
        assert len(sample.sequences) == 1


def test_futures_execute_in_call_order_and_samples_run_concurrently(monkeypatch):
    with sync_api.ServiceClient("mock://?latency_ms=100") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        futs = [tc.forward_backward([sft_datum([1, 40], [41 + i])]) if i % 2 == 0 else tc.optim_step() for i in range(6)]
        assert [f.seq for f in futs] == [1, 2, 3, 4, 5, 6]
        for f in futs:
            f.result()
        assert [seq for sid, seq, _ in svc.backend.applied_log if sid == tc.model_id] == [1, 2, 3, 4, 5, 6]

        sc = svc.create_sampling_client(base_model="mock/bigram-tiny")
        hold = threading.Event()
        state = count_concurrency(svc.backend, monkeypatch, hold=hold)
        samples = [sc.sample([1, 40], 1, sync_api.SamplingParams(max_tokens=2)) for _ in range(32)]
        assert all(not f.done() for f in samples), "submission must not wait for the result"
        for _ in range(5000):  # liveness only: all 32 reach the backend while none has finished
            if state["now"] == 32:
                break
            hold.wait(0.002)
        assert state["now"] == 32, "all 32 are in flight at once: about one latency, not 32 (timed in bench/)"
        hold.set()
        results = [f.result() for f in samples]
        assert len(results) == 32 and all(len(r.sequences) == 1 for r in results)
        assert state["now"] == 0 and state["peak"] == 32


def test_eight_threads_drive_their_own_training_clients():
    errors: list[BaseException] = []
    results: dict[int, float] = {}

    def worker(i: int) -> None:
        try:
            with sync_api.ServiceClient("mock://?latency_ms=5") as svc:
                tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
                losses = []
                for _ in range(5):
                    out = tc.forward_backward([sft_datum([1, 40 + i], [50 + i, 51 + i])])
                    tc.optim_step(sync_api.AdamParams(learning_rate=0.2))
                    losses.append(out.result().metrics["loss:sum"])
                assert losses[-1] < losses[0]
                results[i] = losses[-1]
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == list(range(8))


def test_result_on_the_facades_own_loop_raises_instead_of_deadlocking():
    from asyncsess import _facade

    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fut = tc.forward_backward([sft_datum([1, 40], [41])])
        fut.result()
        pending = tc.optim_step()

        def misuse():  # runs on the facade's loop thread, as a callback in user code would
            return pending.result()

        with pytest.raises(FacadeMisuseError, match="deadlock"):
            _facade.call(lambda: _facade._get_portal() and misuse())
        pending.result()


def test_works_in_a_fresh_interpreter_and_under_a_running_loop():
    """A plain script, and a 'notebook' whose main thread already runs an event loop."""
    code = (
        "import asyncio\n"
        "from asyncsess.sync import ServiceClient\n"
        "from asyncsess.rl.data import sft_datum\n"
        "async def cell():\n"
        "    svc = ServiceClient('mock://')\n"
        "    tc = svc.create_lora_training_client('m', rank=4)\n"
        "    print(tc.forward_backward([sft_datum([1, 40], [41])]).result().metrics['loss:sum'] > 0)\n"
        "asyncio.run(cell())\n"  # the session is stopped at interpreter exit
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_futures_have_tinkers_surface_and_cancelling_the_concurrent_future_withdraws_the_op(monkeypatch):
    """Tinker's futures also give future() (a concurrent.futures.Future: cancelling it cancels the operation),
    coroutine(), result_async() and await. Cancelling the Future that future() returned left the sample running, and
    when the op settled, copying its outcome into the cancelled Future raised InvalidStateError inside the client."""
    import asyncio
    import concurrent.futures

    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fb = tc.forward_backward([sft_datum([1, 40], [41])])
        done, _ = concurrent.futures.wait([fb.future()])
        assert done == {fb.future()} and fb.future().result() is fb.result() and fb.get_telemetry() is None
        assert asyncio.run(fb.coroutine()) is fb.result()
        step = tc.optim_step()
        assert anyio.run(step.result_async) is step.result()

        async def awaited():
            return await tc.forward([sft_datum([1, 40], [41])])

        assert anyio.run(awaited).loss > 0
        sc = svc.create_sampling_client(base_model="mock/bigram-tiny")
        hold = threading.Event()
        state = count_concurrency(svc.backend, monkeypatch, hold=hold)
        sample = sc.sample([1, 40], 1, sync_api.SamplingParams(max_tokens=2))
        for _ in range(5000):  # liveness only
            if state["now"] == 1:
                break
            hold.wait(0.002)
        assert sample.future().cancel() and sample.cancelled()
        for _ in range(5000):  # liveness only: the withdrawn sample leaves the backend without being let through
            if state["now"] == 0:
                break
            hold.wait(0.002)
        assert state["now"] == 0 and isinstance(sample._fut.exception(), sync_api.OperationCancelledError)
        with pytest.raises(concurrent.futures.CancelledError):
            sample.result()
        hold.set()
        assert len(sc.sample([1, 40], 1, sync_api.SamplingParams(max_tokens=2)).result().sequences) == 1


def test_a_sync_future_refuses_pickling_by_name():
    """Pickling a SyncFuture failed on an internal lock (cannot pickle '_thread.RLock'); it names what to pickle."""
    import pickle

    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fut = tc.forward([sft_datum([1, 40], [41])], "cross_entropy")
        out = fut.result()
        with pytest.raises(TypeError, match="cannot be pickled: pickle its result"):
            pickle.dumps(fut)
        assert pickle.loads(pickle.dumps(out)).loss == out.loss


def test_a_custom_loss_that_blocks_on_the_facade_fails_typed_and_the_client_goes_on():
    """A sync loss fn that calls a blocking op of the same facade runs on the facade's loop, where it would
    deadlock: it fails as an InvalidInputError naming loss_fn (cause: FacadeMisuseError), and nothing is poisoned."""
    pytest.importorskip("torch")
    with sync_api.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        d = sft_datum([1, 40], [41])

        def loss(data, logprobs):
            tc.forward([d], "cross_entropy").result()
            return -logprobs[0].sum(), {}

        with pytest.raises(client.InvalidInputError) as err:
            tc.forward_backward_custom([d], loss).result()
        assert err.value.field == "loss_fn" and isinstance(err.value.__cause__, FacadeMisuseError)
        assert tc.forward_backward([d], "cross_entropy").result().loss > 0


@pytest.mark.parametrize("timeout", [1e10, 10**400], ids=["1e10", "10**400"])
def test_a_timeout_longer_than_a_thread_can_wait_is_no_limit(timeout):
    """result(timeout=1e10) on a pending future raised OverflowError ('timeout value is too large': a thread waits
    at most threading.TIMEOUT_MAX, ~292 years); 10**400 raised OverflowError from the timeout check itself."""
    with sync_api.ServiceClient("mock://?latency_ms=50") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fb = tc.forward([sft_datum([1, 40], [41])])
        assert not fb.done() and fb.result(timeout=timeout).loss > 0
        step = tc.optim_step()
        assert not step.done() and step.exception(timeout=timeout) is None
        assert anyio.run(tc.forward([sft_datum([1, 40], [41])]).result_async, timeout).loss > 0
