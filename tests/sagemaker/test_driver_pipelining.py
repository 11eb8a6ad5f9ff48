"""Pipelined submission: ops are numbered in order and sent without waiting for earlier acknowledgements."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import anyio
import pytest

import asyncsess
from asyncsess.errors import InvalidInputError, PoisonedError, SessionGoneError
from asyncsess.types import AdamParams, Datum, ModelInput

from .helpers import clients, driver_url, wait_status

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"
GOOD = [Datum(model_input=ModelInput.from_ints([1, 40, 41]), loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0] * 3})]
# Passes the driver's checks (it does not know the vocabulary) and is rejected by the service: ValidationException.
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


async def test_a_rejected_op_with_nothing_numbered_after_it_gives_its_number_back(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        await tc.forward_backward(GOOD, "cross_entropy")
        with pytest.raises(InvalidInputError) as err:
            await tc.forward_backward(OUT_OF_VOCAB, "cross_entropy")
        assert "datumList" in (err.value.field or "")
        sm, _ = clients(emulator.url)
        detail = sm.describe_training_session(TrainingSessionName=tc.model_id)["TrainingSessionDetail"]
        # no gap left behind: the service counts the rejected number 2 as used (the emulator does; the real service's rule is unpublished)
        assert detail["TrainingSessionStatus"] == "Running" and detail["LastReceivedSequenceNumber"] == 2
        assert svc.backend._sessions[tc.model_id].next_wire_seq == 2


async def test_a_rejected_op_with_later_ops_in_flight_stops_the_session_instead_of_leaving_a_gap(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        bad = tc.forward_backward(OUT_OF_VOCAB, "cross_entropy")
        later = tc.optim_step(AdamParams(learning_rate=0.01))
        with pytest.raises(InvalidInputError):
            await bad
        # The service counts the rejected number as used (the emulator does; the real rule is unpublished), so the step
        # delivered after it may run before the stop reaches the service: its future holds its result or fails
        # (docs/backend-sagemaker.md, pipeline_submissions)
        with contextlib.suppress(PoisonedError, SessionGoneError):
            await later
        sm, _ = clients(emulator.url)
        assert wait_status(sm, tc.model_id, {"Stopped"})["TrainingSessionStatus"] == "Stopped"  # not Blocked on number 1
        assert emulator.session_state(tc.model_id)["applied"] in ([], [2])  # the refused forward_backward never ran
        with pytest.raises((PoisonedError, SessionGoneError)):
            await tc.optim_step(AdamParams(learning_rate=0.01))
