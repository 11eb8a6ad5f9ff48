"""The official tinker SDK drives ``asyncsess serve`` on local:// with the tiny offline Llama (CPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server, start_server

pytestmark = [pytest.mark.tinker, pytest.mark.local, pytest.mark.torch]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from asyncsess_local.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def local_server(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = tmp_path_factory.mktemp("ckpt")
    yield from start_server(f"local://?model={tiny}&device=cpu&dir={ckpt}", poll_timeout=10.0)


@pytest.fixture(scope="module")
def service(local_server: Server) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=local_server.url, api_key=API_KEY)
    yield sc
    sc.holder.close()


def test_tokenizer_loads_offline_and_sft_loss_falls(service: tinker.ServiceClient, tiny: str) -> None:
    tc = service.create_lora_training_client(base_model=tiny, rank=4, seed=0).result()
    assert tc.get_info().model_data.tokenizer_id == tiny and Path(tiny).is_dir()
    tok = tc.get_tokenizer()
    ids = tok.encode("what is 2 plus 3? the answer is 5.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
    )
    losses = []
    for _ in range(5):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0], losses


def test_rl_step_with_sampler_refresh_and_bit_exact_resume(service: tinker.ServiceClient, tiny: str) -> None:
    tc = service.create_lora_training_client(base_model=tiny, rank=4, seed=0).result()
    prompt = tc.get_tokenizer().encode("what is 2 plus 3?")
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=1)).result()
    assert len(res.sequences) == 4 and all(len(s.logprobs or []) == len(s.tokens) for s in res.sequences)
    target = res.sequences[0].tokens
    full = prompt + target
    before = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    n = len(full) - 1
    adv = [0.0] * (len(prompt) - 1) + [1.0] * len(target)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (len(prompt) - 1) + list(before[len(prompt) :]), "advantages": adv},
    )
    assert len(adv) == n
    for _ in range(3):
        tc.forward_backward([datum], "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    refreshed = tc.save_weights_and_get_sampling_client().result()
    after = refreshed.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert sum(after[len(prompt) :]) > sum(before[len(prompt) :]), "the refreshed sampler serves the trained weights"

    path = tc.save_state("local-resume").result().path
    copy = service.create_training_client_from_state_with_optimizer(path).result()
    sft = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * n})
    outs = []
    for client in (tc, copy):
        fb = client.forward_backward([sft], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        outs.append(client.forward([sft], "cross_entropy").result().metrics["loss:sum"])
        outs.append(fb.result().metrics["loss:sum"])
    assert outs[1] == outs[3], "same state before the step"
    assert np.float32(outs[0]) == np.float32(outs[2]), "and the same step after it (optimizer moments restored)"


def test_sampler_refreshes_stay_bounded_on_local(service: tinker.ServiceClient, local_server: Server, tiny: str) -> None:
    """On local:// each refresh is an adapter snapshot in memory: the door's bound closes old samplers, so the engine
    drops their snapshots; a closed sampler on base weights reopens with the same answer, a released one is a 410."""
    door = local_server.door
    door.max_samplers = 3
    try:
        tc = service.create_lora_training_client(base_model=tiny, rank=4, seed=0).result()
        prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("what is 2 plus 3?"))
        params = types.SamplingParams(max_tokens=4, seed=1)
        on_base = service.create_sampling_client(base_model=tiny).result()
        base_tokens = on_base.sample(prompt, 1, params).result().sequences[0].tokens
        first = tc.save_weights_and_get_sampling_client().result()
        for _ in range(8):
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            last = tc.save_weights_and_get_sampling_client().result()
            assert len(last.sample(prompt, 1, params).result().sequences[0].tokens) > 0
        snapshots = local_server.backend.engine.state._snapshots  # type: ignore[attr-defined]
        owner = door.models[tc.model_id].backend_id
        assert len([s for s in snapshots.values() if s.owner == owner]) <= 3
        with pytest.raises(tinker.APIStatusError) as err:
            first.sample(prompt, 1, params).result()
        assert err.value.status_code == 410
        assert on_base.sample(prompt, 1, params).result().sequences[0].tokens == base_tokens
    finally:
        door.max_samplers = 16
