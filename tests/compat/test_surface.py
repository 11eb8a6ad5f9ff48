"""The anchors' calls that used to break, on mock:// (sync facade and async), each checked for its effect."""

from __future__ import annotations

import pytest

import asyncsess.sync as sync
from asyncsess import AdamParams, ConflictError, InvalidInputError, NotFoundError, ServiceClient

pytestmark = pytest.mark.anyio
BASE = "mock/bigram-tiny"
GROUP = "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/my-group"
DATA = [[1, 40, 41, 42]]
INPUTS = {"target_tokens": [40, 41, 42, 2], "weights": [1.0] * 4}


def test_sagemaker_create_call_with_per_call_options_is_recorded_in_get_info():
    with sync.ServiceClient("mock://") as service_client:
        training_client = service_client.create_lora_training_client(
            BASE,
            training_session_name="grpo-run-1",
            rank=32,
            alpha=64,
            model_package_group_arn=GROUP,
            s3_output_path="s3://my-bucket/output",
        )
        info = training_client.get_info()
        assert (info.lora_rank, info.lora_alpha) == (32, 64)
        assert info.session_options == {
            "training_session_name": "grpo-run-1",
            "model_package_group_arn": GROUP,
            "s3_output_path": "s3://my-bucket/output",
        }


def test_a_descriptive_save_is_a_description_and_the_run_keeps_going():
    with sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client(BASE, rank=4)
        first = tc.save_state("final checkpoint").result()
        second = tc.save_state(description="after 10 steps", user_metadata={"step": "10"}).result()
        named = tc.save_state("step-10", description="ten steps in").result()
        tc.forward_backward(DATA, "cross_entropy", INPUTS).result()  # SageMaker's positional loss_fn_inputs
        assert tc.optim_step(optim_params=AdamParams(learning_rate=0.1)).result().step == 1
        assert named.path.endswith("/weights/step-10")
        rows = {c.path: c for c in svc.list_model_packages(kind="CHECKPOINT", max_results=10)}
        assert rows[first.path].description == "final checkpoint"
        assert rows[second.path].description == "after 10 steps" and rows[second.path].user_metadata == {"step": "10"}
        assert rows[named.path].description == "ten steps in"
        assert svc.get_latest_model_package("CHECKPOINT").path == named.path  # newest first


def test_overwrite_and_conflicts():
    with sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client(BASE, rank=4)
        tc.save_state("ckpt").result()
        with pytest.raises(ConflictError, match="overwrite=True"):
            tc.save_state("ckpt")
        with pytest.raises(InvalidInputError, match="merge_weights"):
            tc.save_weights_for_sampler("w", 3600)  # a Tinker positional ttl_seconds: refused, and "w" stays free
        assert tc.save_weights_for_sampler("w").result().path.endswith("/w")
        seq = tc.current_sequence_number
        tc.forward_backward(DATA, "cross_entropy", None, INPUTS)
        tc.optim_step(AdamParams(learning_rate=0.5)).result()
        again = tc.save_state("ckpt", overwrite=True).result()
        assert tc.current_sequence_number == seq + 3
        resumed = svc.create_training_client_from_state_with_optimizer(again.path, user_metadata={"from": "ckpt"})
        assert resumed.get_info().step == 1 and resumed.get_info().user_metadata == {"from": "ckpt"}


def test_model_packages_sampling_by_arn_and_deletion():
    with sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client(BASE, rank=4)
        saved = tc.save_weights_for_sampler(description="for eval").result()
        sc = svc.create_sampling_client(model_package_arn=saved.model_package_arn)
        assert len(sc.sample([1, 40], 2, {"max_tokens": 3}).result().sequences) == 2
        assert [c.path for c in tc.list_model_packages(kind="MODEL")] == [saved.path]
        svc.delete_model_package(saved.model_package_arn)
        assert saved.path not in [c.path for c in svc.list_model_packages(kind="MODEL", max_results=1000)]
        with pytest.raises(NotFoundError):
            svc.delete_checkpoint(saved.path)


async def test_sessions_can_be_listed_described_stopped_and_deleted():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4, user_metadata={"owner": "me"})
        sc = await svc.create_sampling_client(base_model=BASE)
        rows = await svc.list_sessions()
        assert {r.session_id for r in rows} == {tc.model_id, sc.sampler_id}
        assert (await svc.describe_session(tc.model_id)).user_metadata == {"owner": "me"}
        with pytest.raises(ConflictError, match="stop_if_active"):
            await svc.delete_session(tc.model_id)
        await svc.stop_session(sc.sampler_id)
        assert (await svc.describe_session(sc.sampler_id)).training_session_status == "Stopped"
        await svc.delete_session(tc.model_id, stop_if_active=True)
        assert [r.session_id for r in await svc.list_sessions(status_equals="Deleted")] == [tc.model_id]
        with pytest.raises(NotFoundError):
            await svc.describe_session("nope")


async def test_rest_client_lists_runs_and_checkpoints():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client(BASE, rank=4)
        state = await tc.save_state("s1")
        rest = svc.create_rest_client()
        runs = (await rest.list_training_runs()).training_runs
        assert [r.training_run_id for r in runs] == [tc.model_id]
        assert runs[0].last_checkpoint.path == state.path
        ckpts = (await rest.list_checkpoints(tc.model_id)).checkpoints
        await rest.delete_checkpoint(tc.model_id, ckpts[0].checkpoint_id)
        assert state.path not in [c.path for c in (await rest.list_user_checkpoints()).checkpoints]  # the store is process-wide
        assert (await rest.list_checkpoints(tc.model_id)).checkpoints == []


async def test_async_twins_follow_the_anchors():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client_async(BASE, rank=4)
        fut = await tc.forward_backward_async(DATA, "cross_entropy", None, INPUTS)  # double await
        assert (await fut).metrics["loss:sum"] > 0
        assert (await (await tc.optim_step_async(AdamParams(learning_rate=0.1)))).step == 1
        sc = await tc.save_weights_and_get_sampling_client_async()
        resp = await sc.sample_async([1, 40], 1, {"max_tokens": 2})  # the value itself
        assert len(resp.sequences) == 1
        assert len(await sc.compute_logprobs_async([1, 40, 41])) == 3


async def test_close_records_the_first_reason():
    svc = ServiceClient("mock://")
    await svc.__aenter__()
    tc = await svc.create_lora_training_client(BASE, rank=4)
    with pytest.raises(InvalidInputError):
        await svc.close("finished")
    await svc.close("errored", "loss went NaN")
    await svc.close("success")
    assert (svc.close_status, svc.close_detail) == ("errored", "loss went NaN")
    assert tc._stopped


def test_sync_close_takes_a_status():
    svc = sync.ServiceClient("mock://")
    svc.create_lora_training_client(BASE, rank=4)
    svc.close("interrupted", "ctrl-c")
    assert svc._async.close_status == "interrupted"


def test_a_blocking_tinker_loop_ported_by_its_import_finds_types_and_errors():
    """A blocking Tinker script is ported by ``import asyncsess.sync as tinker``; it reaches its types as
    ``tinker.types.X`` / ``from tinker import types`` and catches ``tinker.BadRequestError`` and friends. The sync
    module had neither ``types`` nor any error class (AttributeError at the first ``except tinker.…``)."""
    from asyncsess import errors, types

    tinker = sync
    assert tinker.types is types
    for name in ("TinkerError", "APIError", "APIStatusError", "BadRequestError", "NotFoundError", "RequestFailedError", "ConflictError"):
        assert getattr(tinker, name) is getattr(errors, name)
    with tinker.ServiceClient("mock://") as service_client:
        training_client = service_client.create_lora_training_client(base_model=BASE, rank=4)
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([1, 40, 41]), loss_fn_inputs={"target_tokens": [40, 41, 42], "weights": [1.0] * 3}
        )
        out = training_client.forward_backward([datum], "cross_entropy").result()
        assert out.metrics["loss:sum"] > 0
        short = tinker.types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": [40, 41], "weights": [1.0] * 2})
        with pytest.raises(tinker.BadRequestError, match="target_tokens"):
            training_client.forward_backward([short], "cross_entropy")


def test_a_client_resumed_from_a_checkpoint_reports_its_lora_rank():
    """``create_training_client_from_state(path)`` takes the LoRA settings saved there (local:// did); mock://
    reported the factory's default rank 32 for a rank-8 checkpoint, in ``get_info`` and the run's listing."""
    with sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client(BASE, rank=8, alpha=16)
        path = tc.save_state("r8").result().path
        for resumed in (svc.create_training_client_from_state(path), svc.create_training_client_from_state_with_optimizer(path)):
            info = resumed.get_info()
            assert (info.lora_rank, info.lora_alpha) == (8, 16)
            assert svc.create_rest_client().get_training_run(resumed.model_id).result().lora_rank == 8


def test_sagemaker_session_and_package_attributes_through_the_sync_facade():
    """sagemaker-train's ``training_session_name`` (both clients) and ``SamplingClient.model_package_arn`` were an
    AttributeError; on mock:// a sampler is a session of its own."""
    import pickle

    from asyncsess import SessionGoneError

    with sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client(BASE, rank=4)
        assert tc.training_session_name == tc.model_id
        path = tc.save_weights_for_sampler("w").result().path
        sc = svc.create_sampling_client(model_package_arn=path)
        assert (sc.model_package_arn, sc.training_session_name) == (path, sc.sampler_id)
        assert svc.create_sampling_client(base_model=BASE).model_package_arn is None
        copy = pickle.loads(pickle.dumps(sc._async))  # detached until opened: it names no session yet
        with pytest.raises(SessionGoneError, match="unpickled"):
            _ = copy.training_session_name
