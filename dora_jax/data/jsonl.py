"""Prompts with answers from a JSONL file, as ``(prompt, answer)`` string pairs (the
built-in-style reader; :mod:`dora_jax.data.files` and :mod:`dora_jax.data.examples` read every
format, chat messages and nested fields)."""

from __future__ import annotations

from pathlib import Path

from dora_jax.data.examples import to_examples
from dora_jax.data.files import DataError, read_rows

__all__ = ["DataError", "load_jsonl_prompts", "load_jsonl_rows"]


def load_jsonl_rows(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    *,
    setting: str = "data.path",
) -> list[tuple[int, str, str]]:
    """``[(line number, prompt, answer), ...]``; every bad line fails with ``file:line: reason``
    (``setting`` names the config field that points at the file, for a missing one)."""
    rows = read_rows("jsonl", path, setting=setting)
    examples = to_examples(rows, prompt_field, answer_field, str(path))
    out = []
    for ex in examples:
        if not isinstance(ex.prompt, str):
            raise DataError(f"{path}:{ex.row}: field {prompt_field!r} must be a string here")
        out.append((ex.row, ex.prompt, ex.answer))
    return out


def load_jsonl_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    *,
    setting: str = "data.path",
) -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]``: :func:`load_jsonl_rows` without the line numbers."""
    rows = load_jsonl_rows(path, prompt_field, answer_field, setting=setting)
    return [(prompt, answer) for _, prompt, answer in rows]
