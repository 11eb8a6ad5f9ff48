"""Exactly-once, in-order execution through the backend (the Sequencer behind execute_training)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncsess.backends import OptimStepOp
from asyncsess.errors import ConflictError, InvalidInputError, PoisonedError, SessionGoneError, TransientError
from asyncsess.types import AdamParams
from asyncsess_mock import MockBackend, MockConfig

HP = AdamParams(learning_rate=0.1)


def _ops(session, tok, datum, n_steps=2):
    ops = []
    for i in range(n_steps):
        data = (datum(tok.encode(f"step {i} text")),)
        ops.append(session.op("forward_backward", data=data, loss_fn="cross_entropy"))
        ops.append(session.op("optim_step", adam_params=HP))
    return ops


@pytest.mark.anyio
async def test_out_of_order_delivery_executes_in_seq_order(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    ops = _ops(s, b.tokenizer, datum, 3)
    results: dict[int, object] = {}
    arrivals: list[int] = []

    async def deliver(op, delay):
        await anyio.sleep(delay)
        arrivals.append(op.seq)
        results[op.seq] = await b.execute_training(s.id, op)

    async with anyio.create_task_group() as tg:
        for op, delay in zip(ops, [0.03, 0.0, 0.05, 0.01, 0.02, 0.04]):
            tg.start_soon(deliver, op, delay)
    assert arrivals != sorted(arrivals)
    assert [seq for _, seq, _ in b.applied_log] == [1, 2, 3, 4, 5, 6]

    ref = await open_session(b)
    for op in _ops(ref, b.tokenizer, datum, 3):
        await b.execute_training(ref.id, op)
    np.testing.assert_array_equal(b.weights(s.id), b.weights(ref.id))
    assert results[6].step == 3
    await b.stop_session(s.id)
    await b.stop_session(ref.id)


@pytest.mark.anyio
async def test_duplicate_delivery_is_applied_once(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    op = _ops(s, b.tokenizer, datum, 1)[0]
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(b.execute_training, s.id, op)
    again = await b.execute_training(s.id, op)
    assert b.applied_log == [(s.id, 1, "forward_backward")]
    g = b.trainer(s.id).grad.copy()
    single = await open_session(b)
    ref = await b.execute_training(single.id, _ops(single, b.tokenizer, datum, 1)[0])
    np.testing.assert_array_equal(g, b.trainer(single.id).grad)  # not accumulated 4 times
    assert again.metrics == ref.metrics
    with pytest.raises(ConflictError) as err:
        await b.execute_training(s.id, OptimStepOp(seq=1, idempotency_key="another-key"))
    assert err.value.field == "seq"
    await b.stop_session(s.id)
    await b.stop_session(single.id)


@pytest.mark.anyio
async def test_dropped_response_then_retry_gets_the_stored_result(open_session, datum):
    b = MockBackend(MockConfig(drop_response_rate=0.7, seed=4))
    s = await open_session(b)
    drops = 0
    for op in _ops(s, b.tokenizer, datum, 2):
        for _ in range(50):  # the client's retry loop, same seq + key every time
            try:
                await b.execute_training(s.id, op)
                break
            except TransientError:
                drops += 1
    assert drops >= 2
    assert [seq for _, seq, _ in b.applied_log] == [1, 2, 3, 4]

    clean = MockBackend()
    ref = await open_session(clean)
    for op in _ops(ref, clean.tokenizer, datum, 2):
        await clean.execute_training(ref.id, op)
    np.testing.assert_array_equal(b.weights(s.id), clean.weights(ref.id))
    await b.stop_session(s.id)
    await clean.stop_session(ref.id)


@pytest.mark.anyio
async def test_a_failed_op_poisons_later_ops(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    bad = s.op("forward_backward", data=(datum([1, 2, 999]),), loss_fn="cross_entropy")
    later = s.op("optim_step", adam_params=HP)
    with pytest.raises(InvalidInputError):
        await b.execute_training(s.id, bad)
    with pytest.raises(PoisonedError) as err:
        await b.execute_training(s.id, later)
    assert isinstance(err.value.cause, InvalidInputError) and err.value.seq == 2
    with pytest.raises(InvalidInputError):  # the failed op's retry gets its stored error
        await b.execute_training(s.id, bad)
    assert b.applied_log == [] and not b.weights(s.id).any()
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_gap_timeout_and_stop_while_waiting(open_session, datum):
    b = MockBackend(MockConfig(gap_timeout_s=0.05))
    s = await open_session(b)
    first, second = _ops(s, b.tokenizer, datum, 1)
    with pytest.raises(TransientError):
        await b.execute_training(s.id, second)  # seq 1 never came
    await b.execute_training(s.id, first)
    await b.execute_training(s.id, second)  # the retry after the gap closed
    assert [seq for _, seq, _ in b.applied_log] == [1, 2]

    slow = MockBackend(MockConfig(gap_timeout_s=30))
    t = await open_session(slow)
    _, waiting = _ops(t, slow.tokenizer, datum, 1)
    outcome: list[BaseException] = []

    async def wait_for_gap():
        try:
            await slow.execute_training(t.id, waiting)
        except SessionGoneError as err:
            outcome.append(err)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_gap)
        await anyio.sleep(0.01)
        await slow.stop_session(t.id)
    assert len(outcome) == 1
    await slow.stop_session(t.id)  # idempotent
    await b.stop_session(s.id)
