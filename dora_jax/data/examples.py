"""Dataset rows -> :class:`Example`: the prompt (a string or chat messages), the reference answer
and the row's other fields, found by dotted field paths (veRL's ``reward_model.ground_truth``).

Every error names the file, the row and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dora_jax.data.files import DataError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One prompt of a dataset. ``prompt`` is a string or chat messages (dicts with ``role`` and
    ``content``); ``metadata`` holds the row's fields other than the prompt (plain JSON values),
    for reward functions; ``row`` is where the row is in its file (the line of a JSONL row, the
    1-based row index otherwise; 0: not from a file), for messages."""

    prompt: str | tuple[dict[str, str], ...]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    row: int = field(default=0, compare=False)


def get_path(row: Mapping[str, Any], path: str) -> Any:
    """``row["a"]["b"]`` for ``path="a.b"``; KeyError naming the missing part."""
    value: Any = row
    for i, part in enumerate(path.split(".")):
        if not isinstance(value, Mapping) or part not in value:
            where = ".".join(path.split(".")[:i]) or "the row"
            has = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise KeyError(f"missing field {path!r} ({where} has: {has})")
        value = value[part]
    return value


def plain(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (numpy scalars and arrays from Parquet become numbers and
    lists), so it can go to a reward worker process."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, Sequence | set | frozenset) and not isinstance(value, bytes | bytearray):
        return [plain(v, where) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return plain(value.tolist(), where)
    if hasattr(value, "isoformat"):  # dates and times
        return value.isoformat()
    raise DataError(
        f"{where}: a {type(value).__name__} value cannot be passed to a reward "
        "function (use strings, numbers, lists and mappings)"
    )


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    msgs = plain(value, where)
    if not msgs:
        raise DataError(f"{where}: the message list is empty")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}[{i}]: a chat message must be a mapping with a string "
                f"'content', got {m!r:.80}"
            )
        if m.get("role") not in ROLES:
            raise DataError(
                f"{where}[{i}]: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def to_example(
    row: Any, prompt_field: str, answer_field: str, where: str, number: int = 0
) -> Example:
    """One row -> :class:`Example`; ``where`` (``file:row``) starts every error message and
    ``number`` (the line or row) is the example's ``row``."""
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a mapping, got {type(row).__name__}")
    try:
        prompt, answer = get_path(row, prompt_field), get_path(row, answer_field)
    except KeyError as e:
        raise DataError(f"{where}: {e.args[0]}") from None
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: field {prompt_field!r} is an empty string")
    elif isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        prompt = _messages(prompt, f"{where}: field {prompt_field!r}")
    else:
        raise DataError(
            f"{where}: field {prompt_field!r} must be a string or a list of chat "
            f"messages, got {type(prompt).__name__}"
        )
    if hasattr(answer, "item") and not hasattr(answer, "__len__"):
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DataError(
            f"{where}: field {answer_field!r} must be a string or a number, "
            f"got {type(answer).__name__}"
        )
    top = prompt_field.split(".")[0]
    metadata = {str(k): plain(v, f"{where}: field {k!r}") for k, v in row.items() if k != top}
    return Example(prompt, str(answer), metadata, number)


def to_examples(
    rows: Sequence[tuple[int, Any]], prompt_field: str, answer_field: str, name: str
) -> list[Example]:
    """Every ``(line or row number, row)`` of a file (``name``, for messages)."""
    out = [to_example(r, prompt_field, answer_field, f"{name}:{n}", n) for n, r in rows]
    if not out:
        raise DataError(f"{name}: holds no rows")
    return out


def chat_messages(
    prompt: str | Sequence[Mapping[str, str]],
    system_prompt: str | None = None,
    template: str = "{prompt}",
) -> list[dict[str, str]]:
    """The chat messages of a prompt: a string becomes one user message (``template`` with
    ``{prompt}`` replaced by it); ``system_prompt`` goes first unless a system message already
    does."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": template.replace("{prompt}", prompt)}]
    else:
        messages = [dict(m) for m in prompt]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
