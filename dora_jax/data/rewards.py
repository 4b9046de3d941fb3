"""Built-in reward functions ``(response, answer) -> float``: exact match, the final number of
a response, and the pieces of the boxed-math reward (:mod:`dora_jax.data.math_answers`) that do
not need math-verify."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

RewardFn = Callable[[str, str], float]


def exact_reward(response: str, answer: str) -> float:
    """1 when the response, stripped, equals the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number written in ``text`` (``-3``, ``1,024``, ``2.5``), commas dropped."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_number_reward(response: str, answer: str, metadata: dict[str, Any]) -> dict[str, float]:
    """``data.reward: final_number``: 1 when the last number of the response equals the answer
    (numerically: ``12.0`` is ``12``) and the response ended on its own (an EOS, not the token
    limit), else 0. Its metrics: ``correct`` (the number is right, ended or not) and ``ended``."""
    got = final_number(response)
    correct = got is not None and _normalise(got) == _normalise(answer)
    ended = metadata.get("finish_reason", "eos") == "eos"
    return {"score": float(correct and ended), "correct": float(correct), "ended": float(ended)}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _normalise(s: str) -> str | Fraction:
    s = s.strip().strip("$").replace(" ", "").replace("\\!", "").rstrip(".")
    for prefix in ("\\text{", "\\mathrm{"):
        if s.startswith(prefix) and s.endswith("}"):
            s = s[len(prefix) : -1]
    if s.startswith("\\frac{") or s.startswith("\\dfrac{"):
        body = s.split("{", 1)[1]
        num, _, rest = body.partition("}{")
        if rest.endswith("}"):
            s = f"{num}/{rest[:-1]}"
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return s


def normalised_equal(got: str, want: str) -> bool:
    """Our own comparison, used where math-verify is missing: numerically when both parse as
    numbers or fractions (``0.5 == \\frac{1}{2}``), else as normalised strings."""
    return _normalise(got) == _normalise(want)
