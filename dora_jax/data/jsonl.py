"""Prompts with answers from a JSONL file, as ``(prompt, answer)`` string pairs (the
built-in-style reader; :mod:`dora_jax.data.files` and :mod:`dora_jax.data.examples` read every
format, chat messages and nested fields)."""

from __future__ import annotations

from pathlib import Path

from dora_jax.data.examples import to_examples
from dora_jax.data.files import DataError, read_rows

__all__ = ["DataError", "load_jsonl_prompts"]


def load_jsonl_prompts(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]``; every bad line fails with ``file:line: reason``."""
    examples = to_examples(read_rows("jsonl", path), prompt_field, answer_field, str(path))
    out = []
    for ex in examples:
        if not isinstance(ex.prompt, str):
            raise DataError(f"{path}: field {prompt_field!r} must be a string here")
        out.append((ex.prompt, ex.answer))
    return out
