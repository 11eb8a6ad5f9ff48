"""The driver end to end through ``asyncsess.ServiceClient("sagemaker://...")`` against the emulator over mock://."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from botocore.exceptions import ClientError, NoCredentialsError

import asyncsess
from asyncsess.backends import ForwardBackwardOp
from asyncsess.errors import (
    AuthenticationError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    SessionGoneError,
    UnsupportedError,
)
from asyncsess.rl.data import rl_datum
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams
from asyncsess_sagemaker.emulator import EmulatorConfig, running_emulator

from .helpers import clients, driver_url, wait_status

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

BASE = "mock/bigram-tiny"


def sft(tokens: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    )


BATCH = [sft([1, 40, 41, 42, 43, 2]), sft([1, 50, 51, 52, 2])]


async def _loop(url: str, steps: int, seed: int) -> tuple[list[list[list[int]]], list[float]]:
    """A small GRPO-shaped loop: sample, score, ppo + optim (pipelined), fresh sampler; then the final log-probs."""
    samples = []
    async with asyncsess.ServiceClient(url) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8)
        sc = await tc.save_weights_and_get_sampling_client()
        prompt = [1, 40, 41]
        for step in range(steps):
            resp = await sc.sample(prompt, 4, SamplingParams(max_tokens=6, temperature=1.0, seed=seed + step))
            seqs = [s.tokens for s in resp.sequences]
            samples.append(seqs)
            rewards = [float(sum(t % 2 == 0 for t in s)) for s in seqs]
            mean = sum(rewards) / len(rewards)
            datums = [
                rl_datum(prompt, s.tokens, s.logprobs or [], r - mean) for s, r in zip(resp.sequences, rewards) if s.tokens and r != mean
            ]
            if datums:
                fb = tc.forward_backward(datums, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
                opt = tc.optim_step(AdamParams(learning_rate=0.01))
                await fb
                await opt
            sc = await tc.save_weights_and_get_sampling_client()
        final = await tc.forward(BATCH, "cross_entropy")
    return samples, [v for out in final.loss_fn_outputs for v in out["logprobs"].data]


async def test_the_sagemaker_path_is_a_faithful_transport(emulator):
    """The same seeded loop over sagemaker://(emulator over mock://) and over mock:// directly: same samples, same weights."""
    via_sm = await _loop(driver_url(emulator), steps=3, seed=11)
    direct = await _loop("mock://", steps=3, seed=11)
    assert via_sm[0] == direct[0]
    assert np.allclose(via_sm[1], direct[1], atol=1e-6)


# The next three tests also run over local:// (test_driver_emulator_local.py): they take the emulator's model and
# the driver's URL from the fixtures base_model and sm_url.


async def test_grpo_example_runs_end_to_end(emulator, sm_url, base_model):
    from examples.grpo_toy import train

    history, final_path = await train(sm_url, steps=3, lr=0.01, seed=1, base_model=base_model)
    assert len(history) == 3 and all(0.0 <= r <= 1.0 for r in history)
    assert final_path.startswith("arn:aws:sagemaker:us-west-2:111122223333:model-package/")
    detail = clients(emulator.url)[0].describe_model_package(ModelPackageName=final_path)
    assert detail["InferenceSpecification"]["Containers"][0]["IsCheckpoint"] is True


async def test_pipelined_ops_survive_throttling_and_lost_replies_exactly_once(emulator, sm_url, base_model):
    async with asyncsess.ServiceClient(sm_url) as svc:
        tc = await svc.create_lora_training_client(base_model, rank=4)
        emulator.set_faults(
            throttle_rate=0.3, lost_response_rate=0.3, seed=5, operations=["ExecuteTrainingOperation", "GetTrainingOperationResult"]
        )
        futures = []
        for _ in range(6):
            futures.append(tc.forward_backward(BATCH, "cross_entropy"))
            futures.append(tc.optim_step(AdamParams(learning_rate=0.005)))
        results = [await f for f in futures]
        injected = emulator.injected_faults()
        emulator.set_faults()
        assert injected.get("ThrottlingException", 0) > 0 and injected.get("lost response", 0) > 0
        assert [r.step for r in results[1::2]] == [1, 2, 3, 4, 5, 6]
        state = emulator.session_state(tc.model_id)
        assert state["applied"] == list(range(1, 13))  # every op ran once, in order, despite the retries
        assert len(state["operations"]) == 12
        usage = await svc.backend.session_usage(tc.model_id)
        assert usage.training_tokens == 6 * sum(d.model_input.length for d in BATCH)


async def test_a_session_stopped_remotely_surfaces_as_session_gone(emulator, sm_url, base_model):
    async with asyncsess.ServiceClient(sm_url) as svc:
        tc = await svc.create_lora_training_client(base_model, rank=4)
        await tc.forward_backward(BATCH, "cross_entropy")
        sm, _ = clients(emulator.url)
        sm.stop_training_session(TrainingSessionName=tc.model_id)
        with pytest.raises(SessionGoneError) as err:
            await tc.optim_step(AdamParams(learning_rate=0.001))
        assert tc.model_id in str(err.value) and ("Stopp" in str(err.value))
        with pytest.raises(SessionGoneError):
            await svc.backend.heartbeat(tc.model_id)


async def test_a_session_failed_remotely_fails_its_queued_ops_as_session_gone():
    with running_emulator("mock://?latency_ms=300") as slow:  # engine ops take 0.3 s, so the second one is still queued
        async with asyncsess.ServiceClient(driver_url(slow)) as svc:
            tc = await svc.create_lora_training_client(BASE, rank=4)
            running = tc.forward_backward(BATCH, "cross_entropy")
            queued = tc.optim_step(AdamParams(learning_rate=0.001))
            while not slow.session_state(tc.model_id)["operations"]:
                await anyio.sleep(0.01)
            slow.end_session(tc.model_id, status="Failed", reason="engine crashed")
            for fut in (running, queued):
                with pytest.raises(SessionGoneError) as err:
                    await fut
                assert "Failed" in str(err.value) and "engine crashed" in str(err.value)
            with pytest.raises(SessionGoneError):
                await tc.optim_step(AdamParams(learning_rate=0.001))


async def test_checkpoint_saved_as_arn_resumes_exactly(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8)
        for _ in range(2):
            tc.forward_backward(BATCH, "cross_entropy")
            await tc.optim_step(AdamParams(learning_rate=0.01))
        saved = await tc.save_state("two steps")
        assert saved.kind == "state" and saved.path.startswith("arn:aws:sagemaker:")
        tc.forward_backward(BATCH, "cross_entropy")
        await tc.optim_step(AdamParams(learning_rate=0.01))
        expected = (await tc.forward(BATCH, "cross_entropy")).loss_fn_outputs

        resumed = await svc.create_training_client_from_state_with_optimizer(saved.path)
        assert resumed.base_model == BASE
        resumed.forward_backward(BATCH, "cross_entropy")
        await resumed.optim_step(AdamParams(learning_rate=0.01))
        got = (await resumed.forward(BATCH, "cross_entropy")).loss_fn_outputs
        for a, b in zip(expected, got):
            assert np.array_equal(a["logprobs"].data, b["logprobs"].data)  # weights and Adam moments came back, bit for bit

        fresh_opt = await svc.create_training_client_from_state(saved.path)
        fresh_opt.forward_backward(BATCH, "cross_entropy")
        await fresh_opt.optim_step(AdamParams(learning_rate=0.01))
        other = (await fresh_opt.forward(BATCH, "cross_entropy")).loss_fn_outputs
        assert not np.array_equal(expected[0]["logprobs"].data, other[0]["logprobs"].data)  # a reset optimizer differs
        assert [c.path for c in await svc.list_checkpoints(tc.model_id)] == [saved.path]


async def test_samplers_on_foreign_checkpoints_get_their_own_session(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        saved = await tc.save_weights_for_sampler("for later")
        await tc.stop()
        sc = await svc.create_sampling_client(model_path=saved.path)
        out = await sc.sample([1, 40], 2, SamplingParams(max_tokens=3, seed=0))
        assert len(out.sequences) == 2 and all(len(s.tokens) <= 3 for s in out.sequences)
        logprobs = await sc.compute_logprobs([1, 40, 41])
        assert logprobs[0] is None and len(logprobs) == 3
        scored = await sc.sample([1, 40, 41], 1, SamplingParams(max_tokens=3, seed=0), include_prompt_logprobs=True)
        assert scored.prompt_logprobs[0] is None and scored.prompt_logprobs[1:] == pytest.approx(logprobs[1:], abs=1e-5)
        sampler_session = next(iter(svc.backend._samplers.values())).session
        assert sampler_session != tc.model_id
    sm, _ = clients(emulator.url)
    assert wait_status(sm, sampler_session, {"Stopped"})["TrainingSessionStatus"] == "Stopped"  # closed with the client


async def test_bad_input_is_a_typed_error_naming_the_field(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        with pytest.raises(InvalidInputError) as err:
            await tc.optim_step(AdamParams(learning_rate=0.5))
        assert "learningRate" in (err.value.field or "")
        assert emulator.session_state(tc.model_id)["operations"] == {}  # nothing was sent
        tc2 = await svc.create_lora_training_client(BASE, rank=4)
        datums = [rl_datum([1, 40], [41, 42], [-1.0, -1.0], 1.0)]
        with pytest.raises(UnsupportedError) as err2:
            await tc2.forward_backward(datums, "dro")
        assert "forward_backward_custom" in (err2.value.fix or "")
        caps = await svc.get_server_capabilities()
        assert caps.loss_functions == ["cross_entropy", "importance_sampling", "ppo", "cispo"]
        with pytest.raises(InvalidInputError):
            await svc.create_lora_training_client("no/such-model", rank=4)


async def test_a_token_past_the_vocabulary_is_refused_before_numbering(emulator):
    """The driver reported no vocabulary size (and the wire's maxTokens limit as the context), so a token id past the
    vocabulary took its number and the service's refusal poisoned the training client. Now the hub document's
    VocabSize and MaxContextLength are checked before numbering, by the client and by the driver's precheck."""
    past = Datum(model_input=ModelInput.from_ints([1, 105]), loss_fn_inputs={"target_tokens": [105, 2], "weights": [1.0, 1.0]})
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        model = (await svc.get_server_capabilities()).supported_models[0]
        assert (model.vocab_size, model.max_context_length) == (105, 512)  # mock/bigram-tiny's
        tc = await svc.create_lora_training_client(BASE, rank=4)
        with pytest.raises(InvalidInputError) as err:
            tc.forward_backward([past], "cross_entropy")
        assert err.value.field == "data[0]"
        with pytest.raises(InvalidInputError) as err2:
            svc.backend.precheck(tc.model_id, ForwardBackwardOp(seq=1, idempotency_key="k", data=(past,)))
        assert "[0, 105)" in str(err2.value) and "datumList[0]" in (err2.value.field or "")
        assert tc.current_sequence_number == 0 and emulator.session_state(tc.model_id)["operations"] == {}
        assert (await tc.forward_backward(BATCH, "cross_entropy")).metrics["loss:sum"] > 0


@pytest.mark.parametrize("bad", ["arn:not-a-package", "sampler weights", "deleted here"])
async def test_a_bad_load_state_path_is_refused_at_once_and_the_client_goes_on(emulator, bad):
    """As on mock://: the path was checked (or sent and refused by the service) after the op took its number, so the
    refusal poisoned the training client and every later op was a PoisonedError."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        weights = await tc.save_weights_for_sampler("w")
        state = await tc.save_state("s")
        if bad == "deleted here":
            await svc.backend.delete_checkpoint(state.path)
        path = {"arn:not-a-package": "arn:not-a-package", "sampler weights": weights.path, "deleted here": state.path}[bad]
        sent = len(emulator.session_state(tc.model_id)["operations"])
        with pytest.raises(InvalidInputError) as err:
            await tc.load_state(path)
        assert err.value.field == "path"
        assert isinstance(err.value, NotFoundError) is (bad == "deleted here")
        assert len(emulator.session_state(tc.model_id)["operations"]) == sent  # nothing was sent
        assert (await tc.forward_backward(BATCH, "cross_entropy")).metrics["loss:sum"] > 0


async def test_load_state_of_a_package_deleted_elsewhere_is_not_found_not_a_gone_session(emulator):
    """ResourceNotFoundException names the package here, not the session: it was a SessionGoneError, and the
    training client called its live session gone."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        state = await tc.save_state("s")
        clients(emulator.url)[0].delete_model_package(ModelPackageName=state.path)
        with pytest.raises(NotFoundError) as err:
            await tc.load_state(state.path)
        assert err.value.field == "path" and "not found" in err.value.message
        assert emulator.session_state(tc.model_id)["status"] == "Running"


async def test_a_sampler_on_a_package_deleted_or_never_saved_is_not_found_not_a_gone_session(emulator):
    """The ResourceNotFoundException of a sample, log-prob or chat naming a package the service does not know was a
    SessionGoneError (a run's recovery took the live session for lost), and DescribeModelPackage's "does not exist"
    for a sampler's model_path an InvalidInputError naming no field."""
    sm = clients(emulator.url)[0]
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        sm.delete_model_package(ModelPackageName=sc.model_package_arn)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        calls = {
            "model_path": [
                lambda: sc.sample([1, 40, 41], 1, SamplingParams(max_tokens=2)),
                lambda: sc.compute_logprobs([1, 40, 41]),
                lambda: svc.backend.chat_completion(sc.sampler_id, chat),
            ],
            "model_package_arn": [lambda: svc.backend.chat_completion(tc.model_id, chat, model_package_arn=sc.model_package_arn)],
        }
        for field, made in calls.items():
            for call in made:
                with pytest.raises(NotFoundError) as err:
                    await call()
                assert err.value.field == field and "not found" in err.value.message
        with pytest.raises(NotFoundError) as err:
            await svc.create_sampling_client(model_path=sc.model_package_arn.rsplit("/", 1)[0] + "/999")
        assert err.value.field == "model_path"
        assert emulator.session_state(tc.model_id)["status"] == "Running"
        assert (await tc.forward_backward(BATCH, "cross_entropy")).metrics["loss:sum"] > 0


async def test_a_create_naming_a_group_or_model_that_is_not_there_is_not_found_naming_it():
    """CreateTrainingSession's ResourceNotFound was an InvalidInputError naming no field, and once the default group
    was deleted (after the client made or found it) every later create of that client failed so."""
    with running_emulator("mock://", EmulatorConfig(startup_s=0.0, stop_s=0.0)) as emu:
        sm = clients(emu.url)[0]
        async with asyncsess.ServiceClient(driver_url(emu)) as svc:
            first = await svc.create_lora_training_client(BASE, rank=4)
            await first.stop()
            wait_status(sm, first.model_id, {"Stopped"})
            sm.delete_model_package_group(ModelPackageGroupName="sagemaker-default")
            tc = await svc.create_lora_training_client(BASE, rank=4)  # the default group is made again
            state = await tc.save_state("s")
            assert sm.describe_model_package(ModelPackageName=state.path)["ModelPackageGroupName"] == "sagemaker-default"
            group = sm.describe_model_package_group(ModelPackageGroupName="sagemaker-default")["ModelPackageGroupArn"]
            nowhere = "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/no-such-model/1.0.0"
            for field, create in [
                ("model_package_group_arn", lambda: svc.create_lora_training_client(BASE, rank=4, model_package_group_arn=group + "-gone")),
                ("base_model", lambda: svc.create_lora_training_client(nowhere, rank=4)),
            ]:
                with pytest.raises(NotFoundError) as err:
                    await create()
                assert err.value.field == field, err.value
            assert [s["TrainingSessionStatus"] for s in sm.list_training_sessions()["TrainingSessionSummaries"]] == ["Running", "Stopped"]


async def test_undeliverable_op_stops_the_session_instead_of_leaving_a_gap(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator, retry_budget_s="0.3"), retry=asyncsess.RetryPolicy(max_attempts=1)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        emulator.set_faults(throttle_rate=1.0, operations=["ExecuteTrainingOperation"])
        with pytest.raises(RetriesExhaustedError):
            await tc.forward_backward(BATCH, "cross_entropy")
        emulator.set_faults()
        sm, _ = clients(emulator.url)
        assert wait_status(sm, tc.model_id, {"Stopped"})["TrainingSessionStatus"] == "Stopped"


@pytest.mark.parametrize(
    ("code", "error"),
    [("AccessDeniedException", PermissionDeniedError), ("ExpiredTokenException", AuthenticationError), (None, InvalidInputError)],
)
async def test_an_op_refused_for_its_credentials_stops_the_session_instead_of_leaving_a_gap(emulator, code, error):
    """An ExecuteTrainingOperation refused before any work (permissions, expired credentials) never took its number,
    yet the session ran on with that gap (Running, every later op Poisoned) until the client closed; it is stopped
    now, as for a number whose delivery was never known. Credentials botocore could not find (None here) were taken for
    the service's refusal, whose number is used up: the next op blocked the session on that gap."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        send = svc.backend.runtime.execute_training_operation

        def refuse(**request: Any) -> Any:
            svc.backend.runtime.execute_training_operation = send
            if code is None:
                raise NoCredentialsError()
            raise ClientError(
                {"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "ExecuteTrainingOperation"
            )

        svc.backend.runtime.execute_training_operation = refuse
        with pytest.raises(error):
            await tc.forward_backward(BATCH, "cross_entropy")
        sm, _ = clients(emulator.url)
        assert wait_status(sm, tc.model_id, {"Stopped"})["TrainingSessionStatus"] == "Stopped"


async def test_openai_compatible_chat_through_the_driver(emulator):
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        saved = await tc.save_weights_for_sampler("chat")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": 2}
        answer = await svc.backend.chat_completion(tc.model_id, body, model_package_arn=saved.path)
        assert answer["choices"][0]["message"]["role"] == "assistant"
        chunks = [c async for c in svc.backend.chat_completion_stream(tc.model_id, body, model_package_arn=saved.path)]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == answer["choices"][0]["message"]["content"]  # same seed, same completion, streamed
        assert chunks[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]


def test_cli_mounts_an_emulate_command():
    from typer.testing import CliRunner

    from asyncsess_sagemaker.cli import app

    result = CliRunner().invoke(app, ["emulate", "--help"])
    assert result.exit_code == 0
    assert "--backend" in result.output and "--port" in result.output


@pytest.mark.parametrize("description", ["two\nlines", "tab\there"])
async def test_a_save_description_the_service_cannot_store_is_refused_at_once_and_the_client_goes_on(emulator, description):
    """The description becomes the package's ModelPackageDescription, whose pattern takes no control characters: the
    emulator stored it and then answered DescribeModelPackage and ListModelPackages with a 500 (strict mode)."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        with pytest.raises(InvalidInputError) as err:
            await tc.save_state(description=description)
        assert err.value.field == "operationConfig.saveState.description"
        with pytest.raises(InvalidInputError):
            await tc.save_weights_for_sampler(description=description)
        assert emulator.session_state(tc.model_id)["operations"] == {}  # nothing was sent
        saved = await tc.save_state(description="fine: é, 10% — ok")
        assert saved.path.startswith("arn:aws:sagemaker:")


async def test_an_optimizer_step_past_the_service_s_limits_is_refused_at_once_and_the_client_goes_on(emulator):
    """learning_rate 0.5 (SageMaker's maximum is 0.01) was refused after the op took its number, which poisoned the
    training client: the next, valid optim_step was a PoisonedError."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        with pytest.raises(InvalidInputError) as err:
            await tc.optim_step(AdamParams(learning_rate=0.5))
        assert "learningRate" in (err.value.field or "")
        await tc.forward_backward(BATCH, "cross_entropy")
        step = await tc.optim_step(AdamParams(learning_rate=0.001))
        assert step is not None
        assert [op["status"] for op in emulator.session_state(tc.model_id)["operations"].values()] == ["Completed", "Completed"]


async def test_a_checkpoint_of_another_lora_rank_resumes_at_its_rank_or_is_refused_naming_it(emulator):
    """A rank-8 checkpoint: the client that saved it resumes it at rank 8 (the default rank 32 is not asked of the
    service) and refuses to load it into its rank-16 session before numbering; a client that does not know the package
    learns the rank from the service's ValidationException, and the session it created for the resume is stopped.
    The rank-8 package was loaded into rank-32 sessions, and the engine refused it after numbering."""
    sm = clients(emulator.url)[0]
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8)
        path = (await tc.save_state()).path
        resumed = await svc.create_training_client_from_state(path)
        assert resumed.get_info().lora_rank == 8
        detail = sm.describe_training_session(TrainingSessionName=resumed.model_id)["TrainingSessionDetail"]
        assert detail["LoraConfig"] == {"Rank": 8, "Alpha": 16}
        assert (await resumed.forward(BATCH, "cross_entropy")).loss_fn_outputs
        other = await svc.create_lora_training_client(BASE, rank=16)
        with pytest.raises(InvalidInputError, match="rank 8") as err:
            other.load_state(path)
        assert err.value.field == "rank" and "rank=8" in (err.value.fix or "")
        assert other.forward_backward(BATCH, "cross_entropy").seq == 1  # the refusal took no number

    def running() -> set[str]:
        return {s["TrainingSessionArn"] for s in sm.list_training_sessions(StatusEquals="Running")["TrainingSessionSummaries"]}

    before = running()
    async with asyncsess.ServiceClient(driver_url(emulator)) as fresh:  # knows nothing of the package
        with pytest.raises(InvalidInputError, match="rank 8") as err:
            await fresh.create_training_client_from_state(path, rank=16)
        assert "LoraConfig.Rank 8" in str(err.value)
        assert running() <= before
        assert (await (await fresh.create_training_client_from_state(path, rank=8)).forward(BATCH, "cross_entropy")).loss_fn_outputs


async def test_sampled_sequences_carry_distinct_sequence_ids_to_name_in_spans(emulator):
    """sequence_id was None on sagemaker:// (mock:// and local:// name every sequence), so Tinker provenance spans
    could not name a sampled sequence."""
    from asyncsess.types import SampledProvenanceSpan

    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8)
        sc = await tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
        first, second = [await sc.sample([1, 40, 41], 3, params) for _ in range(2)]
    ids = [s.sequence_id for s in first.sequences + second.sequences]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 6
    assert [SampledProvenanceSpan(sequence_id=i, length=1).sequence_id for i in ids] == ids


ELSEWHERE = {
    "another account": "arn:aws:sagemaker:us-west-2:999999999999:model-package/sagemaker-default/1",
    "another region": "arn:aws:sagemaker:eu-west-1:111122223333:model-package/sagemaker-default/1",
}


@pytest.mark.parametrize("where", sorted(ELSEWHERE))
async def test_a_model_package_of_another_account_or_region_is_refused_naming_the_field_before_any_call(emulator, where):
    """A sampler on another account's package created a training session first, then failed with a ValidationException
    naming no field; load_state and resuming were a NotFoundError, and a group of another account a ResourceNotFound
    naming no field. The service takes only its own account's and region's packages: refused before any call."""
    arn = ELSEWHERE[where]
    sm = clients(emulator.url)[0]
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        sessions = len(sm.list_training_sessions()["TrainingSessionSummaries"])
        calls = {
            "model_path": lambda: svc.create_sampling_client(model_path=arn),
            "path": lambda: svc.create_training_client_from_state(arn, rank=4),
            "model_package_group_arn": lambda: svc.create_lora_training_client(
                BASE, rank=4, model_package_group_arn=arn.replace("model-package/", "model-package-group/").rsplit("/", 1)[0]
            ),
        }
        for field, call in calls.items():
            with pytest.raises(InvalidInputError) as err:
                await call()
            assert err.value.field == field and "account" in str(err.value), err.value
        with pytest.raises(InvalidInputError) as err:
            tc.load_state(arn)
        assert err.value.field == "path"
        assert len(sm.list_training_sessions()["TrainingSessionSummaries"]) == sessions  # no session was created
        assert tc.current_sequence_number == 0 and emulator.session_state(tc.model_id)["operations"] == {}


def test_cli_emulate_takes_accounts_and_refuses_bad_options_by_name(monkeypatch):
    """A bad option (a negative latency, an account id that is no 12 digits) was a pydantic traceback."""
    from typer.testing import CliRunner

    import asyncsess_sagemaker.emulator as emulator_pkg
    from asyncsess_sagemaker.cli import app

    served = []
    monkeypatch.setattr(emulator_pkg, "serve", lambda backend, host, port, config: served.append(config))
    ok = CliRunner().invoke(app, ["--account", "AKIDA:sec:ret:111122223333", "--account", "AKIDB:s2:444455556666"])
    assert ok.exit_code == 0, ok.output
    keys = served[0].accounts
    assert (keys["AKIDA"].secret_access_key, keys["AKIDA"].account_id, keys["AKIDB"].account_id) == (
        "sec:ret",
        "111122223333",
        "444455556666",
    )
    for args, says in (
        (["--account", "AKIDA:sec:12345"], "account_id"),
        (["--account", "AKIDA:s:111122223333", "--account", "AKIDA:t:111122223333"], "once"),
        (["--latency-ms", "-5"], "latency_s"),
    ):
        bad = CliRunner().invoke(app, args)  # a one-command app: its command runs without its name
        assert bad.exit_code == 2 and says in bad.output, bad.output
    assert len(served) == 1


async def test_delete_model_package_keeps_the_artifacts_and_refuses_to_delete_them(emulator):
    """sagemaker-train's ``delete_model_package(arn)`` answers a ``ModelPackageDeletion``: the driver deletes the
    record only, so ``artifacts_retained`` is True; ``delete_artifacts=True`` (which it cannot honour) was silently
    ignored and is now refused before anything is deleted; a package already gone answers ``model_package_deleted=False``."""
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        state = await tc.save_state("s")
        with pytest.raises(UnsupportedError, match="delete_artifacts"):
            await svc.delete_model_package(state.model_package_arn, delete_artifacts=True)
        await tc.load_state(state.path)  # nothing was deleted
        result = await svc.delete_model_package(state.model_package_arn)
        assert result.model_package_deleted and result.artifacts_retained and result.retained_reason
        assert (await svc.delete_model_package(state.model_package_arn)).model_package_deleted is False


async def test_clients_name_their_training_session_and_model_package_as_the_official_sdk_does(emulator):
    """sagemaker-train's ``TrainingClient.training_session_name`` and ``SamplingClient.training_session_name`` /
    ``model_package_arn`` were missing (AttributeError): the session a client runs on, and the package a sampler samples."""
    sm, _ = clients(emulator.url)
    async with asyncsess.ServiceClient(driver_url(emulator)) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        assert tc.training_session_name == tc.model_id
        assert sm.describe_training_session(TrainingSessionName=tc.training_session_name)["TrainingSessionDetail"]
        on_tc = await tc.save_weights_and_get_sampling_client()
        assert on_tc.training_session_name == tc.training_session_name
        assert on_tc.model_package_arn is not None and ":model-package/" in on_tc.model_package_arn
        own = await svc.create_sampling_client(base_model=BASE)
        assert own.model_package_arn is None
        name = own.training_session_name
        assert name != tc.training_session_name and "." not in name  # a session, not the sampler id
        assert sm.describe_training_session(TrainingSessionName=name)["TrainingSessionDetail"]["TrainingSessionStatus"] == "Running"
        await own.stop()
        assert own.training_session_name == name  # kept after the stop, as the SDK's attribute
        assert wait_status(sm, name, {"Stopped"})["TrainingSessionStatus"] == "Stopped"
