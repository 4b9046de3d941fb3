"""Reward functions by name: the built-in ones, or yours as ``path/to/file.py:function`` or
``package.module:function`` (``data.reward``).

A function is called as ``fn(response, answer, metadata)`` (or ``fn(response, answer)`` when it
takes two arguments): the response text, the reference answer and the dataset row's other fields,
plus ``metadata["finish_reason"]``: ``"eos"`` for a response that ended, ``"length"`` for one cut
at ``rollout.max_new_tokens``.
It returns a number, or a mapping with a numeric ``score`` and further numeric metrics (each
logged per step as its mean). A coroutine function is awaited. Anything else is junk:
:func:`outcome` raises :class:`InvalidReward` and the response scores 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dora_jax.user_code import finite_real, invoke, load_named
from dora_jax.user_code import resolve_spec as resolve_spec

BUILT_IN = (
    "exact",
    "boxed_math",
    "final_number",
)  # partial_credit and exact of the built-in task: see arithmetic


class RewardSpecError(ValueError):
    """``data.reward`` names no usable function (the message says why)."""


class InvalidReward(ValueError):
    """A reward function returned something that is neither a finite number nor a mapping with
    a finite numeric ``score`` and numeric metrics."""


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names; :class:`RewardSpecError` naming ``data.reward`` otherwise."""
    if spec in BUILT_IN:
        from dora_jax.data.math_answers import boxed_math_reward
        from dora_jax.data.rewards import exact_reward, final_number_reward

        built_in = {"final_number": final_number_reward}
        return {"exact": exact_reward, "boxed_math": boxed_math_reward, **built_in}[spec]
    forms = "'file.py:function' or 'package.module:function'"
    fn = load_named(spec, "data.reward", forms, "dora_jax_user_reward", RewardSpecError)
    if not callable(fn):
        raise RewardSpecError(f"data.reward: {spec} is not callable")
    arity(fn)
    return fn


def arity(fn: Callable[..., Any]) -> int:
    """3 (response, answer, metadata) or 2 (response, answer) positional arguments."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 3
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(positional) >= 3:
        return 3
    if len(positional) == 2:
        return 2
    raise RewardSpecError(
        f"data.reward: {getattr(fn, '__name__', fn)} must take (response, "
        f"answer, metadata) or (response, answer), takes {len(positional)} "
        "positional arguments"
    )


def call(fn: Callable[..., Any], n_args: int, response: str, answer: str, metadata: dict) -> Any:
    """``fn``'s result for one response; a coroutine is run to its end."""
    return invoke(fn, response, answer, metadata) if n_args == 3 else invoke(fn, response, answer)


def outcome(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, metrics)`` of a returned value, or :class:`InvalidReward`."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise InvalidReward(f"returned a mapping without 'score' (keys: {sorted(value)})")
        score = finite_real(value["score"])
        if score is None:
            raise InvalidReward(f"returned score {value['score']!r:.60}, not a finite number")
        metrics = {}
        for k, v in value.items():
            if k == "score":
                continue
            f = finite_real(v)
            if f is None:
                raise InvalidReward(f"returned metric {k!r} = {v!r:.60}, not a finite number")
            metrics[str(k)] = f
        return score, metrics
    score = finite_real(value)
    if score is None:
        raise InvalidReward(
            f"returned a {type(value).__name__} ({value!r:.60}), not a finite "
            "number or a mapping with a 'score'"
        )
    return score, {}
