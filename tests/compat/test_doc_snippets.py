"""Snippets from the anchors' own published docs, run on mock:// with only the imports, the URL and the model changed
(each edit is marked ``# was:``). Each test quotes its source. The async snippets run under ``asyncio.run`` as their
docs run them.
"""

from __future__ import annotations

import asyncio

import pytest

BASE_MODEL = "mock/bigram-tiny"


def test_tinker_quickstart_training_and_sampling() -> None:
    """tinker-cookbook ``docs/training-sampling.mdx`` ("Getting started with training and sampling"): list the models,
    build Pig Latin datums, six ``forward_backward`` + ``optim_step`` updates printing the weighted loss per token from
    ``loss_fn_outputs``, then sample, ``include_prompt_logprobs``, ``compute_logprobs`` and ``topk_prompt_logprobs``."""
    import numpy as np

    import asyncsess.sync as tinker  # was: import tinker
    from asyncsess import types  # was: from tinker import types

    service_client = tinker.ServiceClient("mock://")  # was: tinker.ServiceClient()
    models = [item.model_name for item in service_client.get_server_capabilities().supported_models]
    assert BASE_MODEL in models
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL)  # was: "Qwen/Qwen3-VL-30B-A3B-Instruct"
    examples = [
        {"input": "banana split", "output": "anana-bay plit-say"},
        {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
        {"input": "donut shop", "output": "onut-day op-shay"},
    ]
    tokenizer = training_client.get_tokenizer()

    def process_example(example: dict, tokenizer) -> types.Datum:
        prompt = f"English: {example['input']}\nPig Latin:"
        prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
        prompt_weights = [0] * len(prompt_tokens)
        completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
        completion_weights = [1] * len(completion_tokens)
        tokens = prompt_tokens + completion_tokens
        weights = prompt_weights + completion_weights
        input_tokens = tokens[:-1]
        target_tokens = tokens[1:]
        weights = weights[1:]
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens=input_tokens), loss_fn_inputs=dict(weights=weights, target_tokens=target_tokens)
        )

    processed_examples = [process_example(ex, tokenizer) for ex in examples]
    datum0 = processed_examples[0]
    rows = list(
        zip(datum0.model_input.to_ints(), datum0.loss_fn_inputs["target_tokens"].tolist(), datum0.loss_fn_inputs["weights"].tolist())
    )
    assert rows[0][2] == 0.0 and rows[-1][2] == 1.0
    per_token = []
    for _ in range(6):
        fwdbwd_future = training_client.forward_backward(processed_examples, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-2))  # was: 1e-4 (a 6-step demo)
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        logprobs = np.concatenate([output["logprobs"].tolist() for output in fwdbwd_result.loss_fn_outputs])
        weights = np.concatenate([example.loss_fn_inputs["weights"].tolist() for example in processed_examples])
        per_token.append(-np.dot(logprobs, weights) / weights.sum())
    assert all(b < a for a, b in zip(per_token, per_token[1:])), per_token

    sampling_client = training_client.save_weights_and_get_sampling_client(name="pig-latin-model")
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
    assert len(result.sequences) == 8 and len({tuple(s.tokens) for s in result.sequences}) == 1  # greedy

    prompt = types.ModelInput.from_ints(tokenizer.encode("How many r's are in the word strawberry?"))
    sample_response = sampling_client.sample(
        prompt=prompt, num_samples=1, sampling_params=tinker.SamplingParams(max_tokens=1), include_prompt_logprobs=True
    ).result()
    assert sample_response.prompt_logprobs[0] is None and len(sample_response.prompt_logprobs) == prompt.length
    assert sampling_client.compute_logprobs(prompt).result() == sample_response.prompt_logprobs
    sample_response = sampling_client.sample(
        prompt=prompt,
        num_samples=1,
        sampling_params=tinker.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=5,
    ).result()
    assert sample_response.topk_prompt_logprobs[0] is None and all(len(row) == 5 for row in sample_response.topk_prompt_logprobs[1:])
    service_client.close()


def test_tinker_save_and_load_doc() -> None:
    """tinker-cookbook ``docs/save-load.mdx``: ``save_weights_for_sampler(name=...).result().path`` into
    ``create_sampling_client(model_path=...)`` (and the shortcut), then ``save_state(name="0010")`` and
    ``load_state(resume_path)`` put the saved weights back."""
    import asyncsess.sync as tinker  # was: import tinker
    from asyncsess import types

    service_client = tinker.ServiceClient("mock://")  # was: tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=32)  # was: "meta-llama/Llama-3.2-1B"
    batch = [
        types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})
    ]

    def loss() -> float:
        return training_client.forward(batch, "cross_entropy").result().metrics["loss:sum"]

    sampling_path = training_client.save_weights_for_sampler(name="0000").result().path
    sampling_client = service_client.create_sampling_client(model_path=sampling_path)
    shortcut = training_client.save_weights_and_get_sampling_client(name="0001")
    assert sampling_client.compute_logprobs([5, 6, 7]).result() == shortcut.compute_logprobs([5, 6, 7]).result()

    resume_path = training_client.save_state(name="0010").result().path
    saved = loss()
    training_client.forward_backward(batch, "cross_entropy")
    training_client.optim_step(types.AdamParams(learning_rate=0.1)).result()
    assert loss() != saved
    training_client.load_state(resume_path)
    assert loss() == saved  # ordered behind the load: it sees the saved weights
    service_client.close()


def test_tinker_async_loop_without_async_with() -> None:
    """tinker-cookbook ``tutorials/103_async_patterns.py``: ``service_client = tinker.ServiceClient()``, then awaited
    factories and ``asyncio.gather`` over ``sample_async``, with no ``async with``. asyncsess's async ServiceClient
    refused every call ("ServiceClient is not open"); it now opens on the first one (two first calls at once open it
    once). The renderer (tinker-cookbook) is replaced by the tokenizer."""
    import asyncsess as tinker  # was: import tinker

    async def main() -> list:
        service_client = tinker.ServiceClient("mock://")  # was: tinker.ServiceClient()
        sampling_client, other = await asyncio.gather(
            service_client.create_sampling_client_async(base_model=BASE_MODEL),  # was: "Qwen/Qwen3.5-4B"
            service_client.create_sampling_client_async(base_model=BASE_MODEL),
        )
        tokenizer = sampling_client.get_tokenizer()
        params = tinker.SamplingParams(max_tokens=20, temperature=0.7, stop=["\n"])
        prompts = ["What causes thunder?", "Write a haiku about the ocean.", "What is the capital of New Zealand?"]

        async def _sample_group(_prompt_text):
            _model_input = tinker.ModelInput.from_ints(tokenizer.encode(_prompt_text))  # was: renderer.build_generation_prompt
            _result = await sampling_client.sample_async(prompt=_model_input, num_samples=4, sampling_params=params)
            return _prompt_text, _result

        results = await asyncio.gather(*[_sample_group(p) for p in prompts])
        assert service_client.backend is sampling_client._svc.backend is other._svc.backend
        await service_client.close()
        return results

    results = asyncio.run(main())
    assert [p for p, _ in results] == ["What causes thunder?", "Write a haiku about the ocean.", "What is the capital of New Zealand?"]
    assert all(len(r.sequences) == 4 for _, r in results)


def test_sagemaker_package_example_loop() -> None:
    """sagemaker-train 1.27.0, ``sagemaker/train/training_session/__init__.py`` (the package docstring): ``TensorData``
    with ``dtype=TensorDtype.INT64`` and with no dtype (SageMaker's float32 default), the model from
    ``list_base_models()[0]``, a text prompt to ``sample``. ``TensorDtype`` did not exist and ``TensorData`` required
    a dtype; both forms now work, and the async form ``await asyncio.gather(fwd_bwd, optim)``."""
    from asyncsess.sync import (  # was: from sagemaker.train.training_session import (
        AdamParams,
        Datum,
        ModelInput,
        SamplingParams,
        ServiceClient,
        TensorData,
        TensorDtype,
    )

    svc = ServiceClient(
        "mock://",  # was: region="us-west-2",
        role_arn="arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole",
        model_package_group_arn="arn:aws:sagemaker:us-west-2:123456789012:model-package-group/my-group",
        s3_output_path="s3://my-bucket/output",
    )
    tc = svc.create_lora_training_client(base_model=svc.list_base_models()[0])
    your_token_id_batches = [[5, 6, 7, 8, 9], [10, 11, 12]] * 3
    losses = []
    for tokens in your_token_id_batches:
        batch = [
            Datum(
                model_input=ModelInput.from_ints(tokens),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=tokens[1:] + [0], dtype=TensorDtype.INT64),
                    "weights": TensorData(data=[1.0] * len(tokens)),
                },
            )
        ]
        fwd_bwd = tc.forward_backward(batch, loss_fn="cross_entropy")
        optim = tc.optim_step(AdamParams(learning_rate=1e-1))  # was: 1e-4 (six steps here)
        losses.append(fwd_bwd.result().metrics["loss:sum"])
        assert optim.result().metrics["learning_rate"] == pytest.approx(0.1)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], losses
    assert batch[0].loss_fn_inputs["weights"].dtype == "float32"
    sc = tc.save_weights_and_get_sampling_client()
    out = sc.sample("What is the capital of France?", num_samples=8, sampling_params=SamplingParams(max_tokens=16)).result()
    assert len(out.sequences) == 8  # was: max_tokens=512 (mock://'s context is 512)
    svc.close()

    from asyncsess import ServiceClient as AsyncServiceClient

    async def from_async_code() -> None:
        svc = AsyncServiceClient("mock://")
        tc = await svc.create_lora_training_client(base_model=(await svc.list_base_models())[0])
        fwd_bwd = tc.forward_backward(batch, loss_fn="cross_entropy")
        optim = tc.optim_step(AdamParams(learning_rate=1e-4))
        fwd_bwd_result, optim_result = await asyncio.gather(fwd_bwd, optim)
        assert fwd_bwd_result.metrics["loss:sum"] > 0 and optim_result.metrics["learning_rate"] == pytest.approx(1e-4)
        await svc.close()

    asyncio.run(from_async_code())


def test_tensor_dtype_takes_both_anchors_names() -> None:
    """SageMaker's ``TensorDtype`` members and Tinker's strings; int32 / float16 / bfloat16 widen to the two held dtypes."""
    from asyncsess import InvalidInputError, TensorData, TensorDtype

    assert TensorData(data=[1, 2], dtype=TensorDtype.INT32).dtype == "int64"
    assert TensorData(data=[0.5], dtype=TensorDtype.BFLOAT16).dtype == "float32"
    assert TensorData(data=[0.5], dtype="float16").dtype == "float32"
    assert TensorData(data=[3], dtype="int64").dtype == "int64"
    with pytest.raises(InvalidInputError, match="dtype"):
        TensorData(data=[1], dtype="int8")


def test_tinker_rest_client_docstring_listings() -> None:
    """tinker 0.38.0 ``RestClient.list_checkpoints`` docstring: ``response = future.result()`` then
    ``for checkpoint in response.checkpoints``; also ``list_training_runs().training_runs`` and
    ``list_user_checkpoints(limit=5).checkpoints`` (tutorial 204). asyncsess answered bare lists (AttributeError)."""
    import asyncsess.sync as tinker  # was: import tinker

    service_client = tinker.ServiceClient("mock://")
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8)
    training_client.save_state("rest-state").result()
    training_client.save_weights_for_sampler("rest-sampler").result()
    rest_client = service_client.create_rest_client()
    future = rest_client.list_checkpoints(training_client.model_id)
    response = future.result()
    seen = {}
    for checkpoint in response.checkpoints:
        if checkpoint.checkpoint_type == "training":
            seen["training"] = checkpoint.checkpoint_id
        elif checkpoint.checkpoint_type == "sampler":
            seen["sampler"] = checkpoint.checkpoint_id
    assert seen == {"training": "weights/rest-state", "sampler": "sampler_weights/rest-sampler"}
    runs = rest_client.list_training_runs().result()
    assert [r.training_run_id for r in runs.training_runs] == [training_client.model_id]
    assert (runs.cursor.offset, runs.cursor.limit, runs.cursor.total_count) == (0, 20, 1)
    page = rest_client.list_user_checkpoints(limit=1).result()
    assert len(page.checkpoints) == 1 and page.cursor.limit == 1 and page.cursor.total_count >= 2
    service_client.close()


def test_tinker_weights_tutorial_ttl_and_publish_cells_are_refused_typed() -> None:
    """tinker-cookbook ``tutorials/204_weights.py``'s "Set TTL" and "Publish and unpublish" cells: the RestClient had
    no such methods (an AttributeError). asyncsess cannot change a saved TTL or publish to other users; each call is an
    ``UnsupportedError`` (a ``BadRequestError``) naming the field and the fix, and the checkpoint is left as it was."""
    import asyncsess.sync as tinker  # was: import tinker

    service_client = tinker.ServiceClient("mock://")
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8)
    sampler_path = training_client.save_weights_for_sampler("tutorial-sampler", ttl_seconds=3600).result().path
    rest_client = service_client.create_rest_client()
    with pytest.raises(tinker.UnsupportedError, match="ttl_seconds.*fix: pass ttl_seconds= to save_state"):
        rest_client.set_checkpoint_ttl_from_tinker_path(sampler_path, ttl_seconds=7 * 24 * 3600).result()
    with pytest.raises(tinker.BadRequestError, match="tinker_path: publishing a checkpoint is not offered"):
        rest_client.publish_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.BadRequestError, match="tinker_path: publishing"):
        rest_client.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    (listed,) = rest_client.list_checkpoints(training_client.model_id).result().checkpoints
    assert listed.path == sampler_path and listed.expires_at is not None and not listed.public
    service_client.close()


def test_sagemaker_delete_model_package_example() -> None:
    """sagemaker-train 1.27.0, ``ServiceClient.delete_model_package`` docstring: ``result = svc.delete_model_package(
    ckpt.model_package_arn)`` then ``result.s3_uri``, and with ``delete_artifacts=True`` ``result.objects_deleted``.
    asyncsess answered ``None`` (an AttributeError), and a package already gone was a NotFoundError where SageMaker
    answers ``model_package_deleted=False``."""
    from asyncsess.sync import ServiceClient  # was: from sagemaker.train.training_session import ServiceClient

    svc = ServiceClient("mock://")  # was: ServiceClient(region=..., role_arn=...)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=8)
    ckpt = tc.save_state("keep-weights").result()  # a SaveStateResponse: .model_package_arn, as ModelPackageInfo's
    other = tc.save_state("drop-both").result()
    result = svc.delete_model_package(ckpt.model_package_arn)
    assert (result.model_package_arn, result.model_package_deleted, result.s3_uri) == (ckpt.model_package_arn, True, None)
    assert not result.artifacts_retained  # mock:// deletes the record and the weights together
    result = svc.delete_model_package(other.model_package_arn, delete_artifacts=True)
    assert result.model_package_deleted and result.objects_deleted == 0
    assert svc.list_checkpoints(tc.model_id) == []
    again = svc.delete_model_package(ckpt.model_package_arn)  # already gone: not an error
    assert again.model_package_deleted is False
    svc.close()
