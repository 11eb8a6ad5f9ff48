"""The public client on ``local://`` and on ``http://`` (a worker): the same loop, unchanged, on both."""

from __future__ import annotations

from urllib.parse import quote

import pytest

torch = pytest.importorskip("torch")

import asyncsess  # noqa: E402
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams  # noqa: E402

from .helpers import DEVICE_KW, DEVICE_QUERY  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]

TEXT = "what is 2 plus 3? the answer is 5."


@pytest.fixture(params=["local", "http"])
def url(request, tiny, tmp_path):
    if request.param == "local":
        yield f"local://?model={quote(tiny)}&{DEVICE_QUERY}&dir={quote(str(tmp_path))}", {}
        return
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    worker = serve_in_thread(LocalBackend(model=tiny, **DEVICE_KW, checkpoint_dir=str(tmp_path)), ["secret"])
    try:
        yield worker.url, {"api_key": "secret"}
    finally:
        worker.stop()


async def test_training_loop_through_the_client(url, tiny):
    address, options = url
    async with asyncsess.ServiceClient(address, **options) as svc:
        assert tiny in await svc.list_base_models()
        tc = await svc.create_lora_training_client(tiny, rank=4, seed=0)
        tok = tc.get_tokenizer()
        ids = tok.encode(TEXT)
        datum = Datum(
            model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
        )
        losses = []
        for _ in range(5):
            fb = tc.forward_backward([datum], "cross_entropy")  # pipelined: both submitted before either is awaited
            opt = tc.optim_step(AdamParams(learning_rate=2e-2))
            losses.append((await fb).loss)
            await opt
        assert losses[-1] < losses[0]

        # a custom loss (lowered to cross_entropy with weights −dL/dp by the client)
        def neg_mean_logprob(data, logprobs):
            total = sum(lp.sum() for lp in logprobs)
            return -total / sum(len(lp) for lp in logprobs), {}

        ref = await tc.forward([datum], "cross_entropy")
        custom = await tc.forward_backward_custom([datum], neg_mean_logprob)
        assert custom.loss == pytest.approx(ref.loss / len(ids[:-1]), rel=1e-5)
        await tc.optim_step(AdamParams(learning_rate=0.0))

        state = await tc.save_state("ckpt")
        sc = await tc.save_weights_and_get_sampling_client()
        prompt = tok.encode("what is 2 plus")
        out = await sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=6, temperature=0.0, stop=[]))
        assert len(out.sequences) == 3 and all(len(s.tokens) == 6 for s in out.sequences)
        lp = await sc.compute_logprobs(prompt + out.sequences[0].tokens)
        assert lp[len(prompt) :] == pytest.approx(out.sequences[0].logprobs, abs=1e-4)
        # what transformers 5's apply_chat_template returns (a BatchEncoding) is a prompt as it stands
        chat = tok.apply_chat_template([{"role": "user", "content": "what is 2 plus"}], add_generation_prompt=True)
        greedy = SamplingParams(max_tokens=3, temperature=0.0, stop=[])
        assert (await sc.sample(chat, 1, greedy)).sequences[0].tokens == (await sc.sample(list(chat["input_ids"]), 1, greedy)).sequences[
            0
        ].tokens

        resumed = await svc.create_training_client_from_state_with_optimizer(state.path)
        assert resumed.get_info().step == 6
        again = await resumed.forward([datum], "cross_entropy")
        now = await tc.forward([datum], "cross_entropy")
        assert again.loss == now.loss  # same weights
        assert any(c.path == state.path for c in await svc.list_checkpoints(tc.model_id))
