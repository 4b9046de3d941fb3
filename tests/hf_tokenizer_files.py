"""A tiny word-level ``tokenizer.json`` + ``tokenizer_config.json`` with a Qwen-style chat
template, built offline for the tests that need a Hugging Face tokenizer directory."""

import json
from pathlib import Path

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_word_tokenizer(directory: Path, words: list[str]) -> Path:
    """Write the two files into ``directory``: ids are ``SPECIALS`` then ``words`` in order;
    EOS is ``<|im_end|>`` and padding ``<|endoftext|>``."""
    import tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.add_special_tokens(SPECIALS)
    tk.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
