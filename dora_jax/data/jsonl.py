"""Prompts with answers from a JSONL file, as ``(prompt, answer)`` string pairs (the
built-in-style reader; :mod:`dora_jax.data.files` and :mod:`dora_jax.data.examples` read every
format, chat messages and nested fields)."""

from __future__ import annotations

from pathlib import Path

from dora_jax.data.examples import to_examples
from dora_jax.data.files import DataError, read_rows

__all__ = ["DataError", "load_jsonl_prompts"]


def load_jsonl_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    *,
    setting: str = "data.path",
) -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]``; every bad line fails with ``file:line: reason`` (``setting``
    names the config field that points at the file, for a missing one)."""
    rows = read_rows("jsonl", path, setting=setting)
    out = []
    for ex in to_examples(rows, prompt_field, answer_field, str(path)):
        if not isinstance(ex.prompt, str):
            raise DataError(f"{path}:{ex.row}: field {prompt_field!r} must be a string here")
        out.append((ex.prompt, ex.answer))
    return out
