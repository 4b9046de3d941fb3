"""Environments for multi-turn episodes: the protocol, loading a class by name or from a file,
a worker pool with a per-call timeout, and token-exact conversations (see docs/agentic.md).

Dependency rule: this package imports only ``dora_jax.config``, ``dora_jax.model.tokenizer``,
numpy and the standard library (the adapters also their optional libraries). The token side,
:mod:`dora_jax.envs.rendering` and :mod:`dora_jax.envs.conversation`, is imported from its own
modules: the worker processes import this package and need no tokenizer (nor jax).
"""

from dora_jax.envs.loading import BUILT_IN, EnvSpecError, load_environment, resolve_spec
from dora_jax.envs.pool import EnvPool, EnvPoolError
from dora_jax.envs.protocol import (
    ERROR_KINDS,
    Environment,
    EnvOutcome,
    InvalidEnvReturn,
    Step,
    check_reset,
    check_step,
    stop_strings,
)

__all__ = [
    "BUILT_IN",
    "ERROR_KINDS",
    "EnvOutcome",
    "EnvPool",
    "EnvPoolError",
    "EnvSpecError",
    "Environment",
    "InvalidEnvReturn",
    "Step",
    "check_reset",
    "check_step",
    "load_environment",
    "resolve_spec",
    "stop_strings",
]
