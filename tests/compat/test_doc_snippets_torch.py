"""Snippets from Tinker's published docs that build tensors with torch, run on mock:// with only the imports, the
URL and the model changed (each edit is marked ``# was:``); the ``nox -s local`` session runs them."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.torch

BASE_MODEL = "mock/bigram-tiny"


def test_tinker_weights_tutorial_204() -> None:
    """tinker-cookbook ``tutorials/204_weights.py`` (its cells in order, in one ``asyncio.run``): a client made with
    ``tinker.ServiceClient()`` and never entered with ``async with``, a ``TensorData.from_torch`` datum,
    ``result_async()``, both saves and a TTL save, a resume from state, a sampler from the sampler path, and the
    RestClient's ``list_checkpoints(run_id).checkpoints`` and ``list_user_checkpoints(limit=5).checkpoints``.
    Every call failed with "ServiceClient is not open", and the listings were bare lists. The edits beyond the
    imports: the async RestClient's futures are awaited (asyncsess's async futures do not block; asyncsess.sync's
    do), and the save futures are awaited for their ``.path`` (as Tinker 0.38's ``*_async`` return futures)."""
    import torch

    import asyncsess as tinker  # was: import tinker
    from asyncsess import TensorData  # was: from tinker import TensorData

    async def main() -> None:
        MODEL_NAME = BASE_MODEL  # was: "Qwen/Qwen3-4B-Instruct-2507"
        service_client = tinker.ServiceClient("mock://")  # was: tinker.ServiceClient()
        training_client = await service_client.create_lora_training_client_async(base_model=MODEL_NAME, rank=16)
        tokenizer = training_client.get_tokenizer()
        text = "The Pythagorean theorem states that a^2 + b^2 = c^2."
        ids = tokenizer.encode(text)
        model_input = tinker.ModelInput.from_ints(ids[:-1])
        target_tokens = ids[1:]
        _weights = [1.0] * len(target_tokens)
        datum = tinker.Datum(
            model_input=model_input,
            loss_fn_inputs={
                "target_tokens": TensorData.from_torch(torch.tensor(target_tokens)),
                "weights": TensorData.from_torch(torch.tensor(_weights)),
            },
        )
        fb_future = await training_client.forward_backward_async([datum], loss_fn="cross_entropy")
        assert (await fb_future.result_async()).metrics["loss:sum"] > 0
        optim_future = await training_client.optim_step_async(tinker.AdamParams(learning_rate=1e-4))
        await optim_future.result_async()

        sampler_result = await training_client.save_weights_for_sampler_async("tutorial-sampler")
        sampler_path = (await sampler_result).path  # was: sampler_result.path
        state_result = await training_client.save_state_async("tutorial-state")
        state_path = (await state_result).path  # was: state_result.path
        ephemeral_result = await training_client.save_weights_for_sampler_async("tutorial-ephemeral", ttl_seconds=3600)
        await ephemeral_result

        resumed_client = await service_client.create_training_client_from_state_async(state_path)
        info = await resumed_client.get_info_async()
        assert info.model_id != training_client.model_id

        fine_tuned_sampler = await service_client.create_sampling_client_async(model_path=sampler_path)
        prompt = tinker.ModelInput.from_ints(tokenizer.encode("The Pythagorean theorem"))
        result = await fine_tuned_sampler.sample_async(
            prompt=prompt, sampling_params=tinker.SamplingParams(max_tokens=50, temperature=0.5, stop=["\n"]), num_samples=1
        )
        assert 0 < len(result.sequences[0].tokens) <= 50

        rest_client = service_client.create_rest_client()
        _info = await training_client.get_info_async()
        run_id = _info.model_id.split(":")[0]
        checkpoints_response = await rest_client.list_checkpoints(run_id)  # was: ....result()
        listed = {f"[{cp.checkpoint_type}] {cp.checkpoint_id}" for cp in checkpoints_response.checkpoints}
        assert listed == {
            "[sampler] sampler_weights/tutorial-sampler",
            "[training] weights/tutorial-state",
            "[sampler] sampler_weights/tutorial-ephemeral",
        }
        all_checkpoints = await rest_client.list_user_checkpoints(limit=5)  # was: ....result()
        assert sampler_path in {_cp.tinker_path for _cp in all_checkpoints.checkpoints}
        await service_client.close()

    asyncio.run(main())


def test_tinker_losses_doc() -> None:
    """tinker-cookbook ``docs/losses.mdx``: a ``TensorData.from_torch`` RL datum through ``importance_sampling`` and
    ``ppo``; ``ppo``, ``cispo`` and ``dro`` with ``loss_fn_config`` by keyword (``data=``); and its custom
    ``variance_loss`` through ``forward_backward_custom`` (its ``logprob_squared_loss`` squares a list, which fails
    on Tinker too: asyncsess names ``loss_fn`` and keeps the TypeError as the cause)."""
    import torch

    import asyncsess as tinker  # was: import tinker
    from asyncsess import Datum, InvalidInputError, TensorData  # was: from tinker import TensorData

    async def main() -> None:
        service_client = tinker.ServiceClient("mock://")
        training_client = await service_client.create_lora_training_client_async(base_model=BASE_MODEL, rank=8)
        input_tokens = tinker.ModelInput.from_ints([5, 6, 7, 8])
        target_tokens, sampling_logprobs, advantages = [6, 7, 8, 9], [-1.0, -2.0, -1.5, -3.0], [0.0, 1.0, 1.0, -1.0]
        datum = tinker.Datum(
            model_input=input_tokens,
            loss_fn_inputs={
                "target_tokens": TensorData.from_torch(torch.tensor(target_tokens)),
                "logprobs": TensorData.from_torch(torch.tensor(sampling_logprobs)),  # Reference logprobs
                "advantages": TensorData.from_torch(torch.tensor(advantages)),
            },
        )
        data = [datum]
        losses = {}
        for loss_fn in ("importance_sampling", "ppo"):
            fwd_bwd_result = await training_client.forward_backward_async([datum], loss_fn=loss_fn)
            losses[loss_fn] = (await fwd_bwd_result).metrics["loss:sum"]
        for loss_fn, config in (
            ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
            ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
            ("dro", {"beta": 0.05}),
        ):
            fwd_bwd_result = await training_client.forward_backward_async(data=data, loss_fn=loss_fn, loss_fn_config=config)
            losses[f"{loss_fn} {config}"] = (await fwd_bwd_result).metrics["loss:sum"]
        assert len(set(losses.values())) == len(losses), losses  # every config reached the loss

        def variance_loss(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            flat_logprobs = torch.cat(logprobs)
            variance = torch.var(flat_logprobs)
            return variance, {"variance_loss": variance.item()}

        def logprob_squared_loss(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            loss = (logprobs**2).sum()
            return loss, {"logprob_squared_loss": loss.item()}

        sft = [
            tinker.Datum(model_input=input_tokens, loss_fn_inputs={"target_tokens": target_tokens, "weights": [1.0] * 4}),
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints([9, 10]), loss_fn_inputs={"target_tokens": [10, 11], "weights": [1.0] * 2}
            ),
        ]
        out = await training_client.forward_backward_custom(sft, variance_loss)
        assert out.metrics["variance_loss"] == pytest.approx(out.metrics["loss:sum"]) and out.metrics["variance_loss"] > 0
        with pytest.raises(InvalidInputError, match="loss_fn") as err:
            await training_client.forward_backward_custom(sft, logprob_squared_loss)
        assert isinstance(err.value.__cause__, TypeError)
        await service_client.close()

    asyncio.run(main())
