"""The ``boxed_math`` reward on a maintained verifier: Hugging Face's ``math-verify`` (LaTeX
extraction, then symbolic equivalence with sympy) when it is installed, our own small normaliser
(numbers, fractions, ``\\text{}``) only where it is not.

The last ``\\boxed{...}`` of the response is compared with the reference (its own last
``\\boxed{}`` when it has one). Both are parsed as LaTeX math; when math-verify cannot parse a
side (plain words), the two are compared by the normaliser. math-verify's own timeouts use
``SIGALRM``, which works only on a process's main thread, so they are off here: a call runs in a
reward worker process, under ``data.reward_timeout_s``.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import cache

from dora_jax.data.rewards import last_boxed, normalised_equal

# imported on first use (sympy takes a second to import); the 'math' extra installs it
MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
FALLBACK_NOTE = (
    "math-verify is not installed: boxed_math compares answers with dora_jax's own normaliser "
    "(numbers, fractions, \\text{}); pip install 'dora-jax[math]' for symbolic equivalence"
)


def equivalent(got: str, want: str) -> bool:
    """Whether the LaTeX answer ``got`` equals the reference ``want`` (see the module doc)."""
    if MATH_VERIFY:
        parse, verify = _math_verify()
        gold = parse(f"${want}$", parsing_timeout=None)
        pred = parse(f"${got}$", parsing_timeout=None)
        if gold and pred:
            return bool(verify(gold, pred, timeout_seconds=None))
    return normalised_equal(got, want)


@cache
def _math_verify():
    from math_verify import parse, verify

    # it warns on every call that its own timeout is off: ours bounds the call instead
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


def boxed_math_reward(response: str, answer: str) -> float:
    """1 when the last ``\\boxed{}`` of ``response`` is equivalent to ``answer``, else 0."""
    got = last_boxed(response)
    if got is None:
        return 0.0
    want = last_boxed(answer) or answer
    return 1.0 if equivalent(got, want) else 0.0
