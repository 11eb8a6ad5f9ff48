"""Checks shared by the mock and local top-k suites: the returned top-k are the k largest of the full
next-token distribution, which is measured independently with ``compute_logprobs`` (one call per candidate)."""

from __future__ import annotations

import math

import anyio

TOL = 1e-4


async def full_distribution(sc, context: list[int], vocab: int) -> list[float]:
    """log p(t | context) for every t, from compute_logprobs of context + [t]."""
    out = [0.0] * vocab

    async def one(t: int) -> None:
        out[t] = (await sc.compute_logprobs([*context, t]))[-1]

    async with anyio.create_task_group() as tg:
        for t in range(vocab):
            tg.start_soon(one, t)
    return out


def assert_topk(row: list[tuple[int, float]], full: list[float], k: int) -> None:
    assert len(row) == min(k, len(full))
    values = [lp for _, lp in row]
    assert values == sorted(values, reverse=True), "top-k not in descending order"
    expected = sorted(full, reverse=True)[: len(row)]
    for (tok, lp), want in zip(row, expected):
        assert math.isclose(lp, want, abs_tol=TOL), (lp, want)
        assert math.isclose(lp, full[tok], abs_tol=TOL), "the id does not carry its own log-prob"
    assert len({t for t, _ in row}) == len(row)


async def check_prompt_topk(sc, prompt: list[int], k: int, vocab: int) -> None:
    resp = await sc.sample(prompt, 1, {"max_tokens": 1}, include_prompt_logprobs=True, topk_prompt_logprobs=k)
    rows = resp.topk_prompt_logprobs
    assert rows is not None and len(rows) == len(prompt) and rows[0] is None
    for i in range(1, len(prompt)):
        assert_topk(rows[i], await full_distribution(sc, prompt[:i], vocab), k)


async def check_sample_topk(sc, prompt: list[int], k: int, vocab: int, num_samples: int = 2, max_tokens: int = 3) -> None:
    resp = await sc.sample(prompt, num_samples, {"max_tokens": max_tokens, "stop": []}, topk_sample_logprobs=k)
    for seq in resp.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        for j, row in enumerate(seq.topk_logprobs):
            assert_topk(row, await full_distribution(sc, prompt + seq.tokens[:j], vocab), k)


async def check_last_n(sc, prompt: list[int], n: int) -> None:
    full = await sc.compute_logprobs(prompt)
    tail = await sc.compute_logprobs(prompt, prompt_logprobs_last_n=n)
    assert tail[-n:] == full[-n:] and tail[:-n] == [None] * (len(prompt) - n)
    resp = await sc.sample(prompt, 1, {"max_tokens": 1}, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=n)
    assert resp.prompt_logprobs[:-n] == [None] * (len(prompt) - n)
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(resp.prompt_logprobs[-n:], full[-n:]))
    assert resp.topk_prompt_logprobs[:-n] == [None] * (len(prompt) - n) and all(r is not None for r in resp.topk_prompt_logprobs[-n:])


async def check_targets(sc, prompt: list[int], ids: list[list[int]], vocab: int) -> None:
    resp = await sc.sample(prompt, 1, {"max_tokens": 1}, target_prompt_logprobs=ids)
    got = resp.target_prompt_logprobs
    assert got is not None and got.shape == [len(prompt) - 1, len(ids[0])]
    values = got.to_numpy()
    for i, row in enumerate(ids):
        full = await full_distribution(sc, prompt[: i + 1], vocab)
        for j, t in enumerate(row):
            assert math.isclose(float(values[i, j]), 0.0 if t == -1 else full[t], abs_tol=TOL)
