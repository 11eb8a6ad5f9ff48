"""The bigram language model: ``logits(next | prev) = W[prev] + D[prev]``.

``W`` is a fixed (V, V) float64 table derived from a hash of the base-model name, so any name works and
the same name always gives the same model. ``D`` is the trainable delta (zeros for a fresh session).
Everything is computed from the full log-softmax table, which costs V² and is cached by callers.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

__all__ = ["base_table", "log_softmax_table", "token_logprobs", "grad_from_coeffs", "BASE_SCALE"]

BASE_SCALE = 1.5  # std of the base logits: peaked enough that sampling is not uniform noise


@lru_cache(maxsize=64)
def base_table(base_model: str, vocab_size: int) -> np.ndarray:
    """The read-only base logit table for ``base_model``."""
    seed = int.from_bytes(hashlib.sha256(base_model.encode()).digest()[:8], "little")
    table = np.random.default_rng(seed).normal(0.0, BASE_SCALE, size=(vocab_size, vocab_size))
    table.flags.writeable = False
    return table


def log_softmax_table(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of a (V, V) logit table."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def token_logprobs(logp: np.ndarray, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``log P(targets[t] | inputs[t])`` for every position (position t predicts ``targets[t]``)."""
    return logp[inputs, targets]


def grad_from_coeffs(probs: np.ndarray, inputs: np.ndarray, targets: np.ndarray, g: np.ndarray) -> np.ndarray:
    """∂L/∂D for per-token coefficients ``g = −∂L/∂p``: row x_t gets ``−g_t·(onehot(y_t) − softmax(x_t))``.

    ``probs`` is the softmax table ``exp(logp)``. Accumulated with ``np.bincount`` (the same sums as
    ``np.add.at``, without its per-element overhead).
    """
    v = probs.shape[0]
    row_coeff = np.bincount(inputs, weights=g, minlength=v)
    grad = row_coeff[:, None] * probs
    grad -= np.bincount(inputs * v + targets, weights=g, minlength=v * v).reshape(v, v)
    return grad
