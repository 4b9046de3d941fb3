"""The decoder's parameter pytree: one declarative table of shapes, logical axes and initialisers.

Layout (axis letters: V vocab, D model, N q heads, K kv heads, H head dim, F ffn, L layers)::

    embed            [V, D]
    layers/attn_norm [L, D]        layers/mlp_norm [L, D]
    layers/wq        [L, D, N, H]  layers/bq [L, N, H]   (biases only when cfg.qkv_bias)
    layers/wk        [L, D, K, H]  layers/bk [L, K, H]
    layers/wv        [L, D, K, H]  layers/bv [L, K, H]
    layers/wo        [L, N, H, D]
    layers/q_norm    [L, H]        layers/k_norm [L, H]  (per-head q/k RMSNorm, when cfg.qk_norm)
    layers/w_gate    [L, D, F]     layers/w_up [L, D, F]   layers/w_down [L, F, D]
    final_norm       [D]
    lm_head          [D, V]        (absent when cfg.tie_word_embeddings)

A mixture of experts
(``cfg.is_moe``; E experts, f each expert's ffn, S the shared expert's) has, instead of
``w_gate / w_up / w_down`` (see :mod:`dora_jax.model.moe`)::

    layers/router      [L, D, E]
    layers/moe_gate    [L, E, D, f]  layers/moe_up [L, E, D, f]  layers/moe_down [L, E, f, D]
    layers/shared_gate [L, D, S]     layers/shared_up [L, D, S]  layers/shared_down [L, S, D]
    layers/shared_expert_gate [L, D]   (the shared expert's four: only when S > 0)

Layer parameters are stacked on a leading ``L`` axis and scanned over (compile time stays flat
with depth). Every leaf has a tuple of logical axis names; :mod:`dora_jax.sharding` maps those to
mesh axes per role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig

Params = dict[str, Any]

INIT_STD = 0.02


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Literal["normal", "zeros", "ones"]


def dtype_of(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def param_specs(cfg: ModelConfig) -> Params:
    """Nested dict of :class:`ParamSpec`, the single source of truth for shapes and axes."""
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    layers = {
        "attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "wq": ParamSpec((L, D, N, H), ("layers", "embed", "q_heads", "head_dim"), "normal"),
        "wk": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "wv": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "wo": ParamSpec((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
    }
    if cfg.qkv_bias:
        layers["bq"] = ParamSpec((L, N, H), ("layers", "q_heads", "head_dim"), "zeros")
        layers["bk"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["bv"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm:
        layers["q_norm"] = ParamSpec((L, H), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((L, H), ("layers", "head_dim"), "ones")
    if cfg.mlp_bias:
        raise NotImplementedError("model.mlp_bias=true is not supported yet")
    if cfg.is_moe:
        for name in ("w_gate", "w_up", "w_down"):
            del layers[name]
        layers.update(_moe_layer_specs(cfg))
    specs: Params = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("norm",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return specs


def _moe_layer_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """A mixture of experts' layer parameters (stacked on ``L``, used by
    :mod:`dora_jax.model.moe`); they replace ``w_gate / w_up / w_down``."""
    L, D, E = cfg.num_layers, cfg.hidden_size, cfg.num_experts
    f, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    specs = {
        "router": ParamSpec((L, D, E), ("layers", "embed", None), "normal"),
        "moe_gate": ParamSpec((L, E, D, f), ("layers", "experts", "embed", "mlp"), "normal"),
        "moe_up": ParamSpec((L, E, D, f), ("layers", "experts", "embed", "mlp"), "normal"),
        "moe_down": ParamSpec((L, E, f, D), ("layers", "experts", "mlp", "embed"), "normal"),
    }
    if S > 0:
        specs.update(
            shared_gate=ParamSpec((L, D, S), ("layers", "embed", "mlp"), "normal"),
            shared_up=ParamSpec((L, D, S), ("layers", "embed", "mlp"), "normal"),
            shared_down=ParamSpec((L, S, D), ("layers", "mlp", "embed"), "normal"),
            shared_expert_gate=ParamSpec((L, D), ("layers", "embed"), "normal"),
        )
    return specs


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def param_axes(cfg: ModelConfig) -> Params:
    """The params tree with each leaf replaced by its tuple of logical axis names."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def abstract_params(cfg: ModelConfig) -> Params:
    """``jax.ShapeDtypeStruct`` leaves: shapes and dtypes without allocating anything."""
    dtype = dtype_of(cfg.param_dtype)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg), is_leaf=_is_spec
    )


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random params (normal(0, 0.02) matrices, zero biases, unit norms). Jit it with
    ``out_shardings`` to create them directly in their target sharding."""
    dtype = dtype_of(cfg.param_dtype)
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec: ParamSpec, k: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (INIT_STD * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys, strict=True)])


def count_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec))
