"""Tokenizers: the built-in character tokenizer, and tokenizer.json + chat template checked
against transformers' own tokenizer on a small tokenizer built offline."""

import json

import pytest
import transformers
from hf_tokenizer_files import write_word_tokenizer  # tests/hf_tokenizer_files.py

from dora_jax.config import ModelConfig
from dora_jax.model.tokenizer import CharTokenizer, HFTokenizer, TokenizerError, load_tokenizer


def test_char_tokenizer_round_trip_and_fits_default_model():
    tok = CharTokenizer()
    assert tok.vocab_size == ModelConfig().vocab_size == 64
    text = "12+7*(3-1)=26\nok"
    ids = tok.encode(text)
    assert min(ids) >= 3 and tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.decode([tok.bos_id, *ids], skip_special=False).startswith("<bos>12")
    with pytest.raises(TokenizerError, match=r"character 'Q' at position 2 of 'abQ'"):
        tok.encode("abQ")
    with pytest.raises(TokenizerError, match="token id 99 is outside the vocabulary"):
        tok.decode([99])


@pytest.fixture
def hf_dir(tmp_path):
    words = ["hello", "world", "what", "is", "2", "+", "3", "?", "5", "user", "assistant",
             "system", "be", "brief"]  # fmt: skip
    return write_word_tokenizer(tmp_path, words)


def test_hf_tokenizer_matches_transformers(hf_dir):
    ours = HFTokenizer(hf_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2 + 3 ?"},
    ]
    for gen in (True, False):
        ref = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref
    text = ours.apply_chat_template(messages)
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_id == theirs.eos_token_id and ours.pad_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)
    assert ours.decode(ours.encode("hello world")) == "hello world"


def test_hf_tokenizer_bad_files(hf_dir):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<nope>"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"eos_token '<nope>' is not a token"):
        HFTokenizer(hf_dir)
    (hf_dir / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be parsed"):
        HFTokenizer(hf_dir)
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        load_tokenizer("hf", hf_dir)
    with pytest.raises(TokenizerError, match="no model.hf_path is set"):
        load_tokenizer("hf", None)
