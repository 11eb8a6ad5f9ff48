"""An offline character-level tokenizer with the slice of the Hugging Face API that loops use."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from asyncsess.errors import InvalidInputError

__all__ = ["CharTokenizer", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
_ROLES = ("system", "user", "assistant")


class CharTokenizer:
    """Special tokens first, then tab, newline and printable ASCII; anything else encodes as ``<|unk|>``.

    Chat template: ``<|bos|>`` then ``<|role|>content<|end|>`` per message, plus ``<|assistant|>`` when
    ``add_generation_prompt`` is set. Special-token strings inside text encode as the special token, unless
    ``split_special_tokens`` (as in Hugging Face: then they are ordinary text).
    """

    pad_token, bos_token, eos_token, unk_token = SPECIAL_TOKENS[:4]
    pad_token_id, bos_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3
    name_or_path = "mock/char"

    def __init__(self) -> None:
        self._pieces: tuple[str, ...] = SPECIAL_TOKENS + tuple(_CHARS)
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    @property
    def pieces(self) -> tuple[str, ...]:
        """The text of every token id (index = id)."""
        return self._pieces

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(len(SPECIAL_TOKENS)))

    @property
    def all_special_tokens(self) -> list[str]:
        return list(SPECIAL_TOKENS)

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        unk = self.unk_token_id
        for part in [text] if split_special_tokens else self._special_re.split(text):
            if not split_special_tokens and part in self._ids and len(part) > 1:
                ids.append(self._ids[part])
            else:
                ids.extend(self._ids.get(ch, unk) for ch in part)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        n, first = len(self._pieces), len(SPECIAL_TOKENS) if skip_special_tokens else 0
        out = []
        for i in ids:
            if not 0 <= i < n:
                raise InvalidInputError(
                    f"token id {i} is outside the vocabulary [0, {n})", field="ids", fix="decode ids this tokenizer produced"
                )
            if i >= first:
                out.append(self._pieces[i])
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._ids.get(token, self.unk_token_id)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], tokenize: bool = True, add_generation_prompt: bool = False, **_: object
    ) -> list[int] | str:
        parts = [self.bos_token]
        for i, msg in enumerate(messages):
            role = msg.get("role")
            if role not in _ROLES:
                raise InvalidInputError(f"unknown role {role!r}", field=f"messages[{i}].role", fix=f"use one of {', '.join(_ROLES)}")
            parts.append(f"<|{role}|>{msg.get('content', '')}<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        text = "".join(parts)
        return self.encode(text, add_special_tokens=False) if tokenize else text
