"""Prompts with answers from a JSONL file: one JSON object per line."""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """A data file is missing or a line lacks a needed field; the message names the line."""


def load_jsonl_rows(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    *,
    setting: str = "data.path",
) -> list[tuple[int, str, str]]:
    """``[(line number, prompt, answer), ...]``; every bad line fails with ``file:line: reason``
    (``setting`` names the config field that points at the file, for a missing one)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file ({setting})")
    out: list[tuple[int, str, str]] = []
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
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
            out.append((n, prompt, str(answer)))
    if not out:
        raise DataError(f"{p}: holds no prompts ({setting})")
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
