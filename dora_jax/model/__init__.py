"""Qwen2/Llama-family decoder as pure functions over a params pytree, plus HF import/export."""

from dora_jax.model.params import (
    Params,
    abstract_params,
    count_params,
    init_params,
    param_axes,
    param_specs,
)
from dora_jax.model.transformer import (
    default_positions,
    forward,
    hidden_states,
    logits_from_hidden,
    unembed_matrix,
)

__all__ = [
    "Params",
    "abstract_params",
    "count_params",
    "default_positions",
    "forward",
    "hidden_states",
    "init_params",
    "logits_from_hidden",
    "param_axes",
    "param_specs",
    "unembed_matrix",
]
