"""Sampling from a frozen bigram log-prob table, vectorised across the samples of one request.

Returned log-probs are under the model's raw distribution (temperature 1, no top-k/top-p), the same
numbers ``compute_logprobs`` gives for prompt + tokens. With a seed, sample ``i`` of a request draws
its uniforms from its own generator ``(seed, i)``, so it does not depend on ``num_samples`` and a longer
``max_tokens`` extends it rather than changing it.
"""

from __future__ import annotations

import numpy as np

from asyncsess.backends import SampleRequest
from asyncsess.errors import InvalidInputError
from asyncsess.types import SampledSequence, SampleResponse, SamplingParams, TensorData, Usage
from asyncsess.validation import check_target_prompt_logprobs

__all__ = ["MockSampler"]

_SEED_MOD = 2**64


class MockSampler:
    """Samples and scores token sequences under a fixed (V, V) log-prob table."""

    def __init__(
        self,
        logp: np.ndarray,
        pieces: tuple[str, ...],
        eos_token_id: int,
        *,
        rng: np.random.Generator,
        max_context: int,
        default_max_tokens: int,
    ) -> None:
        self.logp = logp
        self.pieces = pieces
        self.eos_token_id = eos_token_id
        self.rng = rng
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens

    def _tokens(self, tokens: object, field: str) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64)
        v = self.logp.shape[0]
        if arr.ndim != 1 or arr.size == 0:
            raise InvalidInputError("needs at least one token id", field=field, fix="start from e.g. the tokenizer's bos_token_id")
        if arr.min() < 0 or arr.max() >= v:
            bad = int(arr[(arr < 0) | (arr >= v)][0])
            raise InvalidInputError(
                f"token id {bad} is outside the vocabulary [0, {v})", field=field, fix="use ids from this backend's tokenizer"
            )
        if arr.size > self.max_context:
            raise InvalidInputError(f"{arr.size} tokens exceed the context of {self.max_context}", field=field, fix="shorten it")
        return arr

    def compute_logprobs(self, tokens: list[int]) -> list[float | None]:
        arr = self._tokens(tokens, "tokens")
        return [None, *self.logp[arr[:-1], arr[1:]].tolist()]

    def sample(self, request: SampleRequest, request_no: int, sampler_id: str) -> SampleResponse:
        prompt = self._tokens(request.prompt, "prompt")
        if request.num_samples < 1:
            raise InvalidInputError(f"num_samples={request.num_samples}", field="num_samples", fix="ask for at least 1")
        params = request.sampling_params
        room = self.max_context - prompt.size
        if room < 1:
            raise InvalidInputError(
                f"a {prompt.size}-token prompt leaves no room in the {self.max_context}-token context", field="prompt", fix="shorten it"
            )
        max_tokens = min(params.max_tokens or self.default_max_tokens, room)
        stop_ids, stop_strings = self._stops(params)
        tokens, lps, lengths, stopped = self._generate(prompt[-1], request.num_samples, max_tokens, params, stop_ids, stop_strings)
        sequences = []
        for i in range(request.num_samples):
            n = int(lengths[i])
            context = np.concatenate([prompt[-1:], tokens[i, : n - 1]]) if n else prompt[:0]
            sequences.append(
                SampledSequence.model_construct(
                    stop_reason="stop" if stopped[i] else "length",
                    tokens=tokens[i, :n].tolist(),
                    logprobs=lps[i, :n].tolist(),
                    sequence_id=f"{sampler_id}:{request_no}:{i}",
                    usage=Usage.model_construct(training_tokens=0, prefill_tokens=int(prompt.size), decode_tokens=n),
                    topk_logprobs=self._topk(context, request.topk_sample_logprobs) if request.topk_sample_logprobs else None,
                )
            )
        prompt_logprobs = [None, *self.logp[prompt[:-1], prompt[1:]].tolist()] if request.include_prompt_logprobs else None
        topk_prompt = [None, *self._topk(prompt[:-1], request.topk_prompt_logprobs)] if request.topk_prompt_logprobs else None
        usage = Usage.model_construct(training_tokens=0, prefill_tokens=int(prompt.size), decode_tokens=int(lengths.sum()))
        return SampleResponse.model_construct(
            sequences=sequences,
            prompt_logprobs=prompt_logprobs,
            usage=usage,
            topk_prompt_logprobs=topk_prompt,
            target_prompt_logprobs=self._targets(prompt, request.target_prompt_logprobs),
            prompt_cache_hit_tokens=0,
        )

    def _topk(self, context: np.ndarray, k: int) -> list[list[tuple[int, float]] | None]:
        """For each context token, the k most likely next tokens and their log-probs, most likely first (ties: lower id)."""
        k = min(k, self.logp.shape[1])
        rows = self.logp[context]
        order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
        values = np.take_along_axis(rows, order, axis=1)
        return [list(zip(ids, lps)) for ids, lps in zip(order.tolist(), values.tolist())]

    def _targets(self, prompt: np.ndarray, target: tuple[tuple[int, ...], ...] | None) -> TensorData | None:
        """Log-probs of the requested ids at prompt positions 1..; 0.0 where the id is -1."""
        if target is None:
            return None
        ids = np.asarray(check_target_prompt_logprobs(target, prompt.size), dtype=np.int64)  # a request built past the client
        v = self.logp.shape[1]
        if ids.max() >= v:
            raise InvalidInputError(f"token id {int(ids.max())} is outside the vocabulary [0, {v})", field="target_prompt_logprobs")
        rows = self.logp[prompt[:-1]]
        out = np.where(ids >= 0, np.take_along_axis(rows, np.maximum(ids, 0), axis=1), 0.0)
        return TensorData.from_numpy(out.astype(np.float32), "float32")

    def _stops(self, params: SamplingParams) -> tuple[np.ndarray, list[str]]:
        """Token ids and strings that end a sequence; EOS is one unless ``stop == []``."""
        v = self.logp.shape[0]
        ids = params.stop_token_ids()
        for i in ids:
            if not 0 <= i < v:
                raise InvalidInputError(f"stop token id {i} is outside the vocabulary [0, {v})", field="sampling_params.stop")
        strings = params.stop_strings()
        if "" in strings:
            raise InvalidInputError("empty stop string", field="sampling_params.stop", fix="drop it")
        if params.stop != []:
            ids = [*ids, self.eos_token_id]
        return np.asarray(ids, dtype=np.int64), strings

    def _generate(self, last: int, n: int, max_tokens: int, params: SamplingParams, stop_ids: np.ndarray, stop_strings: list[str]):
        greedy = params.temperature == 0
        uniforms = np.empty((0, 0)) if greedy else self._uniforms(n, max_tokens, params.seed)
        tokens = np.zeros((n, max_tokens), dtype=np.int64)
        lps = np.zeros((n, max_tokens))
        lengths = np.full(n, max_tokens)
        stopped = np.zeros(n, dtype=bool)
        state = np.full(n, last, dtype=np.int64)
        active = np.arange(n)
        texts = [""] * n
        for t in range(max_tokens):
            rows = self.logp[state[active]]
            tok = rows.argmax(axis=1) if greedy else _draw(rows, uniforms[active, t], params)
            tokens[active, t] = tok
            lps[active, t] = rows[np.arange(active.size), tok]
            state[active] = tok
            hit = np.isin(tok, stop_ids)
            if stop_strings:
                for j, (i, k) in enumerate(zip(active.tolist(), tok.tolist())):
                    piece = self.pieces[k]
                    texts[i] += piece
                    hit[j] |= any(s in texts[i][-(len(s) + len(piece) - 1) :] for s in stop_strings)
            if hit.any():
                done = active[hit]
                stopped[done] = True
                lengths[done] = t + 1
                active = active[~hit]
                if active.size == 0:
                    break
        return tokens, lps, lengths, stopped

    def _uniforms(self, n: int, max_tokens: int, seed: int | None) -> np.ndarray:
        base = int(self.rng.integers(2**63)) if seed is None else seed % _SEED_MOD
        return np.stack([np.random.default_rng([base, i]).random(max_tokens) for i in range(n)])


def _draw(rows: np.ndarray, u: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One token per row from ``softmax(rows / T)`` restricted by top-k then top-p, by inverse CDF on ``u``.

    The row max is subtracted before dividing, so a tiny T (a subnormal) gives -inf, not inf - inf = NaN."""
    with np.errstate(over="ignore"):
        logits = (rows - rows.max(axis=1, keepdims=True)) / params.temperature
    filtered = params.top_k > 0 or params.top_p < 1.0
    if filtered:
        order = np.argsort(-logits, axis=1, kind="stable")
        logits = np.take_along_axis(logits, order, axis=1)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    if params.top_k > 0:
        probs[:, params.top_k :] = 0.0
    if params.top_p < 1.0:
        probs /= probs.sum(axis=1, keepdims=True)
        before = np.cumsum(probs, axis=1) - probs
        probs[before >= params.top_p] = 0.0
    cdf = np.cumsum(probs, axis=1)
    idx = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
    idx = np.minimum(idx, rows.shape[1] - 1)
    return np.take_along_axis(order, idx[:, None], axis=1)[:, 0] if filtered else idx
