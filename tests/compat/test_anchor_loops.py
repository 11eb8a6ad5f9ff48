"""Loops written the way each anchor documents them run on mock:// with only the imports and the URL changed, and learn.

Each loop keeps its anchor's calling conventions: the SageMaker launch example's blocking GRPO loop (its
``create_lora_training_client`` call with per-call session options, ``.result()`` on every future,
``forward_backward(..., loss_fn="ppo")``, ``save_state("<description>")``), and Tinker's supervised and RL loops in
the blocking style (``fwdbwd_future = ...; optim_future = ...; .result()``) and the async style
(``fut = await tc.forward_backward_async(...)``, ``await fut``, ``await sc.sample_async(...)``). The official texts
could not be fetched into this offline repository verbatim; the lines marked ``# was:`` are the only edits such a
loop needs.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio

BASE_MODEL = "mock/bigram-tiny"
PROMPTS = ["Code:", "PIN:", "Number:", "Digits:"]


def digit_reward(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def test_sagemaker_launch_grpo_loop_blocking():
    from asyncsess.sync import AdamParams, SamplingParams, ServiceClient  # was: from sagemaker.train.training_session import ...

    service_client = ServiceClient("mock://")  # was: ServiceClient(region="us-west-2", role_arn=ROLE_ARN)
    training_client = service_client.create_lora_training_client(
        BASE_MODEL,
        training_session_name="grpo-digits",
        rank=32,
        alpha=64,
        model_package_group_arn="arn:aws:sagemaker:us-west-2:111122223333:model-package-group/grpo-digits",
        s3_output_path="s3://my-bucket/grpo-digits",
    )
    tokenizer = training_client.get_tokenizer()
    sampling_client = training_client.create_sampling_client()
    mean_rewards = []
    for step in range(25):
        futures = [
            sampling_client.sample(
                prompt=tokenizer.encode(p),
                num_samples=8,
                sampling_params=SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=1000 * step + i),
            )
            for i, p in enumerate(PROMPTS)
        ]
        batch, rewards = [], []
        for p, future in zip(PROMPTS, futures):
            prompt_tokens = tokenizer.encode(p)
            result = future.result()
            group = [digit_reward(tokenizer.decode(s.tokens)) for s in result.sequences]
            mean = sum(group) / len(group)
            rewards += group
            for seq, r in zip(result.sequences, group):
                if r == mean:
                    continue
                tokens = prompt_tokens + seq.tokens
                n_prompt = len(prompt_tokens) - 1
                batch.append(
                    {
                        "model_input": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
                        "loss_fn_inputs": {
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * n_prompt + seq.logprobs,
                            "advantages": [0.0] * n_prompt + [r - mean] * len(seq.tokens),
                            "weights": [0.0] * n_prompt + [1.0] * len(seq.tokens),
                        },
                    }
                )
        mean_rewards.append(sum(rewards) / len(rewards))
        if batch:
            training_client.forward_backward(batch, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
            training_client.optim_step(AdamParams(learning_rate=0.3)).result()
            sampling_client = training_client.save_weights_and_get_sampling_client()
    state = training_client.save_state("final checkpoint").result()
    training_client.stop()
    service_client.close()
    first, last = sum(mean_rewards[:5]) / 5, sum(mean_rewards[-5:]) / 5
    assert last > first + 0.2, mean_rewards
    assert state.model_package_arn


def _sft_data(tokenizer, types):
    examples = [("banana", "yellow"), ("sky", "blue"), ("grass", "green")]
    data = []
    for word, colour in examples:
        prompt = tokenizer.encode(f"{word} is ", add_special_tokens=False)
        completion = tokenizer.encode(f"{colour}.", add_special_tokens=False)
        tokens = prompt + completion
        weights = [0] * len(prompt) + [1] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]),
            )
        )
    return data


def test_tinker_supervised_loop_blocking():
    from asyncsess import types  # was: from tinker import types
    from asyncsess.sync import ServiceClient  # was: import tinker; tinker.ServiceClient()

    service_client = ServiceClient("mock://")
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=32)
    tokenizer = training_client.get_tokenizer()
    training_data = _sft_data(tokenizer, types)
    losses = []
    for _ in range(30):
        fwdbwd_future = training_client.forward_backward(training_data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-1))
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        losses.append(fwdbwd_result.metrics["loss:sum"])
    sampling_client = training_client.save_weights_and_get_sampling_client(name="colours")
    prompt = types.ModelInput.from_ints(tokenizer.encode("sky is ", add_special_tokens=False))
    result = sampling_client.sample(
        prompt=prompt, sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0), num_samples=1
    ).result()
    service_client.close()
    assert losses[-1] < 0.5 * losses[0], losses
    assert tokenizer.decode(result.sequences[0].tokens)[0] in "ybg"  # a bigram model: after "is " comes a trained colour


async def test_tinker_supervised_loop_async():
    from asyncsess import ServiceClient, types  # was: import tinker; from tinker import types

    async with ServiceClient("mock://") as service_client:  # was: service_client = tinker.ServiceClient()
        training_client = await service_client.create_lora_training_client_async(base_model=BASE_MODEL, rank=32)
        training_data = _sft_data(training_client.get_tokenizer(), types)
        losses = []
        for _ in range(30):
            fwd_bwd_future = await training_client.forward_backward_async(training_data, "cross_entropy")
            optim_future = await training_client.optim_step_async(types.AdamParams(learning_rate=1e-1))
            fwd_bwd_result = await fwd_bwd_future
            await optim_future
            losses.append(fwd_bwd_result.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses


def _rl_round(tokenizer, types, results, prompts):
    datums, rewards = [], []
    for prompt_tokens, result in zip(prompts, results):
        group = [digit_reward(tokenizer.decode(s.tokens)) for s in result.sequences]
        mean = sum(group) / len(group)
        rewards += group
        for seq, r in zip(result.sequences, group):
            if r == mean:
                continue
            tokens = prompt_tokens + seq.tokens
            ob_len = len(prompt_tokens) - 1
            datums.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData.from_list(tokens[1:], "int64"),
                        "logprobs": types.TensorData.from_list([0.0] * ob_len + seq.logprobs, "float32"),
                        "advantages": types.TensorData.from_list([0.0] * ob_len + [r - mean] * len(seq.tokens), "float32"),
                    },
                )
            )
    return datums, sum(rewards) / len(rewards)


def test_tinker_rl_loop_blocking():
    from asyncsess import types  # was: from tinker import types
    from asyncsess.sync import ServiceClient  # was: import tinker

    service_client = ServiceClient("mock://")
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=32)
    tokenizer = training_client.get_tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    means = []
    for step in range(40):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=step)
        futures = [sampling_client.sample(prompt=types.ModelInput.from_ints(p), num_samples=8, sampling_params=params) for p in prompts]
        datums, mean = _rl_round(tokenizer, types, [f.result() for f in futures], prompts)
        means.append(mean)
        if datums:
            fwd_bwd_future = training_client.forward_backward(datums, loss_fn="importance_sampling")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=0.5))
            fwd_bwd_future.result()
            optim_future.result()
    service_client.close()
    assert sum(means[-5:]) / 5 > sum(means[:5]) / 5 + 0.2, means


async def test_tinker_rl_loop_async():
    import asyncio

    from asyncsess import ServiceClient, types  # was: import tinker; from tinker import types

    async with ServiceClient("mock://") as service_client:  # was: tinker.ServiceClient()
        training_client = await service_client.create_lora_training_client_async(base_model=BASE_MODEL, rank=32)
        tokenizer = training_client.get_tokenizer()
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        means = []
        for step in range(40):
            sampling_client = await training_client.save_weights_and_get_sampling_client_async()
            params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=step)
            results = (
                await asyncio.gather(
                    *[
                        sampling_client.sample_async(prompt=types.ModelInput.from_ints(p), num_samples=8, sampling_params=params)
                        for p in prompts
                    ]
                )
                if _on_asyncio()
                else [await sampling_client.sample_async(types.ModelInput.from_ints(p), 8, params) for p in prompts]
            )
            datums, mean = _rl_round(tokenizer, types, results, prompts)
            means.append(mean)
            if datums:
                fwd_bwd_future = await training_client.forward_backward_async(datums, loss_fn="importance_sampling")
                optim_future = await training_client.optim_step_async(types.AdamParams(learning_rate=0.5))
                await fwd_bwd_future
                await optim_future
    assert sum(means[-5:]) / 5 > sum(means[:5]) / 5 + 0.2, means


def _on_asyncio() -> bool:
    import sniffio

    return sniffio.current_async_library() == "asyncio"
