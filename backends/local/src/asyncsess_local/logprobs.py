"""Log-probs of target tokens for packed sequences, in fp32 and in chunks.

Sequences are packed first-fit-decreasing into rows no longer than the longest sequence (so attention
costs at most about what it would unpacked), with ``position_ids`` restarting at 0 for each; the tail
of a short row is filled by a throw-away segment rather than an attention mask. transformers turns
restarting positions into a block-causal mask, so sequences never attend to each other, and a row that
holds one sequence keeps the plain causal path. The LM head runs over ``chunk`` real positions at a
time, under activation checkpointing when gradients are needed, so the ``[tokens, vocab]`` logits never
exist for the whole batch at once.

A target may be ``(n,)`` (one token per position) or ``(n, K)`` (K candidate tokens per position, the
multi-target losses): each chunk's logits are gathered at all K columns, so K costs a gather, not a pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .prefix import PrefixGroup

__all__ = ["packed_logprobs", "head_is_plain", "next_token_logprobs", "topk_rows"]


def _chunk_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    """``[n, K]`` log-probs of ``targets`` (``[n, K]``) under ``head(hidden)``."""
    return _gather_logprobs(head(hidden), targets)


def _gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    logits = logits.float()
    return logits.gather(-1, targets) - logits.logsumexp(-1, keepdim=True)


def _as_columns(targets: Tensor, width: int) -> Tensor:
    """``(n,)`` or ``(n, K)`` targets as ``(n, width)``, padded with token 0 (its log-prob is dropped)."""
    cols = targets[:, None] if targets.dim() == 1 else targets
    return cols if cols.shape[1] == width else torch.nn.functional.pad(cols, (0, width - cols.shape[1]))


def _rows(lengths: list[int]) -> list[list[int]]:
    """First-fit-decreasing bins of sequence indices, each bin at most the longest length."""
    cap = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r in range(len(rows)) if room[r] >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(cap)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


@dataclass
class _Packed:
    ids: Tensor  # [rows, width]
    pos: Tensor  # [rows, width] position ids
    index: Tensor  # flat index (into rows·width) of every scored position, sequence by sequence in ``order``
    targets: Tensor  # [len(index), K]
    order: list[int]
    mask: Tensor | None  # [rows, 1, width, width] True where attention is allowed; None: block-causal by positions


def _pack(seqs: list[tuple[Tensor, Tensor]], groups: Sequence[PrefixGroup] | None = None) -> _Packed:
    """Pack ``seqs`` into rows; a group of two or more lays out its prefix once, then each member's suffix."""
    device = seqs[0][0].device
    lengths = [len(s) for s, _ in seqs]
    units = list(groups) if groups is not None else [PrefixGroup(0, (i,)) for i in range(len(seqs))]
    spans = [u.span(lengths) for u in units]
    rows = _rows(spans)
    width = max(sum(spans[u] for u in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    pos = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    shared = any(len(u.members) > 1 for u in units)
    seg = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # only read when ``shared``
    branch = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    flat, order = [], []
    for r, row in enumerate(rows):
        at = 0
        for u in row:
            unit = units[u]
            trunk = unit.prefix if len(unit.members) > 1 else lengths[unit.members[0]]
            first = seqs[unit.members[0]][0]
            ids[r, at : at + trunk] = first[:trunk]
            pos[r, at : at + trunk] = torch.arange(trunk, device=device)
            seg[r, at:] = u + 1
            base, at = r * width + at, at + trunk
            for b, i in enumerate(unit.members if len(unit.members) > 1 else ()):
                n = lengths[i] - trunk
                ids[r, at : at + n] = seqs[i][0][trunk:]
                pos[r, at : at + n] = torch.arange(trunk, lengths[i], device=device)
                branch[r, at : at + n] = b + 1
                flat.append(
                    torch.cat(
                        [torch.arange(base, base + trunk, device=device), torch.arange(r * width + at, r * width + at + n, device=device)]
                    )
                )
                order.append(i)
                at += n
            if len(unit.members) == 1:
                flat.append(torch.arange(base, base + trunk, device=device))
                order.append(unit.members[0])
        pos[r, at:] = torch.arange(width - at, device=device)  # filler: its own segment, never scored
        seg[r, at:] = 0
    width_k = max(1 if t.dim() == 1 else t.shape[1] for _, t in seqs)
    targets = torch.cat([_as_columns(seqs[i][1], width_k) for i in order])
    mask = None
    if shared:  # prefix-tree mask: causal, within one unit, and a suffix sees only the trunk and itself
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        same = seg[:, :, None] == seg[:, None, :]
        sees = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
        mask = (causal & same & sees)[:, None]
    return _Packed(ids, pos, torch.cat(flat), targets, order, mask)


def _fold(index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct positions of ``index``, and for each entry its distinct position and its rank among equals."""
    unique, inverse = torch.unique(index, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=len(unique))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(inverse)
    rank[order] = torch.arange(len(inverse), device=index.device) - starts[inverse[order]]
    return unique, inverse, rank


def _spread(targets: Tensor, inverse: Tensor, rank: Tensor, rows: int) -> Tensor:
    """``[rows, R·K]`` targets: entry ``e``'s K targets in row ``inverse[e]``, columns ``rank[e]·K ...``."""
    k = targets.shape[1]
    out = torch.zeros(rows, (int(rank.max()) + 1) * k, dtype=targets.dtype, device=targets.device)
    out[inverse[:, None], rank[:, None] * k + torch.arange(k, device=targets.device)] = targets
    return out


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive float mask every attention implementation takes."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def packed_logprobs(
    model: Any,
    seqs: list[tuple[Tensor, Tensor]],
    *,
    chunk: int = 1024,
    plain_head: bool = True,
    groups: Sequence[PrefixGroup] | None = None,
) -> list[Tensor]:
    """fp32 log-prob of ``targets[i]`` after ``inputs[:i+1]`` for each ``(inputs, targets)`` pair.

    Each result has its targets' shape: ``(n,)``, or ``(n, K)`` for K targets per position.

    ``model`` is a transformers causal LM (peft layers inside act as usual). Gradients flow when
    autograd is enabled. ``plain_head=False`` is for models whose logits are not just
    ``head(hidden)`` (soft-capping, scaling): their full logits are computed, then reduced in chunks.
    ``groups`` (from :func:`~.prefix.find_groups`, covering every sequence once) run each group's shared
    prefix once, through the decoder and through the LM head (each prefix position's logits are gathered
    at every member's target); the result is the same as without them, up to float rounding.
    """
    packed = _pack(seqs, groups)
    index, targets = packed.index, packed.targets
    kw: dict[str, Any] = {"input_ids": packed.ids, "position_ids": packed.pos, "use_cache": False}
    if packed.mask is not None:
        kw["attention_mask"] = _additive(packed.mask, model.dtype)
        # a shared prefix position is scored once, at every member's target: fold the duplicates into columns
        index, inverse, columns = _fold(index)
        targets = _spread(targets, inverse, columns, len(index))
    grad = torch.is_grad_enabled()
    if plain_head:
        hidden = model.get_decoder()(**kw).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[index]
        head = model.get_output_embeddings()
        parts = []
        for s in range(0, hidden.shape[0], chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False) if grad else _chunk_logprobs(head, h, t))
        flat = torch.cat(parts)
    else:
        logits = model(**kw).logits
        logits = logits.reshape(-1, logits.shape[-1])[index]
        flat = torch.cat([_gather_logprobs(logits[s : s + chunk], targets[s : s + chunk]) for s in range(0, logits.shape[0], chunk)])
    if packed.mask is not None:
        k = packed.targets.shape[1]
        flat = flat[inverse[:, None], columns[:, None] * k + torch.arange(k, device=flat.device)]
    order = packed.order
    pieces = flat.split([len(seqs[i][0]) for i in order])
    out: list[Tensor] = [pieces[0]] * len(seqs)
    for k, i in enumerate(order):
        t = seqs[i][1]
        out[i] = pieces[k][:, 0] if t.dim() == 1 else pieces[k][:, : t.shape[1]]
    return out


@torch.no_grad()
def head_is_plain(model: Any, device: torch.device) -> bool:
    """Whether the model's logits are exactly ``head(decoder(x))`` (true for Llama, Qwen, Mistral...)."""
    ids = torch.arange(min(8, model.config.vocab_size), device=device)[None]
    full = model(input_ids=ids, use_cache=False).logits
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    return bool(torch.allclose(model.get_output_embeddings()(hidden).float(), full.float(), atol=1e-5, rtol=1e-4))


@torch.no_grad()
def next_token_logprobs(model: Any, tokens: list[int], device: torch.device) -> Tensor:
    """fp32 log-softmax of the next-token distribution after every prefix ``tokens[:i+1]``: ``[len(tokens), vocab]``."""
    ids = torch.tensor(tokens, device=device)[None]
    return model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)


def topk_rows(dist: Tensor, k: int) -> list[list[tuple[int, float]] | None]:
    """The ``k`` largest entries of each row as ``(token_id, logprob)``, largest first."""
    values, ids = dist.topk(min(k, dist.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
