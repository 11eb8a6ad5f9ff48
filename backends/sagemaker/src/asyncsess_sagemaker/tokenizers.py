"""Client-side tokenizers: the service takes token ids only.

In order: a local Hugging Face directory (``tokenizer_path``), another asyncsess backend's tokenizer
(``tokenizer_backend``, e.g. ``mock://`` for the emulator over ``mock://``), else the Hugging Face hub id
the SageMaker Public Hub publishes for the base model.
"""

from __future__ import annotations

from typing import Any

from asyncsess.backends import Tokenizer, load_backend
from asyncsess.errors import InvalidInputError

__all__ = ["load_tokenizer"]


def _hf(name_or_path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InvalidInputError(
            "loading a Hugging Face tokenizer needs transformers",
            field="tokenizer",
            fix="pip install 'asyncsess-sagemaker[tokenizer]', or pass tokenizer_backend=<url> / token ids",
        ) from None
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise InvalidInputError(
            f"could not load tokenizer {name_or_path!r}: {err}", field="tokenizer", fix="pass tokenizer_path=<local dir> for offline use"
        ) from None


def load_tokenizer(hf_id: str, *, tokenizer_path: str | None, tokenizer_backend: str | None) -> Tokenizer:
    if tokenizer_path:
        return _hf(tokenizer_path)
    if tokenizer_backend:
        return load_backend(tokenizer_backend).get_tokenizer(hf_id)
    return _hf(hf_id)
