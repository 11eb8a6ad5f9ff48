"""Shared-prefix sampling: each distinct prompt is prefilled once and its KV cache repeated for every row
sampling from it, with the same tokens and log-probs as prefilling every row; the LM head only ever gets
a contiguous hidden tensor (the strided prefill slice makes torch copy the head's weight once per row)."""

from __future__ import annotations

import anyio
import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import SampleRequest  # noqa: E402
from asyncsess.types import SamplingParams  # noqa: E402

from .helpers import TOL, base_and_tuned_samplers, hold_engine, until_queued  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.torch, pytest.mark.anyio]


@pytest.fixture
async def env(backend_factory, tiny):
    """An open backend, its tokenizer, the slot's sampler, and the adapter name of a trained snapshot."""
    b = backend_factory()
    await b.open()
    tok, base, tuned = await base_and_tuned_samplers(b, tiny, steps=2)
    try:
        yield b, tok, base, tuned
    finally:
        await b.aclose()


class Probe:
    """Records the batch shape of every decoder call and whether every LM-head input was contiguous."""

    def __init__(self, model) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.head_inputs: list[tuple[bool, tuple[int, ...]]] = []
        self.hooks = [
            model.get_input_embeddings().register_forward_pre_hook(lambda m, a: self.shapes.append(tuple(a[0].shape))),
            model.get_output_embeddings().register_forward_pre_hook(
                lambda m, a: self.head_inputs.append((a[0].is_contiguous(), tuple(a[0].shape)))
            ),
        ]

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _run_both(b, jobs_of):
    """Run the jobs ``jobs_of()`` builds through the slot's sampler with and without prefix sharing
    (on the engine thread); returns both outputs and the prefill batch sizes."""
    from asyncsess_local.sampler import TorchSampler

    slot = next(iter(b.engine.slots.values()))
    shared = slot.sampler
    assert shared.share_prefix  # the default
    unshared = TorchSampler(shared.host, shared.tokenizer, shared.device, shared.eos_ids, share_prefix=False)
    probe = Probe(shared.host.peft.get_base_model())
    try:
        out_s = shared.run(jobs_of())
        pre_s = probe.shapes[0][0]
        probe.shapes.clear()
        out_u = unshared.run(jobs_of())
        pre_u = probe.shapes[0][0]
    finally:
        probe.close()
    return out_s, out_u, (pre_s, pre_u), probe.head_inputs


def _assert_same(out_s, out_u):
    assert len(out_s) == len(out_u)
    for rs, ru in zip(out_s, out_u):
        assert [s.tokens for s in rs.sequences] == [s.tokens for s in ru.sequences]
        assert [s.stop_reason for s in rs.sequences] == [s.stop_reason for s in ru.sequences]
        for ss, su in zip(rs.sequences, ru.sequences):
            assert ss.logprobs == pytest.approx(su.logprobs, abs=TOL)
        assert rs.usage == ru.usage


def _adapter(b, sampler_id: str) -> str:
    return b.engine.state.sampler(sampler_id).adapter


def _job(prompt, n, adapter, **params):
    from asyncsess_local.sampler import SampleJob

    p = SamplingParams(**params)
    return SampleJob(prompt=list(prompt), num_samples=n, params=p, adapter=adapter, max_tokens=p.max_tokens or 16)


async def _on_engine(b, fn):
    return await b.engine.call(fn)


@pytest.mark.parametrize("n", [1, 8])
async def test_one_request_same_as_unshared(env, n):
    b, tok, base, tuned = env
    prompt = tok.encode("what is 2 plus 3? the answer")
    adapter = _adapter(b, tuned)
    out_s, out_u, (pre_s, pre_u), heads = await _on_engine(
        b, lambda: _run_both(b, lambda: [_job(prompt, n, adapter, max_tokens=12, temperature=1.0, seed=7, stop=[])])
    )
    _assert_same(out_s, out_u)
    assert (pre_s, pre_u) == (1, n)
    assert all(len(s.tokens) == 12 for s in out_s[0].sequences)
    if n == 8:
        assert len({tuple(s.tokens) for s in out_s[0].sequences}) > 1  # the rows really sample apart
    assert heads and all(contiguous for contiguous, _ in heads)


async def test_mixed_batch_same_as_unshared(env):
    """Two requests with one prompt and different seeds, prompts of different lengths, two adapters,
    stop tokens, stop strings and max_tokens 1 in one batch."""
    b, tok, base, tuned = env
    ab, at = _adapter(b, base), _adapter(b, tuned)
    group = tok.encode("the cat and the dog and the")
    short, long_ = tok.encode("one"), tok.encode("hello world the cat and the dog said it was a fine day to")
    free = (await b.sample(base, SampleRequest(tuple(short), 1, SamplingParams(max_tokens=6, temperature=0.0, stop=[])))).sequences[0]
    stop_text = tok.decode(free.tokens[:3])[-2:]

    def jobs():
        return [
            _job(group, 4, at, max_tokens=10, temperature=1.0, seed=1, stop=[]),
            _job(group, 4, at, max_tokens=10, temperature=1.0, seed=2, stop=[]),  # same prompt, another seed
            _job(group, 2, ab, max_tokens=10, temperature=1.0, seed=1, stop=[]),  # same prompt, base weights
            _job(short, 3, ab, max_tokens=6, temperature=0.0, stop=stop_text),  # a stop string
            _job(long_, 2, at, max_tokens=8, temperature=0.8, top_p=0.9, seed=3, stop=[free.tokens[0]]),  # a stop id
            _job(group, 5, at, max_tokens=1, temperature=1.0, seed=4, stop=[]),  # one token
        ]

    out_s, out_u, (pre_s, pre_u), heads = await _on_engine(b, lambda: _run_both(b, jobs))
    _assert_same(out_s, out_u)
    assert (pre_s, pre_u) == (4, 20)  # (tuned, group), (base, group), short, long vs every row
    seeded = [[s.tokens for s in r.sequences] for r in out_s[:2]]
    assert seeded[0] != seeded[1]  # one prefill, two seeds: two different groups
    assert out_s[3].sequences[0].stop_reason == "stop" and stop_text in tok.decode(out_s[3].sequences[0].tokens)
    assert all(len(s.tokens) == 1 and s.stop_reason == "length" for s in out_s[5].sequences)
    assert all(c for c, _ in heads) and {shape[0] for _, shape in heads} >= {4, 20}


async def test_concurrent_requests_share_a_prompt_and_match_alone(env):
    """Through the backend: concurrent requests with one prompt are prefilled once and sample exactly as
    each does alone."""
    b, tok, base, tuned = env
    prompt = tok.encode("what is 2 plus 3? the answer")
    reqs = [SampleRequest(tuple(prompt), 4, SamplingParams(max_tokens=8, temperature=1.0, seed=s, stop=[])) for s in (11, 12, 11)]
    alone = [await b.sample(tuned, r) for r in reqs]
    engine = b.engine
    probe = Probe(engine.slots[next(iter(engine.slots))].host.peft.get_base_model())
    gate, busy = await hold_engine(engine)
    results: list = [None] * len(reqs)

    async def one(i):
        results[i] = await b.sample(tuned, reqs[i])

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(reqs)):
                tg.start_soon(one, i)
            await until_queued(b.engine, len(reqs))  # every request is queued behind the gate
            gate.set()
            await busy.wait()
    finally:
        probe.close()
    assert probe.shapes[0][0] == 1  # one prefill row for the three requests
    assert probe.shapes[1][0] == 12  # then twelve decoding rows
    for a, r in zip(alone, results):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in r.sequences]
        for sa, sr in zip(a.sequences, r.sequences):
            assert sa.logprobs == pytest.approx(sr.logprobs, abs=TOL)
    assert [s.tokens for s in results[0].sequences] == [s.tokens for s in results[2].sequences]  # same seed
    assert [s.tokens for s in results[0].sequences] != [s.tokens for s in results[1].sequences]
