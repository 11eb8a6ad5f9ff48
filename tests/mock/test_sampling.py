"""Sampling through the Backend methods: determinism, filters, stops, limits and log-prob consistency."""

from __future__ import annotations

import numpy as np
import pytest

from asyncsess.backends import SampleRequest, SamplerSpec
from asyncsess.errors import InvalidInputError, SessionGoneError
from asyncsess.types import AdamParams, SamplingParams
from asyncsess_mock import MockBackend, MockConfig

MODEL = "mock/bigram-tiny"


def _req(prompt, n=1, include_prompt_logprobs=False, **params) -> SampleRequest:
    return SampleRequest(tuple(prompt), n, SamplingParams(**params), include_prompt_logprobs=include_prompt_logprobs)


async def _with_sampler(body, config: MockConfig | None = None, spec: SamplerSpec | None = None):
    backend = MockBackend(config)
    sid = await backend.create_sampler(spec or SamplerSpec(base_model=MODEL))
    try:
        return await body(backend, sid)
    finally:
        await backend.stop_session(sid)


@pytest.mark.anyio
async def test_greedy_is_deterministic_and_follows_the_argmax():
    async def body(b, sid):
        prompt = b.tokenizer.encode("The ")
        r1 = await b.sample(sid, _req(prompt, 3, temperature=0.0, max_tokens=12, stop=[]))
        r2 = await b.sample(sid, _req(prompt, 1, temperature=0.0, max_tokens=12, stop=[]))
        seqs = [s.tokens for s in r1.sequences + r2.sequences]
        assert all(s == seqs[0] for s in seqs)
        lps = await b.compute_logprobs(sid, [*prompt, *seqs[0]])
        full = [*prompt, *seqs[0]]
        # each greedy token is the most likely next token: its log-prob is the row maximum
        logp = b._samplers[sid].sampler.logp
        for prev, nxt, lp in zip(full[len(prompt) - 1 : -1], seqs[0], lps[len(prompt) :]):
            assert nxt == int(np.argmax(logp[prev]))
            assert lp == logp[prev].max()

    await _with_sampler(body)


@pytest.mark.anyio
@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-8])
async def test_a_tiny_positive_temperature_samples_the_argmax_not_nan(temperature):
    """rows / T overflowed to inf and inf - inf gave NaN probabilities: token 0 every time, silently."""

    async def body(b, sid):
        prompt = b.tokenizer.encode("The ")
        greedy = await b.sample(sid, _req(prompt, 1, temperature=0.0, max_tokens=8, stop=[]))
        with np.errstate(invalid="raise"):  # no NaN arithmetic (inf - inf) left in the draw
            tiny = await b.sample(sid, _req(prompt, 3, temperature=temperature, max_tokens=8, stop=[], seed=1))
        assert [s.tokens for s in tiny.sequences] == [greedy.sequences[0].tokens] * 3
        assert all(np.isfinite(s.logprobs).all() for s in tiny.sequences)

    await _with_sampler(body)


@pytest.mark.anyio
async def test_seed_makes_sampling_reproducible_and_independent_of_num_samples():
    async def body(b, sid):
        prompt = b.tokenizer.encode("ab")
        a = await b.sample(sid, _req(prompt, 4, seed=11, max_tokens=10, stop=[]))
        again = await b.sample(sid, _req(prompt, 4, seed=11, max_tokens=10, stop=[]))
        one = await b.sample(sid, _req(prompt, 1, seed=11, max_tokens=10, stop=[]))
        longer = await b.sample(sid, _req(prompt, 1, seed=11, max_tokens=20, stop=[]))
        other = await b.sample(sid, _req(prompt, 4, seed=12, max_tokens=10, stop=[]))
        toks = [s.tokens for s in a.sequences]
        assert toks == [s.tokens for s in again.sequences]
        assert one.sequences[0].tokens == toks[0]
        assert longer.sequences[0].tokens[:10] == toks[0]
        assert toks != [s.tokens for s in other.sequences]
        assert len({tuple(t) for t in toks}) > 1  # samples within a request differ

    await _with_sampler(body)


@pytest.mark.anyio
async def test_unseeded_sampling_is_reproducible_per_backend_seed():
    async def draw(config):
        async def body(b, sid):
            r = await b.sample(sid, _req(b.tokenizer.encode("x"), 2, max_tokens=8, stop=[]))
            return [s.tokens for s in r.sequences]

        return await _with_sampler(body, config)

    assert await draw(MockConfig(seed=1)) == await draw(MockConfig(seed=1))
    assert await draw(MockConfig(seed=1)) != await draw(MockConfig(seed=2))


@pytest.mark.anyio
async def test_top_k_1_equals_greedy_and_top_k_top_p_restrict_support():
    async def body(b, sid):
        prompt = b.tokenizer.encode("q")
        greedy = await b.sample(sid, _req(prompt, 1, temperature=0.0, max_tokens=15, stop=[]))
        topk1 = await b.sample(sid, _req(prompt, 5, temperature=1.7, top_k=1, seed=3, max_tokens=15, stop=[]))
        assert all(s.tokens == greedy.sequences[0].tokens for s in topk1.sequences)
        logp = b._samplers[sid].sampler.logp
        row = logp[prompt[-1]]
        top3 = set(np.argsort(-row)[:3].tolist())
        r = await b.sample(sid, _req(prompt, 200, top_k=3, seed=5, max_tokens=1, stop=[]))
        firsts = {s.tokens[0] for s in r.sequences}
        assert firsts <= top3 and len(firsts) > 1
        probs = np.sort(np.exp(row))[::-1]
        k = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1  # smallest set with mass >= 0.5
        nucleus = set(np.argsort(-row)[:k].tolist())
        r = await b.sample(sid, _req(prompt, 300, top_p=0.5, seed=6, max_tokens=1, stop=[]))
        assert {s.tokens[0] for s in r.sequences} <= nucleus

    await _with_sampler(body)


@pytest.mark.anyio
async def test_temperature_one_draws_follow_the_model_distribution():
    async def body(b, sid):
        prompt = b.tokenizer.encode("z")
        n = 4000
        r = await b.sample(sid, _req(prompt, n, seed=9, max_tokens=1, stop=[]))
        counts = np.bincount([s.tokens[0] for s in r.sequences], minlength=b.tokenizer.vocab_size)
        p = np.exp(b._samplers[sid].sampler.logp[prompt[-1]])
        assert np.abs(counts / n - p).max() < 0.03  # deterministic given the seed
        cold = await b.sample(sid, _req(prompt, n, seed=9, max_tokens=1, stop=[], temperature=0.3))
        top = int(np.argmax(p))
        assert sum(s.tokens[0] == top for s in cold.sequences) > counts[top]

    await _with_sampler(body)


@pytest.mark.anyio
async def test_sampled_logprobs_equal_compute_logprobs():
    async def body(b, sid):
        prompt = b.tokenizer.encode("hello")
        r = await b.sample(sid, _req(prompt, 3, temperature=0.7, top_k=20, top_p=0.9, seed=4, max_tokens=16, include_prompt_logprobs=True))
        for s in r.sequences:
            full = await b.compute_logprobs(sid, [*prompt, *s.tokens])
            assert s.logprobs == full[len(prompt) :]
        assert r.prompt_logprobs == full[: len(prompt)]
        assert r.prompt_logprobs[0] is None

    await _with_sampler(body)


@pytest.mark.anyio
async def test_targets_on_a_one_token_prompt_are_a_typed_refusal_at_the_backend():
    """A request built past the client's check (targets with no rows) crashed ``max()`` of no ids (ValueError)."""

    async def body(b, sid):
        with pytest.raises(InvalidInputError) as err:
            await b.sample(sid, SampleRequest((40,), 1, SamplingParams(max_tokens=1), target_prompt_logprobs=()))
        assert err.value.field == "target_prompt_logprobs"
        got = await b.sample(sid, SampleRequest((40, 41), 1, SamplingParams(max_tokens=1), target_prompt_logprobs=((41, -1),)))
        assert got.target_prompt_logprobs.shape == [1, 2] and got.target_prompt_logprobs.data[1] == 0.0

    await _with_sampler(body)


@pytest.mark.anyio
async def test_stops():
    async def body(b, sid):
        tok = b.tokenizer
        prompt = tok.encode("s")
        free = (await b.sample(sid, _req(prompt, 1, seed=2, max_tokens=40, stop=[]))).sequences[0]
        assert free.stop_reason == "length" and len(free.tokens) == 40
        # stop token id: cut right after the first occurrence, token included
        target = free.tokens[5]
        s = (await b.sample(sid, _req(prompt, 1, seed=2, max_tokens=40, stop=[target]))).sequences[0]
        cut = free.tokens.index(target) + 1
        assert s.stop_reason == "stop" and s.tokens == free.tokens[:cut]
        # stop string on decoded text, spanning two tokens
        text = tok.decode(free.tokens)
        stop = tok.decode(free.tokens[6:8])
        s = (await b.sample(sid, _req(prompt, 1, seed=2, max_tokens=40, stop=stop))).sequences[0]
        assert s.stop_reason == "stop" and tok.decode(s.tokens).endswith(stop)
        assert tok.decode(s.tokens) == text[: text.index(stop) + len(stop)]

    await _with_sampler(body)


@pytest.mark.anyio
async def test_eos_stops_unless_stop_is_empty():
    async def body(b, sid):
        eos = b.tokenizer.eos_token_id
        prompt = [eos]  # find a seed whose free run hits EOS
        for seed in range(200):
            free = (await b.sample(sid, _req(prompt, 1, seed=seed, max_tokens=60, stop=[]))).sequences[0]
            if eos in free.tokens:
                break
        else:
            pytest.fail("no EOS in 200 seeded runs")
        cut = free.tokens.index(eos) + 1
        default = (await b.sample(sid, _req(prompt, 1, seed=seed, max_tokens=60))).sequences[0]
        assert default.stop_reason == "stop" and default.tokens == free.tokens[:cut]
        with_strings = (await b.sample(sid, _req(prompt, 1, seed=seed, max_tokens=60, stop=["\x7f never"]))).sequences[0]
        assert with_strings.tokens == free.tokens[:cut]
        assert free.stop_reason == "length" and len(free.tokens) == 60

    await _with_sampler(body)


@pytest.mark.anyio
async def test_max_tokens_default_and_context_cap():
    async def body(b, sid):
        r = await b.sample(sid, _req([1], 2, stop=[]))
        assert [len(s.tokens) for s in r.sequences] == [8, 8]
        assert all(s.stop_reason == "length" for s in r.sequences)
        r = await b.sample(sid, _req([1] * 60, 1, max_tokens=100, stop=[]))
        assert len(r.sequences[0].tokens) == 4  # 64-token context
        assert r.usage.prefill_tokens == 60 and r.usage.decode_tokens == 4
        assert r.sequences[0].usage.decode_tokens == 4
        with pytest.raises(InvalidInputError) as err:
            await b.sample(sid, _req([1] * 64, 1))
        assert err.value.field == "prompt"

    await _with_sampler(body, MockConfig(default_max_tokens=8, max_context=64))


@pytest.mark.anyio
async def test_sampler_from_trained_weights_differs_from_base_and_snapshots(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    prompt = b.tokenizer.encode("ab", add_special_tokens=False)
    data = [datum([prompt[0], prompt[1]] * 4)]
    for _ in range(5):
        await s.run("forward_backward", data=tuple(data), loss_fn="cross_entropy")
        await s.run("optim_step", adam_params=AdamParams(learning_rate=0.5))
    saved = await s.run("save_weights", ephemeral=True)
    trained = await b.create_sampler(SamplerSpec(model_path=saved.path))
    base = await b.create_sampler(SamplerSpec(base_model=MODEL))
    lp_trained = await b.compute_logprobs(trained, [prompt[0], prompt[1]])
    lp_base = await b.compute_logprobs(base, [prompt[0], prompt[1]])
    assert lp_trained[1] > lp_base[1] + 1.0
    await s.run("forward_backward", data=tuple(data), loss_fn="cross_entropy")
    await s.run("optim_step", adam_params=AdamParams(learning_rate=0.5))
    assert await b.compute_logprobs(trained, [prompt[0], prompt[1]]) == lp_trained  # snapshot, not live
    for sid in (trained, base, s.id):
        await b.stop_session(sid)
    with pytest.raises(SessionGoneError):
        await b.sample(trained, _req(prompt, 1))


@pytest.mark.anyio
async def test_training_forward_logprobs_match_the_sampler(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    seq = b.tokenizer.encode("on-policy check")
    out = await s.run("forward", data=(datum(seq),), loss_fn="cross_entropy")
    saved = await s.run("save_weights", name="w0")
    sid = await b.create_sampler(SamplerSpec(model_path=saved.path))
    lps = await b.compute_logprobs(sid, seq)
    assert out.loss_fn_outputs[0]["logprobs"].data == np.float32(lps[1:]).tolist()
    await b.stop_session(sid)
    await b.stop_session(s.id)
