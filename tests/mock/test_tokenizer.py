from __future__ import annotations

import pytest

from asyncsess.backends import Tokenizer
from asyncsess.errors import InvalidInputError
from asyncsess_mock import CharTokenizer


def test_round_trip_and_special_ids():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("Hi there!\n\tok")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "<|bos|>Hi there!\n\tok"
    assert tok.decode(ids, skip_special_tokens=True) == "Hi there!\n\tok"
    assert tok.encode("ab", add_special_tokens=False) == [tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")]
    assert len({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}) == 3
    assert 100 <= tok.vocab_size == len(tok) <= 130


def test_unknown_characters_and_bad_ids():
    tok = CharTokenizer()
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    with pytest.raises(InvalidInputError) as err:
        tok.decode([tok.vocab_size])
    assert err.value.field == "ids"


def test_special_token_text_encodes_as_one_token():
    tok = CharTokenizer()
    ids = tok.encode("a<|eos|>b", add_special_tokens=False)
    assert ids == [tok.convert_tokens_to_ids("a"), tok.eos_token_id, tok.convert_tokens_to_ids("b")]


def test_chat_template():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>be brief<|end|><|user|>2+2?<|end|><|assistant|>"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert tok.decode(ids) == text
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.apply_chat_template(msgs)[-1] == tok.convert_tokens_to_ids("<|end|>")
    with pytest.raises(InvalidInputError) as err:
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert err.value.field == "messages[0].role"
