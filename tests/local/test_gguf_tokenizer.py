"""A tokenizer from a GGUF file (how the demo's SmolLM2 ships): transformers picks CodeLlama's tokenizer class for a
llama file (five infill tokens past the model's vocabulary; "<FILL_ME>" in a prompt encodes to nothing) and takes
BOS for EOS, so the demo's turns never ended at ChatML's "<|im_end|>" (every sample ran on into junk). The test
writes a GGUF file from the tiny model's own tokenizer, so it needs no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncsess.chat import turn_stop_tokens

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def reference(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def gguf_dir(tiny_dir: Path, reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer as a llama GGUF file (gpt2-style BPE, its specials as control tokens)."""
    import gguf
    import numpy as np

    spec = json.loads((tiny_dir / "tokenizer.json").read_text())
    tokens = [""] * len(reference)
    for text, i in spec["model"]["vocab"].items():
        tokens[i] = text
    specials = {a["id"] for a in spec["added_tokens"]}
    for a in spec["added_tokens"]:
        tokens[a["id"]] = a["content"]
    tokens.append("<|endoftext|>")  # in the vocabulary, as in SmolLM2's file (else transformers >= 5.2x appends it)
    specials.add(len(tokens) - 1)
    out = tmp_path_factory.mktemp("gguf")
    w = gguf.GGUFWriter(str(out / "tiny.gguf"), "llama")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(reference.bos_token_id)
    w.add_eos_token_id(reference.eos_token_id)
    w.add_pad_token_id(reference.pad_token_id)
    w.add_unk_token_id(len(tokens) - 1)
    w.add_chat_template(reference.chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gguf_tokenizer_keeps_the_files_vocabulary_and_special_tokens(gguf_dir: Path, reference) -> None:
    from asyncsess_local.models import ModelSource, gguf_special_tokens, load_tokenizer

    tok = load_tokenizer(ModelSource("g", str(gguf_dir), {"gguf_file": "tiny.gguf"}))
    assert gguf_special_tokens(gguf_dir / "tiny.gguf") == {
        "bos_token": reference.bos_token_id,
        "eos_token": reference.eos_token_id,
        "pad_token": reference.pad_token_id,
        "unk_token": len(reference),
    }
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|end|>", "<s>", "<pad>")
    assert len(tok) == len(reference) + 1  # the file's tokens and none past them (the model has no embedding for those)
    text = "what is 12 plus 3? <FILL_ME> <|end|>"
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert turn_stop_tokens(tok) == [reference.convert_tokens_to_ids("<|end|>")]


def test_turn_stops_include_special_tokens_the_tokenizer_does_not_name(tiny_dir: Path, reference) -> None:
    """Named specials were the only ones looked for: a tokenizer that names another EOS (as transformers' GGUF
    conversion does) stopped a turn only at that token, never at the template's end-of-turn token."""
    from transformers import PreTrainedTokenizerFast

    renamed = PreTrainedTokenizerFast.from_pretrained(tiny_dir, eos_token="<s>")
    end = reference.convert_tokens_to_ids("<|end|>")
    assert end not in renamed.all_special_ids  # the case: <|end|> is special only in added_tokens_decoder
    assert turn_stop_tokens(renamed) == [end, renamed.convert_tokens_to_ids("<s>")]


def test_turn_stops_skip_special_tokens_the_template_puts_before_the_content(tiny_dir: Path, reference) -> None:
    """A template that opens the assistant's content with a special marker (a reasoning block) must not make that
    marker a stop: the model would end every turn before it began."""
    from transformers import PreTrainedTokenizerFast

    marked = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    marked.add_special_tokens({"additional_special_tokens": ["<think>"]})
    marked.chat_template = reference.chat_template.replace(
        "<|{{ m['role'] }}|>{{ m['content'] }}", "<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}<think>{% endif %}{{ m['content'] }}"
    )
    assert turn_stop_tokens(marked) == [reference.convert_tokens_to_ids("<|end|>")]
