"""Chat rendering through the tokenizer's own chat template: token ids, assistant spans, turn stops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidInputError

__all__ = ["Message", "chat_tokens", "assistant_spans", "turn_stop_tokens"]

Message = Mapping[str, str]


def chat_tokens(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` as a plain ``list[int]`` (transformers 5 returns a mapping)."""
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(out, list):
        out = out["input_ids"]
    return [int(t) for t in out]


def assistant_spans(tokenizer: Any, messages: Sequence[Message]) -> tuple[list[int], list[tuple[int, int]]]:
    """The conversation's tokens and the ``[start, end)`` token span of each assistant message.

    A span covers what the model must generate for that turn: the content and the template's
    end-of-turn tokens, not the role header. Found by rendering growing prefixes, so the template must
    render a prefix of a conversation as a prefix of its tokens (true of common chat templates).
    """
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        head = chat_tokens(tokenizer, messages[:i], add_generation_prompt=True)
        upto = chat_tokens(tokenizer, messages[: i + 1])
        if upto[: len(head)] != head:
            raise InvalidInputError(
                "the chat template does not render a conversation prefix as a token prefix",
                field=f"messages[{i}]",
                fix="use a tokenizer whose chat template is prefix-stable, or build datums with asyncsess.rl.data.sft_datum",
            )
        spans.append((len(head), len(upto)))
    full = chat_tokens(tokenizer, messages)
    if spans and full[: spans[-1][1]] != upto:
        raise InvalidInputError("the chat template is not prefix-stable", field="messages", fix="see assistant_spans")
    return full, spans


def turn_stop_tokens(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn: the special tokens the template puts after the content, plus EOS."""
    full, [(start, end)] = assistant_spans(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    stops = [t for t in full[start:end] if t in special]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.append(int(eos))
    return list(dict.fromkeys(stops))
