"""Log-probs of target tokens for packed sequences, in fp32 and in chunks.

Sequences are concatenated into one row (no padding) with ``position_ids`` restarting at 0 for each;
transformers turns that into a block-causal mask, so sequences never attend to each other. The LM head
runs over ``chunk`` positions at a time, under activation checkpointing when gradients are needed, so
the ``[tokens, vocab]`` logits never exist for the whole batch at once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["packed_logprobs", "head_is_plain"]


def _chunk_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def _pack(seqs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    device = seqs[0][0].device
    ids = torch.cat([s for s, _ in seqs])[None]
    pos = torch.cat([torch.arange(len(s), device=device) for s, _ in seqs])[None]
    return ids, pos, torch.cat([t for _, t in seqs])


def packed_logprobs(model: nn.Module, seqs: list[tuple[Tensor, Tensor]], *, chunk: int = 1024, plain_head: bool = True) -> list[Tensor]:
    """fp32 log-prob of ``targets[i]`` after ``inputs[:i+1]`` for each ``(inputs, targets)`` pair.

    ``model`` is a transformers causal LM (peft layers inside act as usual). Gradients flow when
    autograd is enabled. ``plain_head=False`` is for models whose logits are not just
    ``head(hidden)`` (soft-capping, scaling): their full logits are computed, then reduced in chunks.
    """
    ids, pos, targets = _pack(seqs)
    grad = torch.is_grad_enabled()
    if plain_head:
        hidden = model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        head = model.get_output_embeddings()
        parts = []
        for s in range(0, hidden.shape[0], chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False) if grad else _chunk_logprobs(head, h, t))
        flat = torch.cat(parts)
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        flat = torch.cat(
            [
                logits[s : s + chunk].float().gather(-1, targets[s : s + chunk, None])[:, 0] - logits[s : s + chunk].float().logsumexp(-1)
                for s in range(0, logits.shape[0], chunk)
            ]
        )
    return list(flat.split([len(s) for s, _ in seqs]))


@torch.no_grad()
def head_is_plain(model: nn.Module, device: torch.device) -> bool:
    """Whether the model's logits are exactly ``head(decoder(x))`` (true for Llama, Qwen, Mistral...)."""
    ids = torch.arange(min(8, model.config.vocab_size), device=device)[None]
    full = model(input_ids=ids, use_cache=False).logits
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    return bool(torch.allclose(model.get_output_embeddings()(hidden).float(), full.float(), atol=1e-5, rtol=1e-4))
