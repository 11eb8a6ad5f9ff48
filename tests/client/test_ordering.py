"""The training queue: call order is execution order, each op exactly once, failures poison what follows."""

import random

import anyio
import pytest

from asyncsess import AdamParams, PoisonedError, ServiceClient
from asyncsess.backend import TrainingOp

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
    from asyncsess.sequencer import Sequencer

    async def run(op):
        return op.seq * 10

    seqr = Sequencer(run, keep_results=3)
    ops = [TrainingOp("optim_step", i, f"k{i}") for i in range(1, 7)]
    assert [await seqr.execute(op) for op in ops] == [10, 20, 30, 40, 50, 60]
    assert await seqr.execute(ops[-1]) == 60 and await seqr.execute(ops[3]) == 40  # recent: stored result
    with pytest.raises(ConflictError):
        await seqr.execute(ops[0])  # pruned: refused, never re-run
    assert seqr.applied == [1, 2, 3, 4, 5, 6]
