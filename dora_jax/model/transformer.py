"""The Qwen2/Llama decoder forward pass: embed, scanned layers (configurable remat), norm, logits.

Inputs use one convention everywhere: ``tokens int32[B, T]``, ``positions int32[B, T]`` (RoPE
positions), ``segment_ids int32[B, T]`` (0 marks padding; tokens attend causally within their own
segment, which also lets several sequences be packed in one row).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.model.attention import make_attend
from dora_jax.model.layers import decoder_layer, rms_norm
from dora_jax.model.params import Params, dtype_of
from dora_jax.sharding import constrain

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def cast_params(params: Params, cfg: ModelConfig) -> Params:
    """Params in the compute dtype (a no-op when param and compute dtypes agree)."""
    dtype = dtype_of(cfg.compute_dtype)
    return jax.tree.map(lambda w: w.astype(dtype), params)


def embed_tokens(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = jnp.take(params["embed"], tokens, axis=0).astype(dtype_of(cfg.compute_dtype))
    return constrain(x, ("batch", "seq", "embed"))


def unembed_matrix(params: Params, cfg: ModelConfig) -> jax.Array:
    """``[D, V]`` output projection (the transposed embedding when tied)."""
    if cfg.tie_word_embeddings:
        return params["embed"].T
    return params["lm_head"]


def hidden_states(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
) -> jax.Array:
    """Final-normed hidden states ``[B, T, D]`` in the compute dtype."""
    p = cast_params(params, cfg)
    x = embed_tokens(p, tokens, cfg)
    attend = make_attend(cfg, segment_ids)

    def layer(x, lp):
        x, _ = decoder_layer(lp, x, positions, cfg, attend)
        return x, None

    if cfg.remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat])
    x, _ = jax.lax.scan(layer, x, p["layers"])
    return rms_norm(x, p["final_norm"], cfg.rms_norm_eps)


def logits_from_hidden(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``[..., V]`` float32 logits from hidden states ``[..., D]``."""
    w = unembed_matrix(params, cfg).astype(h.dtype)
    return jnp.einsum("...D,DV->...V", h, w, preferred_element_type=jnp.float32)


@partial(jax.jit, static_argnames=("cfg",))
def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
) -> jax.Array:
    """Float32 logits ``[B, T, V]`` (materialises the full vocabulary: for small models and
    tests; the trainer computes log-probabilities in vocabulary chunks instead)."""
    h = hidden_states(params, tokens, positions, segment_ids, cfg)
    return constrain(logits_from_hidden(params, h, cfg), ("batch", "seq", "vocab"))


def default_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions counting from 0 within each segment (padding gets 0)."""
    B, T = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))
    starts = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return jnp.where(segment_ids != 0, idx - start_idx, 0).astype(jnp.int32)
