"""Reward functions ``(response, answer) -> float`` and a guard that never lets one crash a run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]
log = logging.getLogger(__name__)


def exact_reward(response: str, answer: str) -> float:
    """1 when the response, stripped, equals the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


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


def boxed_math_reward(response: str, answer: str) -> float:
    """1 when the last ``\\boxed{}`` of the response equals the answer, numerically when both
    parse as numbers or fractions (``0.5 == \\frac{1}{2}``), else as normalised strings."""
    got = last_boxed(response)
    if got is None:
        return 0.0
    want = last_boxed(answer) or answer
    return 1.0 if _normalise(got) == _normalise(want) else 0.0


class SafeReward:
    """Wraps a reward function: an exception or a non-finite value gives reward 0, is logged and
    counted in ``errors`` (the run goes on)."""

    def __init__(self, fn: RewardFn):
        self.fn = fn
        self.errors = 0

    def __call__(self, response: str, answer: str) -> float:
        try:
            value = float(self.fn(response, answer))
        except Exception as e:  # a user reward function may raise anything: count and go on
            self.errors += 1
            log.warning("reward function raised %s: %s (reward 0)", type(e).__name__, e)
            return 0.0
        if value != value or value in (float("inf"), float("-inf")):
            self.errors += 1
            log.warning("reward function returned %r (reward 0)", value)
            return 0.0
        return value


def safe_reward(fn: RewardFn) -> SafeReward:
    return SafeReward(fn)
