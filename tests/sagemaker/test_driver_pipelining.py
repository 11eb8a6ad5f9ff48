"""Pipelined submission: ops are numbered in order and sent without waiting for earlier acknowledgements."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import asyncsess
from asyncsess.errors import InvalidInputError
from asyncsess.types import AdamParams, Datum, ModelInput
from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator

from .helpers import clients, driver_url

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"
GOOD = [Datum(model_input=ModelInput.from_ints([1, 40, 41]), loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0] * 3})]
# Past the vocabulary (105): refused by the service (ValidationException) where the hub publishes no VocabSize.
OUT_OF_VOCAB = [Datum(model_input=ModelInput.from_ints([1, 9999]), loss_fn_inputs={"target_tokens": [9999, 2], "weights": [1.0] * 2})]


class _Gate:
    """Wraps ``execute_training_operation``: sequence number 1 is held until number 2 was acknowledged and the test lets go."""

    def __init__(self, execute: Any) -> None:
        self.execute = execute
        self.second_acked = threading.Event()
        self.release = threading.Event()

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs["sequenceNumber"] == 1:
            self.second_acked.wait(10)  # with one submission in flight at a time, number 2 never comes: the test fails below
            self.release.wait(10)
            return self.execute(**kwargs)
        out = self.execute(**kwargs)
        if kwargs["sequenceNumber"] == 2:
            self.second_acked.set()
        return out


async def test_a_later_op_is_sent_before_an_earlier_one_is_acknowledged(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        gate = _Gate(svc.backend.runtime.execute_training_operation)
        svc.backend.runtime.execute_training_operation = gate
        fb = tc.forward_backward(GOOD, "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=0.01))
        with anyio.fail_after(10):
            while not gate.second_acked.is_set():
                await anyio.sleep(0.005)
        sm, _ = clients(emulator.url)
        assert sm.describe_training_session(TrainingSessionName=tc.model_id)["TrainingSessionDetail"]["TrainingSessionStatus"] == "Blocked"
        await svc.backend.heartbeat(tc.model_id)  # a gap of our own, still being delivered, is not "gone"
        gate.release.set()
        await fb
        assert (await opt).step == 1
        assert emulator.session_state(tc.model_id)["applied"] == [1, 2]  # run in number order although 2 arrived first


@pytest.mark.parametrize(("pipeline", "overlapped"), [("true", True), ("false", False)])
async def test_pipeline_submissions_false_keeps_one_submission_in_flight(emulator, pipeline, overlapped):
    events: list[str] = []

    async with asyncsess.ServiceClient(driver_url(emulator, pipeline_submissions=pipeline)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        execute = svc.backend.runtime.execute_training_operation

        def recorded(**kwargs: Any) -> Any:
            n = kwargs["sequenceNumber"]
            events.append(f"start {n}")
            if n == 1:
                time.sleep(0.3)  # a slow first delivery: number 2 goes out meanwhile only when pipelined
            out = execute(**kwargs)
            events.append(f"end {n}")
            return out

        svc.backend.runtime.execute_training_operation = recorded
        fb = tc.forward_backward(GOOD, "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=0.01))
        await fb
        await opt
    assert (events.index("start 2") < events.index("end 1")) is overlapped


@pytest.fixture(scope="module")
def blind_emulator() -> Iterator[RunningEmulator]:
    """An emulator whose hub documents publish no VocabSize: only the service can refuse a token id past the vocabulary."""
    with running_emulator("mock://", EmulatorConfig(check_responses=True, publish_vocab_size=False)) as emu:
        yield emu


async def _weights_after(tc: Any, refused: Any = None) -> list[float]:
    """A step, ``refused()`` with a step queued behind it (both numbered before its refusal comes back), a step;
    then the log-probs the weights give."""
    await tc.forward_backward(GOOD, "cross_entropy")
    await tc.optim_step(AdamParams(learning_rate=0.01))
    if refused is not None:
        bad = refused()
        fb, opt = tc.forward_backward(GOOD, "cross_entropy"), tc.optim_step(AdamParams(learning_rate=0.01))
        with pytest.raises(InvalidInputError) as err:
            await bad
        assert err.value.void and err.value.field in ("path", "operationConfig.forwardBackward.datumList[0]"), err.value
        await fb
        assert (await opt).step == 2
    else:
        await tc.forward_backward(GOOD, "cross_entropy")
        await tc.optim_step(AdamParams(learning_rate=0.01))
    out = await tc.forward(GOOD, "cross_entropy")
    return list(out.loss_fn_outputs[0]["logprobs"].data)


@pytest.mark.parametrize("bad", ["token past the vocabulary", "unknown package"])
async def test_an_op_the_service_refuses_voids_its_number_and_the_ops_after_it_run(blind_emulator, bad):
    """The service refuses an op after it took its number (the client could not know): the refusal is void, so the
    ops numbered after it run, in order, and the weights are those of a run that never sent it. It poisoned the
    training client (every later op a PoisonedError), or stopped the session when later ops were numbered."""
    async with asyncsess.ServiceClient(driver_url(blind_emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        state = await tc.save_state("s")
        unknown = state.path.rsplit("/", 1)[0] + "/999"
        refused = {
            "token past the vocabulary": lambda: tc.forward_backward(OUT_OF_VOCAB, "cross_entropy"),
            "unknown package": lambda: tc.load_state(unknown),
        }[bad]
        via_refusal = await _weights_after(tc, refused)
        detail = clients(blind_emulator.url)[0].describe_training_session(TrainingSessionName=tc.model_id)["TrainingSessionDetail"]
        assert detail["TrainingSessionStatus"] == "Running" and detail["LastReceivedSequenceNumber"] == 7
        assert blind_emulator.session_state(tc.model_id)["applied"] == [1, 2, 3, 5, 6, 7]  # number 4 was used up
        clean = await _weights_after(await svc.create_lora_training_client(BASE, rank=4))
    assert via_refusal == clean  # bit for bit: the emulator runs on mock://


class _RefuseHeld:
    """Wraps ``execute_training_operation``: the op with sequence number ``refused`` is held until number ``until`` was
    acknowledged, then sent with a learning rate past the service's limit, which the service refuses."""

    def __init__(self, execute: Any, refused: int, until: int) -> None:
        self.execute, self.refused, self.until = execute, refused, until
        self.later_acked = threading.Event()

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs["sequenceNumber"] == self.refused:
            self.later_acked.wait(10)  # unpipelined, the later ops are never sent first: the assertions below fail
            kwargs["operationConfig"] = {"optimizerStep": {"adamParamsConfig": {"learningRate": 0.5}}}
            return self.execute(**kwargs)
        out = self.execute(**kwargs)
        if kwargs["sequenceNumber"] == self.until:
            self.later_acked.set()
        return out


async def test_an_optimizer_step_the_service_refuses_is_not_counted_by_the_ops_numbered_behind_it(emulator):
    """The ops numbered behind a refused optimizer step counted it (the refusal came back after their numbering), so a
    save reported step 2 and the next step 3 where the service had applied 1 and 2."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        await tc.forward_backward(GOOD, "cross_entropy")
        assert (await tc.optim_step(AdamParams(learning_rate=0.01))).step == 1
        svc.backend.runtime.execute_training_operation = _RefuseHeld(svc.backend.runtime.execute_training_operation, 3, until=6)
        refused = tc.optim_step(AdamParams(learning_rate=0.01))  # number 3
        saved = tc.save_state()  # 4
        fb, opt = tc.forward_backward(GOOD, "cross_entropy"), tc.optim_step(AdamParams(learning_rate=0.01))  # 5, 6
        with pytest.raises(InvalidInputError, match="learningRate") as err:
            await refused
        assert err.value.void
        assert (await saved).step == 1
        await fb
        assert (await opt).step == 2
        assert [c.step for c in await svc.backend.list_checkpoints(tc.model_id)] == [1]
        assert (await tc.optim_step(AdamParams(learning_rate=0.01))).step == 3  # numbered after the refusal came back
    assert emulator.session_state(tc.model_id)["applied"] == [1, 2, 4, 5, 6, 7]
