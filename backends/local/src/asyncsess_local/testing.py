"""A tiny Llama built offline for tests, examples and benchmarks.

Random weights, a byte-level BPE tokenizer trained on the fly with ``tokenizers`` and a chat template,
written with ``save_pretrained`` so that loading goes through the real ``from_pretrained`` code.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["TINY_CHAT_TEMPLATE", "build_tiny_llama", "tiny_llama_dir"]

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_VERSION = 1  # bump when the builder changes, so cached copies are rebuilt
_SPECIALS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_WORDS = (
    "the a an one two three four five six seven eight nine ten zero plus minus times equals answer is "
    "what how many question please compute sum of and or not yes no cat dog bird fish red green blue "
    "small large model train sample token loss step learn rate good bad true false hello world"
).split()


def _corpus(lines: int = 400) -> list[str]:
    import random

    rng = random.Random(0)
    out = []
    for i in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        out.append(f"{words}. what is {a} plus {b}? the answer is {a + b}. line {i}")
    return out


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|end|>",
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_layers: int = 2,
    vocab_size: int = 384,
    max_position_embeddings: int = 512,
    tie_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random-init Llama (``head_dim = hidden_size // num_heads``) and its tokenizer to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_embeddings,
        torch_dtype="float32",  # type: ignore[call-arg]  # accepted (and saved) by every transformers we support
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # a larger output scale than the default init, so that sampling is not uniform noise
        torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama_dir(**kwargs: int) -> Path:
    """A cached tiny Llama under ``$ASYNCSESS_CACHE`` (default: the temp dir), built on first use."""
    key = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) or "default"
    root = Path(os.environ.get("ASYNCSESS_CACHE", Path(tempfile.gettempdir()) / "asyncsess-cache"))
    path = root / f"tiny-llama-v{_VERSION}-{key}"
    marker = path / "asyncsess-tiny.json"
    if not marker.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-"))
        build_tiny_llama(tmp, **kwargs)  # type: ignore[arg-type]  # the kwargs are build_tiny_llama's int sizes
        (tmp / "asyncsess-tiny.json").write_text(json.dumps(kwargs))
        try:
            tmp.rename(path)
        except OSError:  # another process won the race
            if not marker.exists():
                raise
    return path
