"""Tokenizers: Hugging Face ``tokenizer.json`` (with the model's chat template) and a built-in
character tokenizer for the synthetic tasks.

Both satisfy :class:`Tokenizer`; the rest of the system only sees that protocol.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, str]


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or text cannot be encoded."""


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str: ...


SPECIALS = ("<pad>", "<bos>", "<eos>")
# 61 characters + 3 specials = a 64-entry vocabulary, the default tiny model's vocab_size.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " \n+-*/=()<>.,:;?!#_^[]{}|"


class CharTokenizer:
    """One id per character: ``<pad>=0, <bos>=1, <eos>=2``, then ``alphabet`` in order.

    Used by the built-in tasks; there is no chat template (prompts are used as they are).
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise TokenizerError("CharTokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(SPECIALS) + len(alphabet)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        out = []
        for i, ch in enumerate(text):
            tid = self._ids.get(ch)
            if tid is None:
                raise TokenizerError(
                    f"character {ch!r} at position {i} of {text[:40]!r} is not in the "
                    "character tokenizer's alphabet"
                )
            out.append(tid)
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        chars = []
        for t in ids:
            t = int(t)
            if t < len(SPECIALS):
                if not skip_special:
                    chars.append(SPECIALS[t])
                continue
            if t >= self.vocab_size:
                raise TokenizerError(f"token id {t} is outside the vocabulary ({self.vocab_size})")
            chars.append(self.alphabet[t - len(SPECIALS)])
        return "".join(chars)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        return "".join(m["content"] for m in messages if m["role"] == "user")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library, plus ``tokenizer_config.json``'s
    special tokens and Jinja chat template when present."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: missing (only fast tokenizers are supported)")
        try:
            self._tok = _Tok.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception for parse errors
            raise TokenizerError(f"{tok_file}: cannot be parsed ({e})") from None
        self.config = _read_json(path / "tokenizer_config.json")
        self.chat_template = self.config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_id = self._require_id(self.eos_token, "eos_token", tok_file)
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        pad = _token_text(self.config.get("pad_token"))
        self.pad_id = self._tok.token_to_id(pad) if pad else self.eos_id

    def _require_id(self, token: str | None, name: str, where: Path) -> int:
        tid = self._tok.token_to_id(token) if token else None
        if tid is None:
            raise TokenizerError(f"{where.parent / 'tokenizer_config.json'}: {name} {token!r} "
                                 "is not a token of tokenizer.json")  # fmt: skip
        return tid

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            return "".join(m["content"] for m in messages)
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def encode_prompt(tokenizer: Tokenizer, text: str | Sequence[Message]) -> list[int]:
    """Token ids of a prompt through the tokenizer's chat template: ``text`` is the user's
    message, or the whole list of chat messages."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def response_ids(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """A generated response without its EOS tokens (what a reward function reads)."""
    return [t for t in ids if t != tokenizer.eos_id]


def render_chat_template(
    template: str, messages: Sequence[Message], add_generation_prompt: bool, **extra: Any
) -> str:
    """Render a HF-style Jinja chat template in a sandbox (as transformers does)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent)
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **extra
        )
    except TemplateError as e:
        raise TokenizerError(f"chat template failed: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from None


def _token_text(value: Any) -> str | None:
    """Special tokens are strings or ``{"content": ...}`` dicts in tokenizer_config.json."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_tokenizer(kind: str, path: str | Path | None = None) -> Tokenizer:
    """``"char"`` -> :class:`CharTokenizer`; ``"hf"`` -> :class:`HFTokenizer` from ``path``."""
    if kind == "char":
        return CharTokenizer()
    if kind == "hf":
        if path is None:
            raise TokenizerError("data.tokenizer is 'hf' but no model.hf_path is set")
        return HFTokenizer(path)
    raise TokenizerError(f"unknown tokenizer kind {kind!r} (expected 'char' or 'hf')")
