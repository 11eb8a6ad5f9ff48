"""The training queue: call order is execution order, each op exactly once, failures poison what follows."""

import random

import anyio
import pytest

from asyncsess import AdamParams, PoisonedError, ServiceClient
from asyncsess.backends import OptimStepOp, TrainingOp

from .helpers import random_tokens, sft_datum

pytestmark = pytest.mark.anyio


async def test_racing_callers_execute_in_call_order_exactly_once():
    async with ServiceClient("mock://?latency_ms=5&jitter_ms=5&seed=3") as svc:
        clients = [await svc.create_lora_training_client("mock/bigram-tiny", rank=4) for _ in range(3)]
        issued: dict[str, list[tuple[int, str]]] = {tc.model_id: [] for tc in clients}
        futures = []

        async def caller(worker: int) -> None:
            rng = random.Random(worker)
            for _ in range(10):
                tc = rng.choice(clients)
                if rng.random() < 0.6:
                    fut = tc.forward_backward([sft_datum(random_tokens(rng, 6))], "cross_entropy")
                else:
                    fut = tc.optim_step(AdamParams(learning_rate=1e-3))
                issued[tc.model_id].append((fut.seq, fut.operation))
                futures.append(fut)
                await anyio.sleep(rng.random() * 0.003)

        async with anyio.create_task_group() as tg:
            for w in range(8):
                tg.start_soon(caller, w)
        for fut in futures:
            await fut
        log = svc.backend.applied_log
        for tc in clients:
            seen = [(seq, kind) for sid, seq, kind in log if sid == tc.model_id]
            assert seen == sorted(issued[tc.model_id]), "backend must apply each op once, in call order"
            assert [s for s, _ in seen] == list(range(1, len(seen) + 1))


async def test_failed_op_poisons_the_ops_queued_behind_it(monkeypatch):
    async with ServiceClient("mock://?latency_ms=20") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        real = svc.backend.execute_training

        async def failing(session_id: str, op: TrainingOp):
            if op.seq == 2:
                raise RuntimeError("disk on fire")
            return await real(session_id, op)

        monkeypatch.setattr(svc.backend, "execute_training", failing)
        f1 = tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy")
        f2 = tc.optim_step(AdamParams())
        f3 = tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy")
        await f1
        with pytest.raises(RuntimeError, match="disk on fire"):
            await f2
        with pytest.raises(PoisonedError, match="disk on fire") as err:
            await f3
        assert err.value.seq == 3 and isinstance(err.value.cause, RuntimeError)
        late = tc.optim_step(AdamParams())  # new calls fail fast, naming the cause
        with pytest.raises(PoisonedError, match="disk on fire"):
            await late
        assert [seq for _, seq, _ in svc.backend.applied_log] == [1]


async def test_sequencer_keeps_a_bounded_window_of_results():
    from asyncsess import ConflictError
    from asyncsess.backends.sequencer import Sequencer

    async def run(op):
        return op.seq * 10

    seqr = Sequencer(run, keep_results=3)
    ops = [OptimStepOp(seq=i, idempotency_key=f"k{i}") for i in range(1, 7)]
    assert not any(seqr.stored(op) for op in ops)
    assert [await seqr.execute(op) for op in ops] == [10, 20, 30, 40, 50, 60]
    assert [seqr.stored(op) for op in ops] == [False, False, False, True, True, True], "the kept window, nothing older"
    assert not seqr.stored(OptimStepOp(seq=6, idempotency_key="another-key")), "another key is not a re-delivery"
    assert await seqr.execute(ops[-1]) == 60 and await seqr.execute(ops[3]) == 40  # recent: stored result
    with pytest.raises(ConflictError):
        await seqr.execute(ops[0])  # pruned: refused, never re-run
    assert seqr.applied == [1, 2, 3, 4, 5, 6]


async def test_sequencer_stored_means_done_not_merely_arrived():
    from asyncsess.backends.sequencer import Sequencer

    release = anyio.Event()

    async def run(op):
        await release.wait()
        if op.seq == 2:
            raise ValueError("bad op")
        return op.seq

    seqr = Sequencer(run)
    first, second, early = (OptimStepOp(seq=i, idempotency_key=f"k{i}") for i in (1, 2, 4))
    async with anyio.create_task_group() as tg:
        tg.start_soon(seqr.execute, first)
        tg.start_soon(seqr.execute, early)  # waits for 2 and 3
        await anyio.wait_all_tasks_blocked()
        assert not seqr.stored(first), "running: a re-delivery would wait for it, not fetch it"
        assert not seqr.stored(early), "waiting for its turn"
        release.set()
        await anyio.wait_all_tasks_blocked()
        assert seqr.stored(first)
        tg.cancel_scope.cancel()
    with pytest.raises(ValueError):
        await seqr.execute(second)
    assert seqr.stored(second), "a failure is stored too: its re-delivery gets the same error"
    assert not seqr.stored(early), "a cancelled wait frees its slot for a retry"


async def test_large_batches_are_chunked_and_train_like_one_batch():
    import numpy as np

    rng = random.Random(0)
    batch = [sft_datum(random_tokens(rng, 8)) for _ in range(25)]
    async with ServiceClient("mock://", max_chunk_datums=10) as svc:
        whole = await svc.create_lora_training_client("m", rank=4)
        chunked = await svc.create_lora_training_client("m", rank=4)
        svc.max_chunk_datums = 1024
        out_whole = await whole.forward_backward(batch, "cross_entropy")
        await whole.optim_step(AdamParams(learning_rate=0.1))
        svc.max_chunk_datums = 10
        fut = chunked.forward_backward(batch, "cross_entropy")
        assert fut.seq == 1 and chunked.current_sequence_number == 3, "25 datums in chunks of 10: three ops"
        out_chunked = await fut
        await chunked.optim_step(AdamParams(learning_rate=0.1))
        assert len(out_chunked.loss_fn_outputs) == 25
        assert out_chunked.metrics["loss:sum"] == pytest.approx(out_whole.metrics["loss:sum"], rel=1e-9)
        assert out_chunked.usage.training_tokens == out_whole.usage.training_tokens
        for a, b in zip(out_chunked.loss_fn_outputs, out_whole.loss_fn_outputs):
            assert a["logprobs"].data == b["logprobs"].data
        np.testing.assert_allclose(svc.backend.weights(chunked.model_id), svc.backend.weights(whole.model_id), atol=1e-12)


async def test_a_refused_seq_is_void_its_turn_passes_and_nothing_is_poisoned():
    from asyncsess import InvalidInputError
    from asyncsess.backends.sequencer import Sequencer

    async def run(op):
        return op.seq

    seqr = Sequencer(run)
    ops = [OptimStepOp(seq=i, idempotency_key=f"k{i}") for i in (1, 2, 3, 4)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(seqr.execute, ops[3])  # waits for 2 and 3
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(InvalidInputError) as err:
            seqr.refuse(ops[2], InvalidInputError("no such path", field="path"))  # ahead of its turn: answered at once
        assert err.value.void and err.value.seq == 3
        assert await seqr.execute(ops[0]) == 1
        with pytest.raises(InvalidInputError) as err2:
            seqr.refuse(ops[1], InvalidInputError("bad", field="data"))  # at its turn
    assert seqr.applied == [1, 4], "the refused turns ran nothing and blocked nothing"
    with pytest.raises(InvalidInputError) as again:
        await seqr.execute(ops[1])
    assert again.value is err2.value, "a re-delivery gets the same refusal"
    assert seqr.refuse(ops[1], InvalidInputError("x")) is None, "a seq no longer free is left to execute"
    assert await seqr.execute(OptimStepOp(seq=5, idempotency_key="k5")) == 5, "nothing is poisoned"


async def test_skip_gaps_voids_the_seqs_that_never_arrived_and_runs_the_rest_in_order():
    """A server whose clients never re-send a number they gave up on (the Tinker door) goes on without it after
    the gap timeout; an op that did arrive keeps its turn. 1,000+ missing numbers in a row are skipped too."""
    from asyncsess import ConflictError
    from asyncsess.backends.sequencer import Sequencer

    async def run(op):
        return op.seq

    seqr = Sequencer(run, gap_timeout=0.01, skip_gaps=True)
    assert await seqr.execute(OptimStepOp(seq=1, idempotency_key="k1")) == 1
    results: list[int] = []

    async def execute(seq: int) -> None:
        results.append(await seqr.execute(OptimStepOp(seq=seq, idempotency_key=f"k{seq}")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(execute, 5)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(execute, 1200)
    assert results == [5, 1200] and seqr.applied == [1, 5, 1200]
    assert seqr.skipped == set(range(2, 5)) | set(range(6, 1200)) and seqr.next_seq == 1201
    with pytest.raises(ConflictError):
        await seqr.execute(OptimStepOp(seq=3, idempotency_key="k3"))  # came too late: never run
    assert await seqr.execute(OptimStepOp(seq=1201, idempotency_key="k1201")) == 1201


async def test_a_void_refusal_of_one_part_of_a_split_batch_poisons_the_rest(monkeypatch):
    """The other parts ran: the batch was half-applied, so the ops after it must not run as if it had not."""
    from asyncsess import InvalidInputError

    async with ServiceClient("mock://", max_chunk_datums=1) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        real = svc.backend.execute_training

        async def refusing(session_id: str, op: TrainingOp):
            if op.seq == 2:
                raise InvalidInputError("refused", field="data", void=True)
            return await real(session_id, op)

        monkeypatch.setattr(svc.backend, "execute_training", refusing)
        batch = tc.forward_backward([sft_datum([1, 2, 3]), sft_datum([4, 5, 6]), sft_datum([7, 8, 9])], "cross_entropy")
        step = tc.optim_step(AdamParams())
        with pytest.raises(InvalidInputError):
            await batch
        with pytest.raises(PoisonedError, match="half-applied"):
            await step


async def test_a_redelivery_of_another_op_under_the_same_seq_and_key_is_a_conflict():
    """The same ``(seq, key)`` with another kind or checkpoint was answered with the first op's result (an
    optim_step got a forward's outputs, a save of "b" the path of "a"): a ConflictError naming the key."""
    from asyncsess import ConflictError
    from asyncsess.backends import LoadStateOp, SaveStateOp
    from asyncsess.backends.sequencer import Sequencer

    async def run(op):
        return (op.kind, getattr(op, "name", None))

    seqr = Sequencer(run)
    assert await seqr.execute(SaveStateOp(seq=1, idempotency_key="k", name="a")) == ("save_state", "a")
    for other in (
        OptimStepOp(seq=1, idempotency_key="k"),
        SaveStateOp(seq=1, idempotency_key="k", name="b"),
        LoadStateOp(seq=1, idempotency_key="k", path="a"),
    ):
        with pytest.raises(ConflictError) as err:
            await seqr.execute(other)
        assert err.value.field == "idempotency_key" and err.value.seq == 1
    assert await seqr.execute(SaveStateOp(seq=1, idempotency_key="k", name="a")) == ("save_state", "a"), "a true retry"
    assert seqr.applied == [1]
