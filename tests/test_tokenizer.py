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
    words = [
        "hello",
        "world",
        "what",
        "is",
        "2",
        "+",
        "3",
        "?",
        "5",
        "user",
        "assistant",
        "system",
        "be",
        "brief",
    ]
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


def test_eos_ids_from_generation_config_end_responses(hf_dir):
    """Qwen2.5-Instruct style: eos_token <|im_end|> plus generation_config.json's list
    [<|im_end|>, <|endoftext|>]: both end a response and both are stripped before scoring."""
    from dora_jax.model.tokenizer import eos_ids, response_ids

    assert HFTokenizer(hf_dir).eos_ids == (2,)  # no generation_config.json: the eos_token only
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = HFTokenizer(hf_dir)
    assert tok.eos_id == 2 and tok.eos_ids == eos_ids(tok) == (2, 3)
    hello, world = tok.encode("hello world")
    assert response_ids(tok, [hello, 3]) == response_ids(tok, [hello, 2]) == [hello]
    assert response_ids(tok, [hello, world]) == [hello, world]
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert HFTokenizer(hf_dir).eos_ids == (2, 3)  # a single id is accepted too
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 999]}))
    with pytest.raises(TokenizerError, match="eos_token_id 999 is not a token id"):
        HFTokenizer(hf_dir)


def test_vocabulary_check_and_undecodable_ids(hf_dir):
    """A tokenizer larger than the model is refused; a model larger than the tokenizer (as
    Qwen's padded 151936 rows for 151665 tokens) is accepted with a note, and sampled ids past
    the tokenizer are counted rather than silently decoded to nothing."""
    from dora_jax.model.tokenizer import check_vocabularies, undecodable

    tok = HFTokenizer(hf_dir)
    n = tok.vocab_size
    with pytest.raises(
        TokenizerError, match=f"model.vocab_size is {n - 1} but the hf tokenizer has {n} tokens"
    ):
        check_vocabularies(tok, n - 1, "hf")
    assert check_vocabularies(tok, n, "hf") is None
    note = check_vocabularies(tok, n + 10, "hf")
    assert note is not None and "10 ids cannot be decoded" in note
    hello = tok.encode("hello")[0]
    assert tok.decode([hello, n + 3]) == "hello"  # the library drops the unknown id...
    assert undecodable(tok, [hello, n + 3, n + 9, 2]) == 2  # ...so it is counted here
    assert undecodable(CharTokenizer(), [5, 70]) == 1


def test_chat_template_as_transformers_5_saves_it(hf_dir, tmp_path):
    """transformers 5 writes the template to chat_template.jinja, not to tokenizer_config.json:
    it must render as transformers renders it, never as the bare message text."""
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(str(hf_dir)).save_pretrained(str(saved))
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    ours = HFTokenizer(saved)
    theirs = transformers.AutoTokenizer.from_pretrained(str(saved))
    messages = [{"role": "user", "content": "what is 2 + 3 ?"}]
    ref = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ref.startswith("<|im_start|>user")
    assert ours.apply_chat_template(messages) == ref
    assert ours.chat_template_source == str(saved / "chat_template.jinja")


def test_chat_template_legacy_files_and_named_templates(hf_dir):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HFTokenizer(hf_dir).chat_template is None  # no template anywhere: none
    (hf_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = HFTokenizer(hf_dir)
    assert tok.chat_template == template and tok.chat_template_source.endswith(".json")
    (hf_dir / "chat_template.json").unlink()
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    cfg["chat_template"] = named
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HFTokenizer(hf_dir).chat_template == template
    # chat_template.jinja wins over the others, as in transformers
    (hf_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert HFTokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize(
    "write, match",
    [
        (
            lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}"),
            r"chat_template\.jinja: the chat template is not valid Jinja",
        ),
        (
            lambda d: (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}"),
            r"chat_template\.jinja: cannot be read as UTF-8",
        ),
        (
            lambda d: (d / "chat_template.jinja").write_text("  \n"),
            r"chat_template\.jinja: the chat template is empty",
        ),
        (
            lambda d: (d / "chat_template.json").write_text("{oops"),
            r"chat_template\.json: not valid JSON",
        ),
        (
            lambda d: (d / "chat_template.json").write_text(json.dumps({"chat_template": 3})),
            r"chat_template\.json: chat_template must be a string or a list",
        ),
        (
            lambda d: (d / "chat_template.json").write_text(
                json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]})
            ),
            r"without a 'default' one \(names: \['tool_use'\]\)",
        ),
    ],
)
def test_a_template_that_cannot_be_read_is_refused(hf_dir, write, match):
    write(hf_dir)
    with pytest.raises(TokenizerError, match=match):
        HFTokenizer(hf_dir)
