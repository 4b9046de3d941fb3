"""The Qwen2/Qwen3/Llama/Mistral decoder forward pass: embed, scanned layers (configurable
remat), norm, logits.

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
from dora_jax.model.dense import dense
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


def cast_all_but_layers(params: Params, cfg: ModelConfig) -> Params:
    """``params`` with everything but the stacked ``layers`` in the compute dtype; the layer
    scans cast one layer's weights at a time (:func:`hidden_states`)."""
    return {k: v if k == "layers" else cast_params(v, cfg) for k, v in params.items()}


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
    routes: jax.Array | None = None,
    return_routes: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Final-normed hidden states ``[B, T, D]`` in the compute dtype.

    Mixture of experts only: ``routes int32[B, T, L, k]`` forces each token's experts per layer
    (rows with a ``-1``: the router's choice), and ``return_routes=True`` returns
    ``(hidden, chosen int32[B, T, L, k])``, the experts used (see :mod:`dora_jax.model.moe`)."""
    if (routes is not None or return_routes) and not cfg.is_moe:
        raise ValueError(f"routes are for mixture-of-experts models; family {cfg.family} is dense")
    # The layers' stacked weights are cast to the compute dtype one layer at a time, inside the
    # scan: XLA's CPU backend widens a scanned 16-bit stack to float32 outside the loop and
    # narrows each layer's slice back inside it (measured: 30 products of 32 x 576 @ 576 x 1536
    # in bfloat16, 44.8 ms over the stack, 8.4 ms over separate arrays), while a float32 stack
    # cast per layer costs one pass over that layer's weights.
    p = cast_all_but_layers(params, cfg)
    x = embed_tokens(p, tokens, cfg)
    # Each layer's sliding window (0: none) and, with forced MoE routes, its routes [L, B, T, k]
    # are scanned with its params.
    windows = jnp.asarray(cfg.layer_windows(), jnp.int32)
    r_layers = None if routes is None else jnp.moveaxis(routes.astype(jnp.int32), 2, 0)

    def apply(x, lp, r, positions, segment_ids, window):
        lp = cast_params(lp, cfg)
        out = decoder_layer(lp, x, positions, cfg, make_attend(cfg, segment_ids, window), r)
        return (out[0], out[2]) if cfg.is_moe else (out[0], None)

    if cfg.remat == "nested":
        apply = _full_remat(apply)
    elif cfg.remat != "none":
        apply = jax.checkpoint(apply, policy=REMAT_POLICIES[cfg.remat])

    def layers(x, lps, rs, positions, segment_ids, windows):
        def layer(x, lp_r_w):
            lp, r, window = lp_r_w
            return apply(x, lp, r, positions, segment_ids, window)

        return jax.lax.scan(layer, x, (lps, rs, windows))

    if cfg.remat == "nested":
        g = remat_group_size(cfg.num_layers)

        def grouped(w):
            return w.reshape(-1, g, *w.shape[1:])

        group = _full_remat(layers)

        def one_group(x, lps_rs_ws):
            lps, rs, ws = lps_rs_ws
            return group(x, lps, rs, positions, segment_ids, ws)

        xs = jax.tree.map(grouped, (p["layers"], r_layers, windows))
        x, chosen = jax.lax.scan(one_group, x, xs)
        chosen = None if chosen is None else chosen.reshape(-1, *chosen.shape[2:])
    else:
        x, chosen = layers(x, p["layers"], r_layers, positions, segment_ids, windows)
    h = rms_norm(x, p["final_norm"], cfg.rms_norm_eps)
    if return_routes:
        return h, jnp.moveaxis(chosen, 0, 2)  # [L, B, T, k] -> [B, T, L, k]
    return h


def remat_group_size(num_layers: int) -> int:
    """Layers per group of ``remat: nested``: the divisor of ``num_layers`` nearest its square
    root, so ``L / g + g`` layer inputs are kept instead of ``L``."""
    divisors = [g for g in range(1, num_layers + 1) if num_layers % g == 0]
    return min(divisors, key=lambda g: (num_layers // g + g, g))


def _full_remat(apply):
    """``apply(x, lp, routes, positions, segment_ids, window) -> (y, aux)`` whose backward pass
    recomputes it from its input ``x``, the only thing kept between the passes (what
    ``jax.checkpoint`` with ``nothing_saveable`` does, written as a ``custom_vjp``;
    ``remat: nested`` uses it for layers and for groups of layers). ``aux`` (the experts a MoE
    layer used, or None) is integer and has no gradient. A 16-bit ``x`` is kept as its bit
    pattern (uint16): XLA's CPU backend widens a saved bfloat16 stack ``[L, B, T, D]`` to
    float32 around its dynamic slices and hoists that conversion out of the backward loop
    (measured: the saved activations materialised again at twice their size); integers are left
    alone."""

    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x

    @jax.custom_vjp
    def f(x, lp, routes, positions, segment_ids, window):
        return apply(x, lp, routes, positions, segment_ids, window)

    def fwd(x, lp, routes, positions, segment_ids, window):
        y = apply(x, lp, routes, positions, segment_ids, window)
        res = (bits(x), jnp.zeros((0,), x.dtype), lp, routes, positions, segment_ids, window)
        return y, res

    def bwd(res, g):
        xb, like, lp, routes, positions, segment_ids, window = res
        x = jax.lax.bitcast_convert_type(xb, like.dtype) if xb.dtype != like.dtype else xb
        _, vjp = jax.vjp(
            lambda x, lp: apply(x, lp, routes, positions, segment_ids, window)[0], x, lp
        )
        dx, dlp = vjp(g[0])
        return dx, dlp, None, None, None, None

    f.defvjp(fwd, bwd)
    return f


def logits_from_hidden(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``[..., V]`` float32 logits from hidden states ``[..., D]``. A tied embedding is
    contracted as it is stored, ``[V, D]``: its transpose would be a copy of the matrix each
    call, and on a CPU a 16-bit transpose goes through float32 (measured on SmolLM2-135M's
    ``[49152, 576]`` in bfloat16: 51 ms against 8 ms a call at 32 rows)."""
    if cfg.tie_word_embeddings:
        return dense("...D,VD->...V", h, params["embed"].astype(h.dtype), jnp.float32)
    return dense("...D,DV->...V", h, params["lm_head"].astype(h.dtype), jnp.float32)


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
