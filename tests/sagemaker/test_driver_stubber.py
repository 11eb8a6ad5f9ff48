"""botocore Stubber: the exact request the driver sends for every op (no HTTP, no emulator)."""

from __future__ import annotations

import datetime as dt
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.stub import ANY, Stubber

from asyncsess.backends import (
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    TrainingSessionSpec,
)
from asyncsess.errors import InvalidInputError, UnsupportedError
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from asyncsess_sagemaker.driver import SageMakerBackend
from asyncsess_sagemaker.options import SageMakerOptions

from .helpers import REGION, ROLE

pytestmark = [pytest.mark.sagemaker, pytest.mark.anyio]

GROUP = "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/exp"
HUB = "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/tiny-model/1.0.0"
PKG = "arn:aws:sagemaker:us-west-2:111122223333:model-package/exp/7"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


class Stubs:
    def __init__(self, backend: SageMakerBackend) -> None:
        self.control = Stubber(backend.control)
        self.runtime = Stubber(backend.runtime)
        self.name = ""

    def detail(self, status: str) -> dict[str, Any]:
        return {
            "TrainingSessionDetail": {
                "TrainingSessionArn": f"arn:aws:sagemaker:us-west-2:111122223333:training-session/{self.name or 'x'}",
                "TrainingSessionName": self.name or "x",
                "TrainingSessionStatus": status,
                "CreationTime": NOW,
            }
        }

    def create(self, rank: int = 8, alpha: int = 16) -> None:
        self.control.add_response(
            "list_hub_contents",
            {
                "HubContentSummaries": [
                    {
                        "HubContentName": "tiny-model",
                        "HubContentArn": HUB,
                        "HubContentVersion": "1.0.0",
                        "HubContentType": "Model",
                        "DocumentSchemaVersion": "2.4.0",
                        "HubContentStatus": "Available",
                        "CreationTime": NOW,
                        "HubContentSearchKeywords": ["@huggingface-id:org/tiny-model"],
                    }
                ]
            },
            {"HubName": "SageMakerPublicHub", "HubContentType": "Model"},
        )
        self.control.add_response(
            "describe_hub_content",
            {
                "HubContentName": "tiny-model",
                "HubContentArn": HUB,
                "HubContentVersion": "1.0.0",
                "HubContentType": "Model",
                "DocumentSchemaVersion": "2.4.0",
                "HubName": "SageMakerPublicHub",
                "HubArn": "arn:aws:sagemaker:us-west-2:aws:hub/SageMakerPublicHub",
                "HubContentDocument": json.dumps({"HuggingfaceId": "org/Tiny-Model"}),
                "HubContentStatus": "Available",
                "CreationTime": NOW,
            },
            {"HubName": "SageMakerPublicHub", "HubContentType": "Model", "HubContentName": "tiny-model"},
        )
        self.control.add_response(
            "create_training_session",
            {"TrainingSessionArn": "arn:aws:sagemaker:us-west-2:111122223333:training-session/x"},
            {
                "TrainingSessionName": ANY,
                "ModelPackageGroupArn": GROUP,
                "LoraConfig": {"Rank": rank, "Alpha": alpha},
                "RoleArn": ROLE,
                "ModelConfig": {"BaseModelArn": HUB},
                "OutputConfig": {"S3Location": {"Path": "s3://bucket/out", "KmsKeyArn": "arn:aws:kms:us-west-2:111122223333:key/abc"}},
                "VpcConfig": {"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1", "subnet-2"]},
            },
        )
        self.control.add_response("describe_training_session", self.detail("Scheduled"), {"TrainingSessionName": ANY})
        self.control.add_response("describe_training_session", self.detail("Running"), {"TrainingSessionName": ANY})

    def training(self, seq: int, token: str, config: dict[str, Any], result: dict[str, Any] | None = None, **extra: Any) -> None:
        op_id = f"op-{seq}"
        self.runtime.add_response(
            "execute_training_operation",
            {"operationId": op_id},
            {"trainingSessionName": self.name, "sequenceNumber": seq, "clientToken": token, "operationConfig": config},
        )
        self.runtime.add_response(
            "get_training_operation_result", {"status": "InProgress"}, {"trainingSessionName": self.name, "operationId": op_id}
        )
        done: dict[str, Any] = {"status": "Completed", **extra}
        if result is not None:
            done["operationResult"] = result
        self.runtime.add_response("get_training_operation_result", done, {"trainingSessionName": self.name, "operationId": op_id})

    def sampling(self, n: int, config: dict[str, Any], result: dict[str, Any]) -> None:
        self.runtime.add_response(
            "execute_sampling_operation", {"operationId": f"s-{n}"}, {"trainingSessionName": self.name, "operationConfig": config}
        )
        self.runtime.add_response(
            "get_sampling_operation_result",
            {"status": "Completed", "operationResult": result},
            {"trainingSessionName": self.name, "operationId": f"s-{n}"},
        )


@pytest.fixture
async def stubbed(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SageMakerBackend, Stubs]]:
    """A driver on stubbed clients; ``@pytest.mark.parametrize("stubbed", [{option: value}], indirect=True)`` adds options."""
    options = SageMakerOptions(
        region=REGION,
        role_arn=ROLE,
        model_package_group_arn=GROUP,
        s3_output_path="s3://bucket/out",
        kms_key_arn="arn:aws:kms:us-west-2:111122223333:key/abc",
        vpc_config={"security_group_ids": ["sg-1"], "subnets": ["subnet-1", "subnet-2"]},
        tokenizer_backend="mock://",
        **getattr(request, "param", {}),
    )
    backend = SageMakerBackend(options)
    await backend.open()
    stubs = Stubs(backend)
    with stubs.control, stubs.runtime:
        yield backend, stubs
    backend._sessions.clear()  # nothing to stop: there is no service behind the stubs
    await backend.aclose()


def _datum(tokens: list[int], **inputs: list[float]) -> Datum:
    lfi: dict[str, Any] = {"target_tokens": tokens[1:], **inputs}
    return Datum(model_input=tokens[:-1], loss_fn_inputs=lfi)


def _wire_tensor(values: list[Any], dtype: str) -> dict[str, Any]:
    return {"data": values, "dtype": dtype, "shape": [len(values)]}


async def test_every_op_sends_the_documented_request(stubbed):
    backend, stubs = stubbed
    stubs.create(rank=8, alpha=16)
    info = await backend.create_training_session(TrainingSessionSpec(base_model="org/tiny-model", rank=8))
    assert info.base_model == "org/Tiny-Model" and info.lora_alpha == 16.0
    stubs.name = name = info.model_id
    assert name.startswith("asyncsess-")

    ce = _datum([1, 5, 6, 7], weights=[0.0, 1.0, 1.0])
    wire_ce = {
        "modelInput": {"chunks": [{"tokens": [1, 5, 6], "type": "encoded_text"}]},
        "lossFnInputs": {"target_tokens": _wire_tensor([5, 6, 7], "int64"), "weights": _wire_tensor([0.0, 1.0, 1.0], "float32")},
    }
    fwd_result = {
        "lossFnOutputType": "TensorData",
        "lossFnOutputs": [{"logprobs": _wire_tensor([-1.0, -2.0, -3.0], "float32")}],
        "metrics": {"loss:sum": 5.0},
        "tokenUsage": {"trainingTokens": 3},
    }
    stubs.training(1, "k1", {"forward": {"lossFnName": "cross_entropy", "datumList": [wire_ce]}}, {"forward": fwd_result})
    out = await backend.execute_training(name, ForwardOp(seq=1, idempotency_key="k1", data=(ce,), loss_fn="cross_entropy"))
    assert out.metrics == {"loss:sum": 5.0} and out.usage.training_tokens == 3
    assert out.loss_fn_outputs[0]["logprobs"].data == [-1.0, -2.0, -3.0]

    # An RL loss without weights: the wire requires them, so all-ones are sent (neutral).
    rl = _datum([1, 5, 6, 7], logprobs=[-1.0, -1.0, -1.0], advantages=[0.5, 0.5, 0.5])
    wire_rl = {
        "modelInput": wire_ce["modelInput"],
        "lossFnInputs": {
            "target_tokens": _wire_tensor([5, 6, 7], "int64"),
            "logprobs": _wire_tensor([-1.0, -1.0, -1.0], "float32"),
            "advantages": _wire_tensor([0.5, 0.5, 0.5], "float32"),
            "weights": _wire_tensor([1.0, 1.0, 1.0], "float32"),
        },
    }
    for seq, loss in enumerate(("ppo", "cispo", "importance_sampling"), start=2):
        config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} if loss != "importance_sampling" else None
        body: dict[str, Any] = {"lossFnName": loss, "datumList": [wire_rl]}
        if config:
            body["lossFnConfig"] = config
        stubs.training(seq, f"k{seq}", {"forwardBackward": body}, {"forwardBackward": fwd_result}, tokenUsage={"trainingTokens": 3})
        await backend.execute_training(
            name, ForwardBackwardOp(seq=seq, idempotency_key=f"k{seq}", data=(rl,), loss_fn=loss, loss_fn_config=config)
        )

    adam = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0, lora_plus_lr_ratio=16.0)
    wire_adam = {
        "learningRate": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weightDecay": 0.01,
        "gradClipNorm": 1.0,
        "loraPlusLrRatio": 16.0,
    }
    stubs.training(5, "k5", {"optimizerStep": {"adamParamsConfig": wire_adam}}, {"optimizerStep": {"metrics": {"learning_rate": 1e-3}}})
    step = await backend.execute_training(name, OptimStepOp(seq=5, idempotency_key="k5", adam_params=adam))
    assert step.step == 1 and step.metrics == {"learning_rate": 1e-3}

    stubs.training(6, "k6", {"saveWeights": {"mergeWeights": True, "description": "merged"}}, {"saveWeights": {"modelPackageArn": PKG}})
    saved = await backend.execute_training(name, SaveWeightsOp(seq=6, idempotency_key="k6", name="merged", merge_weights=True))
    assert (saved.path, saved.kind) == (PKG, "merged")
    stubs.training(7, "k7", {"saveWeights": {}}, {"saveWeights": {"modelPackageArn": PKG}})
    await backend.execute_training(name, SaveWeightsOp(seq=7, idempotency_key="k7", ephemeral=True))
    stubs.training(8, "k8", {"saveState": {"description": "final"}}, {"saveState": {"modelPackageArn": PKG}})
    state = await backend.execute_training(name, SaveStateOp(seq=8, idempotency_key="k8", name="final"))
    assert state.kind == "state" and state.model_package_arn == PKG
    stubs.training(9, "k9", {"loadState": {"modelPackageArn": PKG, "loadOptimizer": True}}, {"loadState": {}})
    await backend.execute_training(name, LoadStateOp(seq=9, idempotency_key="k9", path=PKG, with_optimizer=True))

    # Sampling on a package this session saved: named on every request (no load first unless asked, see below).
    sampler = await backend.create_sampler(SamplerSpec(model_path=PKG))
    prompt_wire = {"chunks": [{"tokens": [1, 5, 6], "type": "encoded_text"}]}
    sample_cfg = {
        "sample": {
            "prompt": prompt_wire,
            "numSamples": 2,
            "samplingParams": {"maxTokens": 512, "temperature": 0.7, "topP": 0.9, "topK": 20, "seed": 3, "stop": ["\n"]},
            "modelPackageArn": PKG,
            "includePromptLogprobs": True,
        }
    }
    sample_result = {
        "sample": {
            "sequences": [
                {"stopReason": "stop", "tokens": [9, 10], "logprobs": [-0.1, -0.2], "tokenUsage": {"prefill": 3, "decode": 2}},
                {
                    "stopReason": "stop",
                    "tokens": [9, 10, 11, 12, 13, 14],
                    "logprobs": [-0.1] * 6,
                    "tokenUsage": {"prefill": 3, "decode": 6},
                },
            ],
            "promptLogprobs": [-4.0, -5.0],
        }
    }
    stubs.sampling(2, sample_cfg, sample_result)
    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop=["\n"])
    resp = await backend.sample(
        sampler, SampleRequest(prompt=(1, 5, 6), num_samples=2, sampling_params=params, include_prompt_logprobs=True)
    )
    assert resp.sequences[0].tokens == [9, 10] and resp.sequences[0].stop_reason == "stop"
    assert resp.sequences[1].tokens == [9, 10, 11, 12] and resp.sequences[1].stop_reason == "length"  # cut to max_tokens=4
    assert resp.prompt_logprobs == [None, -4.0, -5.0]
    assert (resp.usage.prefill_tokens, resp.usage.decode_tokens) == (6, 8)

    stubs.sampling(3, {"computeLogprobs": {"prompt": prompt_wire, "modelPackageArn": PKG}}, {"computeLogprobs": {"logprobs": [-4.0, -5.0]}})
    assert await backend.compute_logprobs(sampler, [1, 5, 6]) == [None, -4.0, -5.0]

    stubs.control.add_response("stop_training_session", {}, {"TrainingSessionName": name})
    await backend.stop_session(sampler)  # a sampler on the training session's own package: nothing to stop
    await backend.stop_session(name)
    stubs.control.assert_no_pending_responses()
    stubs.runtime.assert_no_pending_responses()


@pytest.mark.parametrize("stubbed", [{"load_weights_for_sampling": True}], indirect=True)
async def test_load_weights_for_sampling_is_sent_and_awaited_when_asked(stubbed):
    backend, stubs = stubbed
    stubs.create()
    info = await backend.create_training_session(TrainingSessionSpec(base_model="org/tiny-model", rank=8))
    stubs.name = info.model_id
    stubs.training(1, "k1", {"saveWeights": {}}, {"saveWeights": {"modelPackageArn": PKG}})
    await backend.execute_training(info.model_id, SaveWeightsOp(seq=1, idempotency_key="k1", ephemeral=True))
    stubs.runtime.add_response(
        "execute_sampling_operation",
        {"operationId": "load-1"},
        {"trainingSessionName": info.model_id, "operationConfig": {"loadWeightsForSampling": {"modelPackageArn": PKG}}},
    )
    for status in ("InProgress", "Completed"):
        stubs.runtime.add_response(
            "get_sampling_operation_result",
            {"status": status, **({"operationResult": {"loadWeightsForSampling": {}}} if status == "Completed" else {})},
            {"trainingSessionName": info.model_id, "operationId": "load-1"},
        )
    await backend.create_sampler(SamplerSpec(model_path=PKG))
    stubs.runtime.assert_no_pending_responses()  # both polls were made: the sampler came back after the load completed


async def test_resume_sends_load_state_as_sequence_number_one(stubbed):
    backend, stubs = stubbed
    stubs.create(rank=4, alpha=8)
    stubs.runtime.add_response(
        "execute_training_operation",
        {"operationId": "op-resume"},
        {
            "trainingSessionName": ANY,
            "sequenceNumber": 1,
            "clientToken": ANY,
            "operationConfig": {"loadState": {"modelPackageArn": PKG, "loadOptimizer": False}},
        },
    )
    stubs.runtime.add_response(
        "get_training_operation_result",
        {"status": "Completed", "operationResult": {"loadState": {}}},
        {"trainingSessionName": ANY, "operationId": "op-resume"},
    )
    info = await backend.create_training_session(TrainingSessionSpec(base_model="tiny-model", rank=4, from_path=PKG, with_optimizer=False))
    stubs.name = info.model_id
    stubs.training(2, "first-client-op", {"saveState": {}}, {"saveState": {"modelPackageArn": PKG}})
    await backend.execute_training(info.model_id, SaveStateOp(seq=1, idempotency_key="first-client-op"))
    stubs.runtime.assert_no_pending_responses()


async def test_unsupported_and_out_of_range_input_fails_before_sending(stubbed):
    backend, stubs = stubbed
    stubs.create()
    info = await backend.create_training_session(TrainingSessionSpec(base_model="org/tiny-model", rank=8))
    d = _datum([1, 2, 3], logprobs=[0.0, 0.0], advantages=[1.0, 1.0])
    with pytest.raises(UnsupportedError) as err:
        await backend.execute_training(info.model_id, ForwardBackwardOp(seq=1, idempotency_key="a", data=(d,), loss_fn="dro"))
    assert err.value.field == "loss_fn" and "forward_backward_custom" in (err.value.fix or "")

    sampler_spec = SamplerSpec(model_path="tinker://run/weights/x")
    with pytest.raises(InvalidInputError) as err2:
        await backend.create_sampler(sampler_spec)
    assert err2.value.field == "model_path"
    stubs.runtime.assert_no_pending_responses()  # nothing reached the wire
    backend._sessions.clear()


async def test_options_come_from_url_query_and_environment(monkeypatch):
    from asyncsess.backends import parse_url

    monkeypatch.setenv("SAGEMAKER_TRAINING_SESSION_ENDPOINT", "http://127.0.0.1:1")
    opts = SageMakerOptions.resolve(parse_url(f"sagemaker://eu-west-1?role_arn={ROLE}&session_name_prefix=exp"), {"kms_key_arn": "k"})
    assert (opts.region, opts.role_arn, opts.session_name_prefix, opts.kms_key_arn) == ("eu-west-1", ROLE, "exp", "k")
    assert opts.endpoint_url == opts.runtime_url == "http://127.0.0.1:1"
    with pytest.raises(InvalidInputError) as err:
        SageMakerOptions.resolve(parse_url("sagemaker://us-west-2?rolearn=x"), {})
    assert "role_arn" in (err.value.fix or "")


@pytest.mark.parametrize("bad", [None, "optim_step", {"kind": "optim_step", "seq": 1}, types.SimpleNamespace(kind="optim_step", seq=1)])
async def test_an_object_that_is_not_an_op_record_is_refused_before_it_takes_a_sequence_number(stubbed, bad):
    backend, stubs = stubbed
    stubs.create()
    info = await backend.create_training_session(TrainingSessionSpec(base_model="org/tiny-model", rank=8))
    stubs.name = info.model_id
    with pytest.raises(InvalidInputError) as err:
        await backend.execute_training(info.model_id, bad)
    assert err.value.field == "op" and "OptimStepOp" in (err.value.fix or "")
    # nothing was sent, and the next real op is still sequence number 1 on the wire
    stubs.training(1, "k1", {"optimizerStep": {"adamParamsConfig": ANY}}, {"optimizerStep": {"metrics": {}}})
    step = await backend.execute_training(info.model_id, OptimStepOp(seq=1, idempotency_key="k1"))
    assert step.step == 1


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"weights": [1.0, 1e7]}, "weights"),
        ({"weights": [1.0, float("nan")]}, "weights"),
        ({"weights": [1.0, 1.0, 1.0]}, "shape"),  # one value per input token (2)
        ({"weights": [1.0, 1.0], "ref_log_prob": [0.0, 0.0], "bogus": [0.0, 0.0]}, "lossFnInputs"),
    ],
)
async def test_a_datum_the_wire_rules_refuse_takes_no_wire_number(stubbed, inputs, field):
    """Called as a door calls it (no client-side checks first): the datum rules run before the op is given the
    session's next wire number, so nothing is sent and the next op is sequence number 1."""
    backend, stubs = stubbed
    stubs.create()
    info = await backend.create_training_session(TrainingSessionSpec(base_model="org/tiny-model", rank=8))
    stubs.name = info.model_id
    tensors = {k: TensorData.model_construct(data=v, dtype="float32", shape=[len(v)]) for k, v in inputs.items()}
    tensors["target_tokens"] = TensorData(data=[5, 6], dtype="int64", shape=[2])
    bad = Datum.model_construct(model_input=ModelInput.from_ints([1, 5]), loss_fn_inputs=tensors)  # as a door may pass it
    with pytest.raises(InvalidInputError) as err:
        await backend.execute_training(info.model_id, ForwardBackwardOp(seq=1, idempotency_key="a", data=(bad,), loss_fn="cross_entropy"))
    assert err.value.void and field in f"{err.value.field} {err.value}"
    stubs.runtime.assert_no_pending_responses()  # nothing reached the wire
    stubs.training(1, "k2", {"optimizerStep": {"adamParamsConfig": ANY}}, {"optimizerStep": {"metrics": {}}})
    assert (await backend.execute_training(info.model_id, OptimStepOp(seq=2, idempotency_key="k2"))).step == 1
    backend._sessions.clear()


@pytest.mark.parametrize(
    ("hint", "wait"),
    [("2", 2.0), ("²", 0.5), ("nan", 0.5), ("-1", 0.5), ("1e400", 0.5), (None, 0.5), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)],
)
def test_a_throttles_retry_after_is_read_as_every_client_reads_it(hint, wait):
    """A hostile or odd ``Retry-After`` on a throttle is a transient error with a sane wait, never a bare ValueError."""
    from botocore.exceptions import ClientError

    from asyncsess.errors import TransientError
    from asyncsess_sagemaker.calls import translate

    headers = {} if hint is None else {"retry-after": hint}
    meta = {"HTTPStatusCode": 400, "HTTPHeaders": headers}
    err = translate(ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow down"}, "ResponseMetadata": meta}, "X"), "x")
    assert isinstance(err, TransientError) and err.retry_after == wait
