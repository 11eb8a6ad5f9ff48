import concurrent.futures

import pytest

from asyncsess import AdamParams, DeadlineExceededError, InvalidStateError, OperationCancelledError, SamplingParams, ServiceClient

from .helpers import sft_datum

pytestmark = pytest.mark.anyio


async def test_future_exists_at_call_time_and_pipelines():
    async with ServiceClient("mock://?latency_ms=30") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        f1 = tc.forward_backward([sft_datum([1, 40, 41, 42])], "cross_entropy")
        f2 = tc.optim_step(AdamParams(learning_rate=0.1))
        assert (f1.seq, f2.seq) == (1, 2) and not f1.done()
        with pytest.raises(InvalidStateError):
            f1.result()
        out, step = await f1, await f2
        assert out.metrics["loss:sum"] > 0 and out.loss == out.metrics["loss:sum"]
        assert f1.done() and f1.exception() is None and step.metrics is not None
        assert out.usage.training_tokens == 3


async def test_result_async_timeout_and_cancel():
    async with ServiceClient("mock://?latency_ms=300") as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        fut = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        with pytest.raises(DeadlineExceededError):
            await fut.result_async(timeout=0.01)
        assert fut.cancel() is True
        with pytest.raises(OperationCancelledError):
            await fut
        assert fut.cancelled() and fut.cancel() is False


async def test_ordered_training_ops_cannot_be_withdrawn():
    async with ServiceClient("mock://?latency_ms=50") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fut = tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy")
        assert fut.cancel() is False
        assert (await fut).metrics["loss:sum"] > 0


async def test_done_callbacks_run_once_settled():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        seen = []
        fut = tc.forward([sft_datum([1, 40, 41])], "cross_entropy")
        fut.add_done_callback(lambda f: seen.append(f.seq))
        await fut
        assert seen == [1]


async def test_future_gives_a_concurrent_future_and_cancelling_it_withdraws_the_work():
    """Tinker's APIFuture.future() (a concurrent.futures.Future for blocking code: wait, as_completed,
    add_done_callback) was missing from asyncsess's futures, and so was get_telemetry()."""
    async with ServiceClient("mock://?latency_ms=300") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fb = tc.forward_backward([sft_datum([1, 40, 41])], "cross_entropy")
        cf = fb.future()
        assert isinstance(cf, concurrent.futures.Future) and fb.future() is cf and not cf.done()
        out = await fb
        assert cf.done() and cf.result() is out and fb.get_telemetry() is None
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        sample = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        assert sample.future().cancel() and sample.future().cancelled()
        with pytest.raises(OperationCancelledError):
            await sample  # withdrawn, as sample.cancel() withdraws it
        unstarted = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        assert unstarted.cancel() is True  # before its task started it returned False and the sample ran
        with pytest.raises(OperationCancelledError):
            await unstarted
        late = tc.forward([sft_datum([1, 40, 41])], "cross_entropy")
        assert late.future().cancel() and late.future().cancelled()  # an ordered op keeps its place: it still runs
        assert (await late).loss == pytest.approx(out.loss) and not late.cancelled()


@pytest.mark.parametrize("latency", [0, 30])
async def test_a_request_cancelled_before_its_task_started_is_never_sent(latency, monkeypatch):
    """On a backend that answers without yielding (mock:// with no latency), cancel() said True yet the sample ran to
    the end and the future held its result: a withdrawn request must not be sent."""
    async with ServiceClient(f"mock://?latency_ms={latency}") as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        sent = []
        real = svc.backend.sample

        async def spy(sampler_id, request):
            sent.append(request)
            return await real(sampler_id, request)

        monkeypatch.setattr(svc.backend, "sample", spy)
        fut = sc.sample([1, 40], 1, SamplingParams(max_tokens=2))
        assert fut.cancel() is True
        with pytest.raises(OperationCancelledError):
            await fut
        with pytest.raises(OperationCancelledError):  # awaited again: the same outcome
            await fut
        assert fut.cancelled() and sent == []
        assert len((await sc.sample([1, 40], 1, SamplingParams(max_tokens=2))).sequences) == 1 and len(sent) == 1


async def test_a_future_refuses_pickling_by_name_and_its_result_pickles():
    """Pickling a future failed deep inside (cannot pickle '_asyncio.Task') or, once done, pickled a dead handle."""
    import pickle

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        fut = tc.forward([sft_datum([1, 40, 41])], "cross_entropy")
        with pytest.raises(TypeError, match="cannot be pickled: pickle its result"):
            pickle.dumps(fut)
        out = await fut
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(fut)
        assert pickle.loads(pickle.dumps(out)).loss == out.loss
