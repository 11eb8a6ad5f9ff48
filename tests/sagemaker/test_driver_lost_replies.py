"""The driver when the service applied a control-plane call but its reply was lost (a 500 after the work, a dropped
connection): the retry is refused for what the first attempt did. A lost ``CreateTrainingSession`` reply made the
retry's ``ResourceInUse`` a ServerError and left the session it had made Running with no client to stop it; a lost
``DeleteModelPackage`` reply made the retry's "does not exist" an InvalidInputError for a delete that was done."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator

import anyio
import pytest

import asyncsess
from asyncsess.errors import ConflictError, RetriesExhaustedError, TransientError
from asyncsess.types import AdamParams, Datum, ModelInput

from .helpers import clients, driver_url, new_session, wait_status

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"
BATCH = [Datum(model_input=ModelInput.from_ints([1, 40, 41]), loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0] * 3})]


def _sessions(sm) -> dict[str, str]:
    rows = sm.list_training_sessions()["TrainingSessionSummaries"]
    return {r["TrainingSessionArn"].rsplit("/", 1)[1]: r["TrainingSessionStatus"] for r in rows}


async def test_a_create_whose_reply_was_lost_goes_on_with_the_one_session_it_made(emulator):
    sm, _ = clients(emulator.url)
    before = _sessions(sm)
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        emulator.set_faults(lost_response_rate=1.0, operations=["CreateTrainingSession"])
        tc = await svc.create_lora_training_client(BASE, rank=4)
        assert emulator.injected_faults() == {"lost response": 1}  # the retry was refused: ResourceInUse
        emulator.set_faults()
        made = {n: s for n, s in _sessions(sm).items() if n not in before}
        assert made == {tc.model_id: "Running"}
        step = await tc.optim_step(AdamParams(learning_rate=0.001))
        assert step.step == 1
    assert wait_status(sm, tc.model_id, {"Stopped"})["TrainingSessionStatus"] == "Stopped"  # the client owned it


async def test_a_create_of_a_name_another_session_has_is_a_conflict_that_leaves_that_session_alone(emulator):
    sm, _ = clients(emulator.url)
    name = f"taken-{uuid.uuid4().hex[:8]}"
    new_session(sm, name)
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        with pytest.raises(ConflictError) as err:
            await svc.create_lora_training_client(BASE, rank=4, training_session_name=name)
        assert "ResourceInUse" in str(err.value)
    assert _sessions(sm)[name] == "Running"  # not stopped as if it were the client's
    sm.stop_training_session(TrainingSessionName=name)


async def test_a_delete_whose_reply_was_lost_is_done(emulator):
    sm, _ = clients(emulator.url)
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        saved = await tc.save_state("gone")
        emulator.set_faults(lost_response_rate=1.0, operations=["DeleteModelPackage"])
        await svc.delete_checkpoint(saved.path)
        assert emulator.injected_faults() == {"lost response": 1}
        emulator.set_faults()
        with pytest.raises(sm.exceptions.ClientError, match="does not exist"):
            sm.describe_model_package(ModelPackageName=saved.path)


async def test_a_create_cancelled_while_its_request_is_on_the_wire_leaves_no_session_running(emulator):
    """The boto3 call runs on in its worker thread after the caller is cancelled; the session it makes is stopped."""
    sm, _ = clients(emulator.url)
    sent, names = threading.Event(), []
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        control = svc.backend.control
        create = control.create_training_session

        def create_and_tell(**request):
            names.append(request["TrainingSessionName"])
            sent.set()
            return create(**request)

        control.create_training_session = create_and_tell
        emulator.set_faults(latency_s=0.3, operations=["CreateTrainingSession"])  # the request is still on the wire
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.create_lora_training_client, BASE, 4)
            await anyio.to_thread.run_sync(sent.wait)
            tg.cancel_scope.cancel()
        emulator.set_faults()
    assert len(names) == 1 and _sessions(sm).get(names[0]) in ("Stopping", "Stopped")


async def test_replies_cut_short_are_retried_as_lost_and_every_op_runs_once(emulator):
    """A 200 whose body could not be read (ResponseParserError) was a ServerError: the op had been applied, yet it
    failed, poisoning the training client. It is a lost reply now: retried with the same client token."""
    sm, _ = clients(emulator.url)
    before = _sessions(sm)
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        emulator.set_faults(truncated_response_rate=1.0, operations=["CreateTrainingSession"])
        tc = await svc.create_lora_training_client(BASE, rank=4)
        assert emulator.injected_faults() == {"truncated response": 1}
        assert {n for n in _sessions(sm) if n not in before} == {tc.model_id}
        ops = ["ExecuteTrainingOperation", "GetTrainingOperationResult"]
        emulator.set_faults(truncated_response_rate=0.5, seed=3, operations=ops)
        futures = []
        for _ in range(4):
            futures.append(tc.forward_backward(BATCH, "cross_entropy"))
            futures.append(tc.optim_step(AdamParams(learning_rate=0.005)))
        results = [await f for f in futures]
        injected = emulator.injected_faults()
        emulator.set_faults()
        assert injected.get("truncated response", 0) > 0
        assert [r.step for r in results[1::2]] == [1, 2, 3, 4]
        state = emulator.session_state(tc.model_id)
        assert state["applied"] == list(range(1, 9)) and len(state["operations"]) == 8  # each op made and run once


@pytest.mark.parametrize("named", [False, True])
async def test_a_create_retried_by_the_client_after_every_reply_was_lost_makes_one_session(emulator, named):
    """The driver gives up on a create whose replies were all lost (its retry budget spent); the ServiceClient's retry of
    that create (same idempotency key) made a second session under a new name, and the first ran on with no owner (a
    ``training_session_name`` given: the retry's ``ResourceInUse`` was a ConflictError). The retry now names the session
    the lost attempt made, and its ``ResourceInUse`` adopts it."""
    sm, _ = clients(emulator.url)
    before = _sessions(sm)
    retry = asyncsess.RetryPolicy(max_attempts=3, initial_backoff=0.0, jitter=0.0)
    name = {"training_session_name": f"mine-{uuid.uuid4().hex[:8]}"} if named else {}
    async with asyncsess.ServiceClient(driver_url(emulator, retry_budget_s="0.001"), retry=retry) as svc:
        emulator.set_faults(lost_response_rate=1.0, operations=["CreateTrainingSession"])
        tc = await svc.create_lora_training_client(BASE, rank=4, **name)
        assert tc.model_id == name.get("training_session_name", tc.model_id)
        assert emulator.injected_faults() == {"lost response": 1}
        emulator.set_faults()
        assert {n: s for n, s in _sessions(sm).items() if n not in before} == {tc.model_id: "Running"}
    assert wait_status(sm, tc.model_id, {"Stopped"})["TrainingSessionStatus"] == "Stopped"


async def test_a_sampler_whose_session_create_was_retried_by_the_client_makes_one_session(emulator):
    """``create_sampling_client`` on a base model makes its own session: the same rule holds for its create."""
    sm, _ = clients(emulator.url)
    before = _sessions(sm)
    retry = asyncsess.RetryPolicy(max_attempts=3, initial_backoff=0.0, jitter=0.0)
    async with asyncsess.ServiceClient(driver_url(emulator, retry_budget_s="0.001"), retry=retry) as svc:
        emulator.set_faults(lost_response_rate=1.0, operations=["CreateTrainingSession"])
        sampler = await svc.create_sampling_client(base_model=BASE)
        assert emulator.injected_faults() == {"lost response": 1}
        emulator.set_faults()
        made = [n for n in _sessions(sm) if n not in before]
        assert len(made) == 1 and _sessions(sm)[made[0]] == "Running"
        assert len(await sampler.compute_logprobs([1, 40, 41])) == 3
    assert wait_status(sm, made[0], {"Stopped"})["TrainingSessionStatus"] == "Stopped"  # the sampler owned it


async def _status(sm, name: str, wanted: set[str]) -> str:
    """The session's status once it is one of ``wanted`` (polled without blocking the loop; a hang guard only)."""
    with anyio.fail_after(60):
        while (status := _sessions(sm).get(name)) not in wanted:
            await anyio.sleep(0.01)
    return status


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    with anyio.fail_after(60):  # a hang guard only
        while not any(text in r.getMessage() for r in caplog.records):
            await anyio.sleep(0.01)


@pytest.mark.parametrize("named", [False, True])
async def test_a_create_the_client_gave_up_on_is_stopped_at_once_not_at_close(emulator, named):
    """Every reply lost and no retry left: the create failed, and the session it had made ran on (billed, idle) until
    the client closed. The driver now stops it in the background as soon as the client gives up (CreateTrainingSession
    has no client token: Describe of the name it sent, with this request's configs); a name that was another session's
    all along is left alone."""
    sm, _ = clients(emulator.url)
    before = _sessions(sm)
    taken = f"taken-{uuid.uuid4().hex[:8]}"
    new_session(sm, taken)
    name = {"training_session_name": f"mine-{uuid.uuid4().hex[:8]}"} if named else {}
    async with asyncsess.ServiceClient(driver_url(emulator, retry_budget_s="0.001"), retry=asyncsess.RetryPolicy(max_attempts=1)) as svc:
        emulator.set_faults(lost_response_rate=1.0, operations=["CreateTrainingSession"])
        with pytest.raises(RetriesExhaustedError):
            await svc.create_lora_training_client(BASE, rank=4, **name)
        emulator.set_faults()
        made = [n for n in _sessions(sm) if n not in before and n != taken]
        assert made == [name.get("training_session_name", *made)]
        assert await _status(sm, made[0], {"Stopped"}) == "Stopped"  # while the client is open
        emulator.set_faults(throttle_rate=1.0, operations=["CreateTrainingSession"])
        with pytest.raises(RetriesExhaustedError):  # never answered, and the name was another session's all along
            await svc.create_lora_training_client(BASE, rank=4, training_session_name=taken)
        emulator.set_faults()
    assert _sessions(sm)[taken] == "Running"
    sm.stop_training_session(TrainingSessionName=taken)


async def test_stopping_a_session_a_create_left_is_retried_and_a_failure_is_logged_for_close_to_sweep(emulator, caplog):
    """The background stop of a session a given-up create made retries a throttled StopTrainingSession; one that keeps
    failing past ``abandoned_stop_s`` is a warning (the caller already has its create's error, and the client goes
    on), and closing the client stops the session."""
    sm, _ = clients(emulator.url)
    url = driver_url(emulator, retry_budget_s="0.001", retry_base_s="0.001", abandoned_stop_s="0.5")
    caplog.set_level(logging.INFO, logger="asyncsess_sagemaker")
    async with asyncsess.ServiceClient(url, retry=asyncsess.RetryPolicy(max_attempts=1)) as svc:
        names = []
        for throttle_rate in (0.5, 1.0):
            before = _sessions(sm)
            emulator.set_faults(lost_response_rate=1.0, operations=["CreateTrainingSession"])
            with pytest.raises(RetriesExhaustedError):
                await svc.create_lora_training_client(BASE, rank=4)
            # set before this task yields, so before the background stop runs
            emulator.set_faults(throttle_rate=throttle_rate, seed=1, operations=["StopTrainingSession"])
            (name,) = [n for n in _sessions(sm) if n not in before]
            names.append(name)
            if throttle_rate < 1.0:
                assert await _status(sm, name, {"Stopped"}) == "Stopped"
                assert emulator.injected_faults() == {"ThrottlingException": 1}  # the first Stop was refused, the retry done
                await _logged(caplog, f"stopped training session {name}")
        await _logged(caplog, f"could not stop training session {names[1]}")
        emulator.set_faults()
        assert _sessions(sm)[names[1]] == "Running"
        tc = await svc.create_lora_training_client(BASE, rank=4)  # the client goes on
        assert (await tc.optim_step(AdamParams(learning_rate=0.001))).step == 1
    assert await _status(sm, names[1], {"Stopped"}) == "Stopped"  # swept at close


async def test_a_chat_reply_cut_short_is_retried_as_lost_and_a_broken_stream_is_a_transient_error(emulator):
    """A SampleTrainingSession answer cut short (a 200 whose JSON ends early) raised a bare JSONDecodeError and was not
    retried; a stream chunk cut short did too. The first is a lost reply now, retried (the chat runs again); the second,
    whose earlier chunks the caller already has, a TransientError."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        emulator.set_faults(truncated_response_rate=0.5, seed=1, operations=["SampleTrainingSession"])  # cut, then whole
        answer = await svc.backend.chat_completion(tc.model_id, body)
        assert emulator.injected_faults() == {"truncated response": 1}
        emulator.set_faults()
        assert answer["choices"][0]["message"]["role"] == "assistant"

        class CutShort:
            def iter_lines(self) -> Iterator[bytes]:
                yield b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choi'

            def close(self) -> None:
                pass

        svc.backend.runtime.sample_training_session_with_response_stream = lambda **kw: {"body": CutShort()}
        with pytest.raises(TransientError) as err:
            [c async for c in svc.backend.chat_completion_stream(tc.model_id, body)]
        assert err.value.lost_response and "the stream broke" in str(err.value)
