"""The environment protocol: Gym-style episodes over text.

An environment is a class; one instance plays one episode at a time::

    reset(seed, task)  -> (observation, info)
    step(action_text)  -> (observation, reward, terminated, truncated, info)

``seed`` is an int and ``task`` a JSON-able dict (a built-in takes ``{"index": i}``); the episode
must be a pure function of them and of the actions if it is to be rebuilt after a worker is
stopped (see :mod:`dora_jax.envs.pool`). An observation is plain text (a user message) or a list
of chat messages ``{"role", "content"}``. ``reward`` is a finite number; ``terminated`` (the task
ended) and ``truncated`` (the environment cut it short) are bools; ``info`` is a dict of JSON
values. A class may set ``stop_strings``: texts that end a model turn (``("</call>",)``) besides
the tokenizer's EOS. ``reset`` and ``step`` may be coroutine functions.

:func:`check_reset` and :func:`check_step` turn a returned value into plain data or raise
:class:`InvalidEnvReturn`, so junk is caught where it is returned.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dora_jax.user_code import finite_real

Message = dict[str, str]
ERROR_KINDS = ("timeout", "exception", "invalid", "crash")
Observation = str | list[Message]


@runtime_checkable
class Environment(Protocol):
    """What a user's environment class provides (``stop_strings`` is optional)."""

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[Observation, dict[str, Any]]: ...

    def step(self, action_text: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]: ...


class InvalidEnvReturn(ValueError):
    """``reset`` or ``step`` returned something outside the protocol (the message says what)."""


@dataclass(frozen=True)
class Step:
    """One checked ``step`` result (``reset`` gives reward 0 and both flags false)."""

    observation: Observation
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EnvOutcome:
    """One call's answer: ``step`` (None on an error), ``error`` (one of :data:`ERROR_KINDS` or
    None), ``message``, and ``seconds`` the call took."""

    step: Step | None
    error: str | None = None
    message: str = ""
    seconds: float = 0.0


def stop_strings(env: Any) -> tuple[str, ...]:
    """The environment's ``stop_strings`` (none by default), checked to be non-empty strings."""
    value = getattr(env, "stop_strings", ())
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(s, str) and s for s in value):
        raise InvalidEnvReturn(
            f"stop_strings must be a sequence of non-empty strings, got {value!r:.80}"
        )
    return tuple(value)


def task_index(task: dict[str, Any]) -> int:
    """The integer ``task["index"]`` of a task (what the built-ins and the adapters take)."""
    index = task.get("index")
    if not isinstance(index, int):
        raise ValueError(f"task must have an integer 'index', got {task!r:.60}")
    return index


def as_messages(observation: Observation) -> list[Message]:
    """An observation as chat messages: plain text is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def check_observation(value: Any) -> Observation:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        out = []
        for i, m in enumerate(value):
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise InvalidEnvReturn(
                    f"observation message {i} is {m!r:.80}, not a dict with "
                    "string 'role' and 'content'"
                )
            out.append({"role": m["role"], "content": m["content"]})
        return out
    raise InvalidEnvReturn(
        f"observation is a {type(value).__name__} ({value!r:.60}), not text "
        "or a list of chat messages"
    )


def check_info(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidEnvReturn(f"info is a {type(value).__name__}, not a dict")
    info = {str(k): v for k, v in value.items()}
    try:
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidEnvReturn(f"info is not plain JSON data: {e}") from None
    return info


def check_reset(value: Any) -> Step:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise InvalidEnvReturn(f"reset returned {_shape(value)}, not (observation, info)")
    return Step(check_observation(value[0]), info=check_info(value[1]))


def check_step(value: Any) -> Step:
    if not (isinstance(value, tuple | list) and len(value) == 5):
        raise InvalidEnvReturn(
            f"step returned {_shape(value)}, not (observation, reward, terminated, truncated, info)"
        )
    obs, reward, terminated, truncated, info = value
    r = finite_real(reward)
    if r is None:
        raise InvalidEnvReturn(f"step returned reward {reward!r:.60}, not a finite number")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | np.bool_):
            raise InvalidEnvReturn(f"step returned {name}={flag!r:.60}, not a bool")
    return Step(check_observation(obs), r, bool(terminated), bool(truncated), check_info(info))


def _shape(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {len(value)}-item {type(value).__name__}"
    return f"a {type(value).__name__} ({value!r:.40})"
