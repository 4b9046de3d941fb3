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
    """``eos_id`` is the EOS a demonstration ends with; a tokenizer may also have ``eos_ids``,
    every id that ends a response (``eos_id`` first; see :func:`eos_ids`)."""

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
        self.eos_ids = (self.eos_id,)

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
    special tokens and the Jinja chat template when present (``chat_template.jinja`` first, as
    ``transformers`` 5 saves it; see :func:`read_chat_template`). ``encode`` never adds special
    tokens: a BOS the model needs comes from the template (``{{ bos_token }}``), as with
    ``transformers``' ``apply_chat_template``.

    ``eos_ids``: the ``eos_token`` and every ``eos_token_id`` of the model's
    ``generation_config.json`` (Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``);
    ids outside the vocabulary are refused. ``vocab_size`` counts added tokens; a model's
    vocabulary is often larger (padding rows), and ids past the tokenizer's decode to nothing
    (see :func:`undecodable`)."""

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
        self.chat_template, self.chat_template_source = read_chat_template(path, self.config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_id = self._require_id(self.eos_token, "eos_token", tok_file)
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        pad = _token_text(self.config.get("pad_token"))
        self.pad_id = self._tok.token_to_id(pad) if pad else self.eos_id
        self.eos_ids = self._eos_ids(path / "generation_config.json")

    def _eos_ids(self, gen_path: Path) -> tuple[int, ...]:
        gen = _read_json(gen_path).get("eos_token_id")
        extra = [] if gen is None else [gen] if isinstance(gen, int) else list(gen)
        ids = [self.eos_id]
        for i in extra:
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise TokenizerError(
                    f"{gen_path}: eos_token_id {i!r} is not a token id of "
                    f"tokenizer.json (vocabulary {self.vocab_size})"
                )
            if i not in ids:
                ids.append(i)
        return tuple(ids)

    def _require_id(self, token: str | None, name: str, where: Path) -> int:
        tid = self._tok.token_to_id(token) if token else None
        if tid is None:
            raise TokenizerError(
                f"{where.parent / 'tokenizer_config.json'}: {name} {token!r} "
                "is not a token of tokenizer.json"
            )
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


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def read_chat_template(path: Path, config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The directory's default chat template and the file it came from, or ``(None, None)``.

    ``transformers`` 5 saves the template to ``chat_template.jinja``; older versions put it in
    ``chat_template.json`` (``{"chat_template": ...}``) or ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` whose ``default`` is
    used). The first of those files in that order that holds one wins, as in ``transformers``.
    A template that is present but cannot be read, or is not valid Jinja, raises
    :class:`TokenizerError` naming the file: it is never silently dropped."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            text = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot be read as UTF-8 text ({e})") from None
        return _checked_template(text, jinja), str(jinja)
    for where, data in (
        (path / "chat_template.json", _read_json(path / "chat_template.json")),
        (path / "tokenizer_config.json", config),
    ):
        if data.get("chat_template") is not None:
            text = _default_template(data["chat_template"], where)
            return _checked_template(text, where), str(where)
    return None, None


def _default_template(value: Any, where: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerError(
            f"{where}: chat_template is a list of named templates without a 'default' one "
            f"(names: {sorted(str(n) for n in named)})"
        )
    raise TokenizerError(
        f"{where}: chat_template must be a string or a list of named templates, "
        f"got {type(value).__name__}"
    )


def _checked_template(text: str, where: Path) -> str:
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not text.strip():
        raise TokenizerError(f"{where}: the chat template is empty")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: the chat template is not valid Jinja ({e})") from None
    return text


def encode_prompt(tokenizer: Tokenizer, text: str | Sequence[Message]) -> list[int]:
    """Token ids of a prompt through the tokenizer's chat template: ``text`` is the user's
    message, or the whole list of chat messages."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def eos_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's ``eos_ids``, or its one ``eos_id``."""
    return tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))


def response_ids(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """A generated response without its EOS tokens (what a reward function reads)."""
    stop = set(eos_ids(tokenizer))
    return [t for t in ids if t not in stop]


def undecodable(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """How many of ``ids`` the tokenizer cannot decode (ids at or past its vocabulary, which a
    model with a larger, padded vocabulary can still sample): they decode to nothing, so callers
    count them instead of dropping them silently."""
    return sum(1 for t in ids if not 0 <= int(t) < tokenizer.vocab_size)


def check_vocabularies(tokenizer: Tokenizer, model_vocab_size: int, what: str) -> str | None:
    """Raise :class:`TokenizerError` when the tokenizer has ids the model cannot embed; return a
    note when the model's vocabulary is larger (its extra ids cannot be decoded), else None."""
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"model.vocab_size is {model_vocab_size} but the {what} tokenizer has "
            f"{tokenizer.vocab_size} tokens: token ids past the model's vocabulary cannot be "
            "embedded (use the model's own tokenizer)"
        )
    bad = [i for i in eos_ids(tokenizer) if not 0 <= i < model_vocab_size]
    if bad:
        raise TokenizerError(
            f"EOS id(s) {bad} are outside the model's vocabulary ({model_vocab_size})"
        )
    if tokenizer.vocab_size < model_vocab_size:
        return (
            f"the model's vocabulary ({model_vocab_size}) is larger than the {what} tokenizer's "
            f"({tokenizer.vocab_size}): {model_vocab_size - tokenizer.vocab_size} ids cannot be "
            "decoded; sampled ones are counted (metric undecodable_tokens)"
        )
    return None


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
