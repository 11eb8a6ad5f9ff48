"""Attention for the CPU: a decode step's grouped-query attention as two batched matmuls, in float32.

On the CPU, ``torch.nn.functional.scaled_dot_product_attention`` with a mask takes its generic path, which for a
one-token query (every sampler decode step) is about 4–5× slower than two matmuls (``bench/bench_attention.py``).
:func:`grouped_attention` multiplies the query heads of each key/value head against that head once (no
``repeat_kv`` copy), with scores, softmax and the value product in float32, then rounds the output to the
model's dtype, as SDPA's CPU kernel does: the results agree with SDPA's to float32 rounding.

:func:`cpu_attention` is registered with transformers as ``"asyncsess_grouped"`` and takes SDPA's masks: it
runs :func:`grouped_attention` for one-token queries and SDPA, unchanged, for everything else (prefill and
training passes, where the two measure alike, attention dropout, sliding windows, attention sinks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["NAME", "cpu_attention", "grouped_attention", "register"]

NAME = "asyncsess_grouped"


def grouped_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    is_causal: bool | None = None,
) -> tuple[Tensor, None]:
    """``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, KV, L, D]`` (``H`` a multiple of ``KV``); the output
    ``[B, T, H, D]``. ``attention_mask``: boolean (True attends) or additive, ``[B or 1, 1, T, L]``; None is causal."""
    b, h, t, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g = h // kv  # query heads per key/value head, adjacent (as transformers' repeat_kv pairs them)
    scale = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, kv, g * t, d).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale).view(b, kv, g, t, length)
    if attention_mask is None and t > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        attention_mask = torch.ones(t, length, dtype=torch.bool, device=query.device).tril(length - t)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, None] if mask.dim() == 4 else mask  # [B, 1, T, L] → [B, 1, 1, T, L] against [B, KV, G, T, L]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask.float()
    probs = scores.softmax(-1)
    if mask is not None and mask.dtype == torch.bool:
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # a query that sees no key gets 0, as in SDPA
    probs = probs.view(b, kv, g * t, length)
    out = torch.matmul(probs, value.float()).view(b, h, t, d).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def cpu_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: :func:`grouped_attention` for a one-token query, else SDPA."""
    plain = not dropout and not kwargs.get("sliding_window") and kwargs.get("s_aux") is None
    if query.shape[2] == 1 and plain and query.shape[1] % key.shape[1] == 0:
        return grouped_attention(module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def register() -> str:
    """Register :func:`cpu_attention` (and SDPA's mask format for it) with transformers; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cpu_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
