"""The torch sampler: every SamplingParams field, log-probs consistent with compute_logprobs,
batching across concurrent requests and adapters, usage, prompt log-probs, bad input."""

from __future__ import annotations

import anyio
import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import SampleRequest  # noqa: E402
from asyncsess.errors import InvalidInputError, SessionGoneError  # noqa: E402
from asyncsess.types import SamplingParams  # noqa: E402

from .helpers import base_and_tuned_samplers, hold_engine, until_queued  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]


@pytest.fixture
async def env(backend_factory, tiny):
    """An open backend, a base sampler and a sampler on a trained adapter."""
    b = backend_factory()
    await b.open()
    tok, base, tuned = await base_and_tuned_samplers(b, tiny, steps=3)
    try:
        yield b, tok, base, tuned
    finally:
        await b.aclose()


def _req(prompt, n=1, **params):
    return SampleRequest(tuple(prompt), n, SamplingParams(**params))


async def test_greedy_is_deterministic_and_matches_top_k_1(env):
    b, tok, base, tuned = env
    prompt = tok.encode("what is 2 plus")
    g1 = await b.sample(base, _req(prompt, 2, max_tokens=8, temperature=0.0))
    g2 = await b.sample(base, _req(prompt, 1, max_tokens=8, temperature=0.0))
    k1 = await b.sample(base, _req(prompt, 1, max_tokens=8, temperature=1.0, top_k=1, seed=3))
    assert g1.sequences[0].tokens == g1.sequences[1].tokens == g2.sequences[0].tokens == k1.sequences[0].tokens
    assert len(g2.sequences[0].tokens) == 8 and g2.sequences[0].stop_reason == "length"


async def test_seed_reproduces_and_samples_differ(env):
    b, tok, base, tuned = env
    prompt = tok.encode("hello")
    r1 = await b.sample(tuned, _req(prompt, 4, max_tokens=10, temperature=1.5, seed=42, stop=[]))
    r2 = await b.sample(tuned, _req(prompt, 4, max_tokens=10, temperature=1.5, seed=42, stop=[]))
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
    assert len({tuple(s.tokens) for s in r1.sequences}) > 1
    r3 = await b.sample(tuned, _req(prompt, 4, max_tokens=10, temperature=1.5, seed=43, stop=[]))
    assert [s.tokens for s in r3.sequences] != [s.tokens for s in r1.sequences]


async def test_top_p_and_top_k_restrict_the_choice(env):
    b, tok, base, tuned = env
    prompt = tok.encode("one two")
    greedy = (await b.sample(base, _req(prompt, 1, max_tokens=1, temperature=0.0))).sequences[0].tokens[0]
    tiny_p = await b.sample(base, _req(prompt, 8, max_tokens=1, temperature=1.0, top_p=1e-6, seed=1))
    assert {s.tokens[0] for s in tiny_p.sequences} == {greedy}
    top2 = await b.sample(base, _req(prompt, 32, max_tokens=1, temperature=5.0, top_k=2, seed=1))
    assert 1 <= len({s.tokens[0] for s in top2.sequences}) <= 2
    wide = await b.sample(base, _req(prompt, 32, max_tokens=1, temperature=5.0, seed=1))
    assert len({s.tokens[0] for s in wide.sequences}) > 2


async def test_logprobs_match_compute_logprobs(env):
    b, tok, base, tuned = env
    prompt = tok.encode("the answer is")
    for sampler in (base, tuned):
        out = await b.sample(sampler, _req(prompt, 3, max_tokens=12, temperature=1.0, seed=5, stop=[]))
        for s in out.sequences:
            full = await b.compute_logprobs(sampler, prompt + s.tokens)
            assert s.logprobs == pytest.approx(full[len(prompt) :], abs=1e-4)
    with_prompt = await b.sample(tuned, SampleRequest(tuple(prompt), 1, SamplingParams(max_tokens=2), include_prompt_logprobs=True))
    assert with_prompt.prompt_logprobs == pytest.approx(await b.compute_logprobs(tuned, prompt), abs=1e-6)


async def test_stops_eos_and_usage(env):
    b, tok, base, tuned = env
    prompt = tok.encode("what is 2 plus")
    free = (await b.sample(base, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[]))).sequences[0]
    # a stop token id ends the sequence at its first occurrence and is included
    target = free.tokens[3]
    first = free.tokens.index(target)
    by_id = (await b.sample(base, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=[target]))).sequences[0]
    assert by_id.tokens == free.tokens[: first + 1] and by_id.stop_reason == "stop"
    # a stop string ends the sequence once the decoded text contains it
    text = tok.decode(free.tokens[:4])
    stop_str = text[-3:]
    by_str = (await b.sample(base, _req(prompt, 1, max_tokens=10, temperature=0.0, stop=stop_str))).sequences[0]
    assert by_str.stop_reason == "stop" and stop_str in tok.decode(by_str.tokens)
    assert stop_str not in tok.decode(by_str.tokens[:-1]) and len(by_str.tokens) <= 4
    # EOS stops by default (stop=None) but not when stop=[] (above): make the greedy first token the EOS
    b.engine.slots[next(iter(b.engine.slots))].sampler.eos_ids = [free.tokens[0]]
    eos_stop = (await b.sample(base, _req(prompt, 1, max_tokens=10, temperature=0.0))).sequences[0]
    assert eos_stop.tokens == free.tokens[:1] and eos_stop.stop_reason == "stop"
    usage = (await b.sample(base, _req(prompt, 3, max_tokens=5, temperature=0.0, stop=[]))).usage
    assert (usage.prefill_tokens, usage.decode_tokens) == (len(prompt), 15)


async def test_concurrent_requests_are_batched_and_match_unbatched(env):
    b, tok, base, tuned = env
    prompts = [tok.encode(t) for t in ("what is 2 plus", "hello world the", "one", "the cat and the dog and")]
    samplers = [base, tuned, tuned, base]
    alone = [await b.sample(s, _req(p, 2, max_tokens=6, temperature=0.0, stop=[])) for s, p in zip(samplers, prompts)]
    engine = b.engine
    batches = engine.stats["sample_batches"]

    gate, busy = await hold_engine(engine)
    results = [None] * len(prompts)

    async def one(i):
        results[i] = await b.sample(samplers[i], _req(prompts[i], 2, max_tokens=6, temperature=0.0, stop=[]))

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
        await until_queued(engine, len(prompts))  # every request is queued behind the gate
        gate.set()
        await busy.wait()
    assert engine.stats["sample_batches"] == batches + 1  # one generation for all four, across two adapters
    for a, r in zip(alone, results):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in r.sequences]
        for sa, sr in zip(a.sequences, r.sequences):
            assert sa.logprobs == pytest.approx(sr.logprobs, abs=1e-4)


async def test_bad_sampling_input_is_refused(env):
    b, tok, base, tuned = env
    with pytest.raises(InvalidInputError, match="vocabulary"):
        await b.sample(base, _req([1, 2, 10**6], 1, max_tokens=2))
    with pytest.raises(InvalidInputError, match="context"):
        await b.sample(base, _req([5] * 510, 1, max_tokens=10))
    with pytest.raises(InvalidInputError, match="context"):
        await b.sample(base, _req([5] * 512, 1))
    with pytest.raises(InvalidInputError, match="empty"):
        await b.compute_logprobs(base, [])
    with pytest.raises(InvalidInputError, match="stop"):
        await b.sample(base, _req([5], 1, max_tokens=2, stop=[10**6]))
    # targets on a one-token prompt (no rows, past the client's check): was a bare ValueError from max() of nothing
    with pytest.raises(InvalidInputError, match="target_prompt_logprobs"):
        await b.sample(base, SampleRequest((5,), 1, SamplingParams(max_tokens=1), target_prompt_logprobs=()))
    await b.stop_session(base)
    with pytest.raises(SessionGoneError):
        await b.sample(base, _req([5], 1, max_tokens=2))


async def test_batches_are_capped_by_rows(env):

    b, tok, base, tuned = env
    engine = b.engine
    engine.config.max_sample_rows = 3
    before = engine.stats["sample_batches"]
    gate, busy = await hold_engine(engine)

    async def one():
        out = await b.sample(base, _req(tok.encode("hello"), 2, max_tokens=2, temperature=0.0, stop=[]))
        assert len(out.sequences) == 2

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
        await until_queued(b.engine, 3)
        gate.set()
        await busy.wait()
    assert engine.stats["sample_batches"] == before + 3  # 2 + 2 rows would exceed 3: one request per batch


async def test_base_sampler_is_the_plain_model(env, tiny_dir):
    from transformers import AutoModelForCausalLM

    b, tok, base, tuned = env
    probe = tok.encode("what is 2 plus 3? the answer is 5.")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe])).logits[0].float()
    want = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(probe[1:])[:, None])[:, 0].tolist()
    assert (await b.compute_logprobs(base, probe))[1:] == pytest.approx(want, abs=1e-5)
    assert (await b.compute_logprobs(tuned, probe))[1:] != pytest.approx(want, abs=1e-5)
    greedy = (await b.sample(base, _req(probe, 1, max_tokens=4, temperature=0.0, stop=[]))).sequences[0].tokens
    ref = model.generate(torch.tensor([probe]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(probe) :].tolist()
    assert greedy == ref


async def test_a_retried_request_id_is_answered_from_the_store(env, monkeypatch):
    """A retry after a lost answer (same request_id, same request) is not sampled again; the id reused for
    another request is a ConflictError, and bad input is still refused for its own field."""
    from asyncsess.errors import ConflictError

    b, tok, base, tuned = env
    runs: list[str] = []
    real = b.engine.sample

    async def counting(sampler_id, job):
        runs.append(sampler_id)
        return await real(sampler_id, job)

    monkeypatch.setattr(b.engine, "sample", counting)
    prompt = tuple(tok.encode("hello"))
    request = SampleRequest(prompt, 3, SamplingParams(max_tokens=6, temperature=1.5, stop=[]), request_id="r-1")  # unseeded
    first = await b.sample(tuned, request)
    again = await b.sample(tuned, request)
    assert again == first and runs == [tuned]
    with pytest.raises(ConflictError) as err:
        await b.sample(tuned, SampleRequest(prompt[:-1], 3, request.sampling_params, request_id="r-1"))
    assert err.value.field == "request_id"
    with pytest.raises(InvalidInputError) as err:
        await b.sample(tuned, SampleRequest(prompt, 3, SamplingParams(max_tokens=10**6), request_id="r-1"))
    assert err.value.field == "sampling_params.max_tokens"
    await b.sample(base, request)  # ids are per sampler
    await b.sample(tuned, SampleRequest(prompt, 3, request.sampling_params))  # no id: never kept
    await b.sample(tuned, SampleRequest(prompt, 3, request.sampling_params))
    assert runs == [tuned, base, tuned, tuned]


def test_the_inverse_cdf_draw_follows_the_distribution_and_never_picks_a_zero_token() -> None:
    from asyncsess_local.sampler import _draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]] * 4000 + [[0.0] * 5 + [1.0]] * 10 + [[1.0] + [0.0] * 5] * 10)
    drawn = _draw(probs, torch.Generator().manual_seed(7))
    assert drawn[4000:4010].tolist() == [5] * 10 and drawn[4010:].tolist() == [0] * 10  # all the mass at either end
    counts = torch.bincount(drawn[:4000], minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0  # filtered tokens (probability 0) are never drawn
    expected = 4000 * probs[0].double()
    nz = expected > 0
    chi2 = float((((counts - expected) ** 2)[nz] / expected[nz]).sum())
    assert chi2 < 13.8  # 2 degrees of freedom: p = 0.001
    assert torch.equal(drawn, _draw(probs, torch.Generator().manual_seed(7)))  # a seeded generator repeats
    assert not torch.equal(drawn[:4000], _draw(probs[:4000], torch.Generator().manual_seed(8)))
