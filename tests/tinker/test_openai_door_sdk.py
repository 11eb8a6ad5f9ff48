"""One ``asyncsess serve`` (uvicorn on 127.0.0.1, mock://), both doors: the official tinker SDK trains and saves a
sampler, the official openai client chats with that sampler by its id or ``tinker://`` path, and the capture
says which weights answered. A second key sees none of it."""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
OTHER_KEY = "tml-someone-else"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def two_key_server() -> Server:
    from .conftest import start_server

    gen = start_server("mock://", api_keys={API_KEY, OTHER_KEY})
    yield next(gen)
    gen.close()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _openai(url: str, key: str, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers={"X-Rollout-Id": rollout})


def test_chat_with_a_sampler_the_tinker_sdk_saved(two_key_server: Server) -> None:
    url = two_key_server.url
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        fb = tc.forward_backward([_datum([5, 6, 7, 8, 9])], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-2))
        fb.result()
        opt.result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sid = sampler._sampling_session_id
        path = tc.save_weights_for_sampler("after-one-step").result().path
        assert path.startswith("tinker://") and path.endswith("/sampler_weights/after-one-step")

        mine = _openai(url, API_KEY, "r")
        models = [m.id for m in mine.models.list().data]
        assert sid in models and path in models and BASE in models
        by_id = mine.chat.completions.create(model=sid, messages=HI, max_tokens=8, seed=1, logprobs=True)
        by_path = mine.chat.completions.create(model=path, messages=HI, max_tokens=8, seed=1, logprobs=True)
        base = mine.chat.completions.create(model=BASE, messages=HI, max_tokens=8, seed=1, logprobs=True)
        assert by_id.system_fingerprint == by_path.system_fingerprint == "asyncsess-w1"
        assert base.system_fingerprint == "asyncsess-w0"

        calls = httpx.get(f"{url}/v1/asyncsess/rollouts/r", headers={"Authorization": f"Bearer {API_KEY}"}).json()["calls"]
        assert [(c["sampler_id"], c["weight_version"]) for c in calls] == [(sid, 1), (path, 1), (BASE, 0)]
        # the trained sampler's log-probs are what the tinker SDK's own sampler computes for the same tokens
        call = calls[0]
        full = call["prompt_tokens"] + call["choices"][0]["tokens"]
        lps = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert call["choices"][0]["logprobs"] == pytest.approx(lps[len(call["prompt_tokens"]) :], abs=1e-5)
        shown = len(call["choices"][0]["tokens"]) - (call["choices"][0]["finish_reason"] == "stop")  # not the end token
        assert [e.logprob for e in by_id.choices[0].logprobs.content] == call["choices"][0]["logprobs"][:shown]
        # one step changed the weights: the trained and base samplers score the same reply differently
        assert by_id.choices[0].logprobs.content != base.choices[0].logprobs.content or by_id.choices[0].message != base.choices[0].message

        # another key: the same 404 as for a name that never existed, and no captures
        theirs = _openai(url, OTHER_KEY, "r")
        for model in (sid, path, sid + "x"):
            with pytest.raises(openai.NotFoundError) as err:
                theirs.chat.completions.create(model=model, messages=HI, max_tokens=4)
            assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
        assert sid not in [m.id for m in theirs.models.list().data]
        assert httpx.get(f"{url}/v1/asyncsess/rollouts/r", headers={"X-API-Key": OTHER_KEY}).json()["calls"] == []
        # ... and the server still serves the first key, with captures intact
        mine.chat.completions.create(model=sid, messages=HI, max_tokens=4)
        gone = httpx.delete(f"{url}/v1/asyncsess/rollouts/r", headers={"X-API-Key": API_KEY}).json()["calls"]
        assert len(gone) == 4
        assert httpx.get(f"{url}/v1/asyncsess/rollouts/r", headers={"X-API-Key": API_KEY}).json()["calls"] == []
    finally:
        service.holder.close()
