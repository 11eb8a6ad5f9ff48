"""The official ``sagemaker-train`` SDK (a client nobody here wrote) runs SFT and GRPO loops against the emulator.

It is pointed at the emulator only through its endpoint environment variables. Needs
``pip install 'asyncsess-sagemaker[sdk]'`` (the nox 'sagemaker' session installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError

from asyncsess_sagemaker.emulator import EmulatorConfig, RunningEmulator, running_emulator

from .helpers import ROLE, clients

ts = pytest.importorskip("sagemaker.train.training_session", reason="install asyncsess-sagemaker[sdk] (the nox 'sagemaker' session does)")

pytestmark = pytest.mark.sagemaker

GROUP = "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/sdk-runs"
BASE_ARN = "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/mock-bigram-tiny/1.0.0"


@pytest.fixture(scope="module")
def sdk_emulator() -> Iterator[RunningEmulator]:
    # Running as soon as Create answers, and result polls that wait up to 1 s for completion: the SDK sleeps
    # 10 s between Describes and 2 s between polls, which would only make this test slow.
    with running_emulator("mock://", EmulatorConfig(check_responses=True, startup_s=0.0, result_wait_s=1.0)) as emu:
        clients(emu.url)[0].create_model_package_group(ModelPackageGroupName="sdk-runs")
        yield emu


@pytest.fixture
def service(sdk_emulator: RunningEmulator, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SAGEMAKER_TRAINING_SESSION_ENDPOINT", sdk_emulator.url)
    monkeypatch.setenv("SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT", sdk_emulator.url)
    return ts.ServiceClient(region="us-west-2", role_arn=ROLE, model_package_group_arn=GROUP, s3_output_path="s3://bucket/sdk")


def _sft_datum(tokens: list[int]) -> Any:
    n = len(tokens) - 1
    return ts.Datum(model_input=ts.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


def test_sdk_sft_loop_lowers_the_loss_and_saves_a_checkpoint(service, sdk_emulator):
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        batch = [_sft_datum([1, 40, 41, 42, 43, 2]), _sft_datum([1, 50, 51, 52, 2])]
        losses = []
        for _ in range(4):
            fb = tc.forward_backward(batch, "cross_entropy")
            opt = tc.optim_step(ts.AdamParams(learning_rate=0.01))
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        assert losses[-1] < losses[0]
        state = tc.save_state("sft done").result()
        assert state.model_package_arn.startswith("arn:aws:sagemaker:us-west-2:111122223333:model-package/sdk-runs/")
        infos = service.list_model_packages(kind=ts.ModelPackageKind.CHECKPOINT)
        assert state.model_package_arn in [i.model_package_arn for i in infos]
        assert sdk_emulator.session_state(tc.training_session_name)["applied"] == list(range(1, 10))
    finally:
        tc.stop()
    assert service.list_sessions(name_contains=tc.training_session_name)[0].status in ("Stopping", "Stopped")


def test_sdk_loop_goes_on_after_an_op_the_service_refuses(service, sdk_emulator):
    """The SDK never sends a sequence number twice: a refused op's number was never filled, so the next op
    waited for it and the gap timeout failed the session (every later op failed)."""
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        with pytest.raises(ClientError) as err:
            tc.forward_backward([_sft_datum([1, 40, 9999])], "cross_entropy").result()  # a token id past the vocabulary
        assert err.value.response["Error"]["Code"] == "ValidationException"
        fb = tc.forward_backward([_sft_datum([1, 40, 41, 42])], "cross_entropy")
        opt = tc.optim_step(ts.AdamParams(learning_rate=0.01))
        assert fb.result().metrics["loss:sum"] > 0
        opt.result()
        assert sdk_emulator.session_state(tc.training_session_name)["applied"] == [2, 3]
    finally:
        tc.stop()


def test_sdk_batch_shaped_loss_inputs_are_refused_and_the_session_keeps_running(service, sdk_emulator):
    """The SDK flattens nested lists and sends their shape: ``[[t1, t2, t3]]`` (a batch dimension, as from
    ``tensor.unsqueeze(0)``) goes out as shape [1, 3]. The emulator took it, the engine refused it, and the failed
    op failed the session: every later op was a ConflictException."""
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        batched = ts.Datum(
            model_input=ts.ModelInput.from_ints([1, 40, 41]),
            loss_fn_inputs={"target_tokens": [[40, 41, 42]], "weights": [[1.0, 1.0, 1.0]]},
        )
        with pytest.raises(ClientError) as err:
            tc.forward_backward([batched], "cross_entropy").result()
        assert err.value.response["Error"]["Code"] == "ValidationException"
        assert "lossFnInputs['target_tokens'].shape" in err.value.response["Error"]["Message"]
        assert tc.forward_backward([_sft_datum([1, 40, 41, 42])], "cross_entropy").result().metrics["loss:sum"] > 0
        assert sdk_emulator.session_state(tc.training_session_name)["status"] == "Running"
    finally:
        tc.stop()


def test_sdk_input_past_the_model_context_is_refused_and_the_session_keeps_running(service, sdk_emulator):
    """The hub publishes the model's context (MaxContextLength 512 for mock/bigram-tiny); a longer datum was taken, the
    engine refused it and the failed op failed the session (every later op a ConflictException); a longer prompt
    was taken and its operation failed afterwards."""
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        with pytest.raises(ClientError) as err:
            tc.forward_backward([_sft_datum([1] + [40] * 600)], "cross_entropy").result()
        assert err.value.response["Error"]["Code"] == "ValidationException"
        assert "datumList[0].modelInput" in err.value.response["Error"]["Message"] and "512" in err.value.response["Error"]["Message"]
        assert tc.forward_backward([_sft_datum([1, 40, 41, 42])], "cross_entropy").result().metrics["loss:sum"] > 0
        sampler = tc.save_weights_and_get_sampling_client()
        with pytest.raises(ClientError) as err:
            sampler.compute_logprobs(ts.ModelInput.from_ints([1] + [40] * 600)).result()
        assert err.value.response["Error"]["Code"] == "ValidationException" and "prompt" in err.value.response["Error"]["Message"]
        assert sdk_emulator.session_state(tc.training_session_name)["status"] == "Running"
    finally:
        tc.stop()


def _rl_datum(tokens: list[int], **extra: list[float]) -> Any:
    n = len(tokens) - 1
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * n, "advantages": [1.0] * n, "logprobs": [-1.0] * n, **extra}
    return ts.Datum(model_input=ts.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    "batch, loss, config, says",
    [
        ([_sft_datum([1, 40, 41])], "cross_entropy", {"clip_low_threshold": 0.8}, "cross_entropy takes no key"),
        ([_rl_datum([1, 40, 41], ref_log_prob=[-1.0, -1.0]), _rl_datum([1, 50, 51])], "ppo", None, "same lossFnInputs keys"),
    ],
)
def test_sdk_batches_the_engine_cannot_run_are_refused_and_the_session_keeps_running(service, sdk_emulator, batch, loss, config, says):
    """Both were taken, the engine refused them (clip thresholds on a loss without a ratio; a key on some datums
    only) and the failed op failed the session: every later op was a ConflictException."""
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        with pytest.raises(ClientError) as err:
            tc.forward_backward(batch, loss, loss_fn_config=config).result()
        assert err.value.response["Error"]["Code"] == "ValidationException" and says in err.value.response["Error"]["Message"]
        assert tc.forward_backward([_sft_datum([1, 40, 41, 42])], "cross_entropy").result().metrics["loss:sum"] > 0
        assert sdk_emulator.session_state(tc.training_session_name)["status"] == "Running"
    finally:
        tc.stop()


def test_sdk_grpo_loop_samples_trains_and_refreshes_the_sampler(service, sdk_emulator):
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    try:
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = [1, 40, 41]
        for step in range(2):
            result = sampler.sample(
                ts.ModelInput.from_ints(prompt), num_samples=4, sampling_params=ts.SamplingParams(max_tokens=512, seed=step)
            ).result()
            assert len(result.sequences) == 4
            rewards = [float(sum(t % 2 == 0 for t in s.tokens[:8])) for s in result.sequences]
            mean = sum(rewards) / len(rewards)
            datums = []
            for seq, r in zip(result.sequences, rewards):
                tokens = prompt + list(seq.tokens[:8])
                n = len(tokens) - 1
                adv = [0.0] * (len(prompt) - 1) + [r - mean] * (n - len(prompt) + 1)
                old = [0.0] * (len(prompt) - 1) + list(seq.logprobs[:8])
                datums.append(
                    ts.Datum(
                        model_input=ts.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n, "advantages": adv, "logprobs": old},
                    )
                )
            fb = tc.forward_backward(datums, "ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
            tc.optim_step(ts.AdamParams(learning_rate=0.01)).result()
            assert fb.result().metrics
            sampler = tc.save_weights_and_get_sampling_client()
        logprobs = sampler.compute_logprobs(ts.ModelInput.from_ints(prompt)).result()
        assert len(logprobs) >= 2
        state = sdk_emulator.session_state(tc.training_session_name)
        assert state["applied"] == list(range(1, 8))  # saveWeights, then (fb, optim, saveWeights) twice
        assert {op["status"] for op in state["operations"].values()} == {"Completed"}
    finally:
        tc.stop()


def test_sdk_resumes_from_the_latest_checkpoint_and_deletes_packages(service, sdk_emulator):
    """The SDK's resume and clean-up flow: latest package of each kind, a client from the checkpoint with its
    optimizer (at the checkpoint's LoRA rank: the SDK's default rank 32 is refused naming both), and delete_model_package (DeleteModelPackage answers nothing, which the response check took for
    an emulator bug: a 500, so the SDK reported the deleted package as not deleted)."""
    tc = service.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    batch = [_sft_datum([1, 40, 41, 42, 43, 2])]
    try:
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(ts.AdamParams(learning_rate=0.01)).result()
        checkpoint = tc.save_state("resume me").result().model_package_arn
        weights = tc.save_weights_for_sampler("deploy me").result().model_package_arn
    finally:
        tc.stop()
    assert service.get_latest_model_package(ts.ModelPackageKind.CHECKPOINT).model_package_arn == checkpoint
    assert service.get_latest_model_package(ts.ModelPackageKind.MODEL).model_package_arn == weights
    with pytest.raises(ClientError, match="rank 8; this session has rank 32") as err:  # the SDK's default rank is 32
        service.create_training_client_from_state_with_optimizer(checkpoint)
    assert err.value.response["Error"]["Code"] == "ValidationException"
    resumed = service.create_training_client_from_state_with_optimizer(checkpoint, rank=8, alpha=16)
    try:
        assert resumed.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        resumed.stop()
    gone = service.delete_model_package(weights)
    assert gone.model_package_deleted and gone.artifacts_retained
    assert weights not in [i.model_package_arn for i in service.list_model_packages(max_results=None)]
    assert not service.delete_model_package(weights).model_package_deleted  # already gone: idempotent


def test_sdk_reads_prompt_logprobs_and_their_top_k(service):
    """The SDK types a sample's promptLogprobs List[float]: a null for the first token made every
    include_prompt_logprobs=True sample fail in its own response parsing."""
    sampler = service.create_sampling_client(base_model=BASE_ARN)
    prompt = ts.ModelInput.from_ints([1, 40, 41, 42])
    params = ts.SamplingParams(max_tokens=512, seed=0)
    result = sampler.sample(prompt, num_samples=1, sampling_params=params, include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    computed = sampler.compute_logprobs(prompt).result()
    assert computed[0] is None and len(computed) == 4
    assert result.prompt_logprobs == pytest.approx(computed[1:], abs=1e-5)  # the scored tokens, in order
    assert len(result.topk_prompt_logprobs) >= 3 and all(len(row) <= 2 for row in result.topk_prompt_logprobs)


def test_aws_quickstart_wire_dict_datums_on_asyncsess() -> None:
    """AWS docs, "Python SDK reference" / "Getting started with the training session APIs"
    (https://docs.aws.amazon.com/sagemaker/latest/dg/training-sessions-sdk.md, "At a glance"): PAIRS of prompt and
    response, ``tok.encode(..., add_special_tokens=False)``, and loss inputs made with the SDK's
    ``_serialize_loss_fn_inputs``, which gives the wire form the SDK also takes as a whole datum
    (``{"modelInput": ..., "lossFnInputs": ...}``). The page's text past ``eos = tok.eos_to...`` was not retrievable
    offline: the datum is built in that wire form, as the import implies. asyncsess refused the camelCase keys
    (``data[0].model_input: Field required``); it now takes them as the SDK does."""
    from sagemaker.train.training_session._utils import _serialize_loss_fn_inputs

    from asyncsess.sync import AdamParams, ServiceClient  # was: from sagemaker.train.training_session import ...

    PAIRS = [("Question: 2+2?\nAnswer:", " 4"), ("Capital of France?", " Paris")]
    svc = ServiceClient(
        "mock://",  # was: region="us-west-2",
        role_arn="arn:aws:iam::111122223333:role/MyRole",
        model_package_group_arn="arn:aws:sagemaker:us-west-2:111122223333:model-package-group/my-training-session-checkpoints",
        s3_output_path="s3://amzn-s3-demo-bucket/training-sessions/",
    )
    tc = svc.create_lora_training_client(base_model=svc.list_base_models()[0], rank=32, alpha=64)
    tok = tc.get_tokenizer()
    batch = []
    for prompt, response in PAIRS:
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        ids = tok.encode(prompt + response, add_special_tokens=False)
        prompt_len = len(prompt_ids)
        eos = tok.eos_token_id
        ids = ids + [eos]
        weights = [0.0] * (prompt_len - 1) + [1.0] * (len(ids) - prompt_len)
        batch.append(
            {
                "modelInput": {"chunks": [{"tokens": ids[:-1], "type": "encoded_text"}]},
                "lossFnInputs": _serialize_loss_fn_inputs({"target_tokens": ids[1:], "weights": weights}),
            }
        )
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(batch, loss_fn="cross_entropy")
        tc.optim_step(AdamParams(learning_rate=0.1)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0], losses
    assert tc.save_state("quickstart").result().model_package_arn
    tc.stop()
    svc.close()
