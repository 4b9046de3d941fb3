"""Prompts with answers from a JSONL file: one JSON object per line."""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """A data file is missing or a line lacks a needed field; the message names the line."""


def load_jsonl_prompts(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]``; every bad line fails with ``file:line: reason``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file (data.path)")
    out: list[tuple[str, str]] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
            for field in (prompt_field, answer_field):
                if field not in row:
                    raise DataError(f"{p}:{n}: missing field {field!r} (has: {sorted(row)})")
            prompt, answer = row[prompt_field], row[answer_field]
            if not isinstance(prompt, str) or not prompt:
                raise DataError(f"{p}:{n}: field {prompt_field!r} must be a non-empty string")
            if not isinstance(answer, (str, int, float)):
                raise DataError(f"{p}:{n}: field {answer_field!r} must be a string or number")
            out.append((prompt, str(answer)))
    if not out:
        raise DataError(f"{p}: holds no prompts")
    return out
