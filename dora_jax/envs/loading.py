"""Environment classes by name: a built-in, or yours as ``path/to/file.py:ClassName`` or
``package.module:ClassName`` (``env:`` in a config, with keyword arguments for the constructor).

Every failure is one :class:`EnvSpecError` line naming the file and the class: a missing file, a
file that fails to import, a missing name, a name that is not a class, a class without ``reset``
or ``step``, or a constructor that raises on the keyword arguments given.
"""

from __future__ import annotations

from typing import Any

from dora_jax.envs.protocol import InvalidEnvReturn, stop_strings
from dora_jax.user_code import load_named, one_line
from dora_jax.user_code import resolve_spec as resolve_spec

# built-in name -> module:Class (the two adapters need the ``envs`` extra)
BUILT_IN = {
    "tool_arithmetic": "dora_jax.envs.builtin.calculator:ToolArithmetic",
    "guess_numbers": "dora_jax.envs.builtin.guess:GuessNumbers",
    "reasoning_gym": "dora_jax.envs.adapters:ReasoningGymEnv",
    "gem": "dora_jax.envs.adapters:GemEnv",
}


class EnvSpecError(ValueError):
    """``env`` names no usable environment class (the one-line message says why)."""


def load_environment_class(spec: str) -> type:
    """The class ``spec`` names, checked to have callable ``reset`` and ``step``."""
    spec = BUILT_IN.get(spec, spec)
    forms = (
        f"a built-in ({', '.join(BUILT_IN)}), 'path/to/file.py:ClassName' or "
        "'package.module:ClassName'"
    )
    cls = load_named(spec, "env", forms, "dora_jax_user_env", EnvSpecError, noun="class")
    if not isinstance(cls, type):
        raise EnvSpecError(f"env: {spec} is a {type(cls).__name__}, not a class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise EnvSpecError(f"env: {spec} has no {method}() method")
    return cls


def make_environment(cls: type, kwargs: dict[str, Any] | None, where: str) -> Any:
    """``cls(**kwargs)``; a constructor that raises, or bad ``stop_strings``, is an
    :class:`EnvSpecError` naming ``where`` (the spec)."""
    try:
        env = cls(**(kwargs or {}))
    except Exception as e:  # a user's constructor may raise anything
        raise EnvSpecError(f"env: {where}({_kwargs_text(kwargs)}) raised {one_line(e)}") from None
    try:
        stop_strings(env)
    except InvalidEnvReturn as e:
        raise EnvSpecError(f"env: {where}: {e}") from None
    return env


def load_environment(spec: str, kwargs: dict[str, Any] | None = None) -> Any:
    """An instance of the environment ``spec`` names, built with ``kwargs``."""
    return make_environment(load_environment_class(spec), kwargs, BUILT_IN.get(spec, spec))


def _kwargs_text(kwargs: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in (kwargs or {}).items())
