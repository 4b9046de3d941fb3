"""Building blocks of the decoder as pure functions: RMSNorm, RoPE, GQA attention, SwiGLU.

Axis letters: B batch, T query length, S key length, D model, N q heads, K kv heads, G = N // K,
H head dim, F ffn. The attention block takes an ``attend`` callable so that the same layer code
serves the full-sequence forward pass (:mod:`dora_jax.model.attention`) and the rollout engine
(paged KV cache and the decode kernels).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.config import ModelConfig
from dora_jax.model.attention import Attend
from dora_jax.model.dense import dense
from dora_jax.model.moe import moe_mlp
from dora_jax.sharding import constrain


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32; normalised values are cast back before the weight (as HF)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[H/2]`` (float32), with Llama-3 frequency-dependent scaling if set."""
    H = cfg.resolved_head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    rs = cfg.rope_scaling
    if rs is not None:
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables ``[..., H]`` for integer ``positions`` of any shape."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [..., T, heads, H]`` by tables ``[..., T, H]`` (rotate-half convention)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


def qkv_projection(
    lp: dict[str, jax.Array], x: jax.Array, positions: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Project normed ``x [B, T, D]`` to ``q [B,T,N,H]``, ``k, v [B,T,K,H]``, RoPE applied.
    With ``q_norm``/``k_norm`` (Qwen3), q and k are RMS-normed per head before RoPE."""
    q = dense("BTD,DNH->BTNH", x, lp["wq"])
    k = dense("BTD,DKH->BTKH", x, lp["wk"])
    v = dense("BTD,DKH->BTKH", x, lp["wv"])
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if "q_norm" in lp:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, cfg)
    q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "q_heads", "head_dim"))
    k = constrain(apply_rope(k, cos, sin), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v


def map_seq_chunks(fn: Any, xs: Any, chunk: int) -> Any:
    """``fn(xs)`` for position-wise ``fn`` over a pytree ``xs`` of ``[B, T, ...]`` arrays, computed
    ``chunk`` positions of every row at a time (a ``lax.map`` whose body is rematerialised, so the
    backward pass holds one chunk's intermediates, e.g. ``[B, chunk, F]`` instead of
    ``[B, T, F]``). Ragged ends are padded with zeros and cut off. ``chunk <= 0`` or ``>= T``:
    one call."""
    B, T = jax.tree.leaves(xs)[0].shape[:2]
    if chunk <= 0 or chunk >= T:
        return fn(xs)
    n = -(-T // chunk)

    def split(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)

    def join(y: jax.Array) -> jax.Array:
        return jnp.moveaxis(y, 0, 1).reshape(B, n * chunk, *y.shape[3:])[:, :T]

    ys = jax.lax.map(jax.checkpoint(fn), jax.tree.map(split, xs))
    return jax.tree.map(join, ys)


def mlp(lp: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
    gate = dense("BTD,DF->BTF", x, lp["w_gate"])
    up = dense("BTD,DF->BTF", x, lp["w_up"])
    h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    return dense("BTF,FD->BTD", h, lp["w_down"])


def decoder_layer(
    lp: dict[str, jax.Array],
    x: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    attend: Attend,
    routes: jax.Array | None = None,
) -> tuple[jax.Array, Any] | tuple[jax.Array, Any, jax.Array]:
    """One pre-norm decoder layer. ``attend(q, k, v, scale) -> (out [B,T,N,H], aux)``; returns
    ``(x [B,T,D], aux)`` so a caller can thread a KV cache through ``aux``. The softmax scale is
    decided here, once for every implementation (``cfg.attention_scale``).

    A mixture of experts (``cfg.is_moe``, static) returns a third value, ``chosen int32[B,T,k]``,
    the experts each token used, and takes this layer's ``routes int32[B,T,k]`` to force them
    (:func:`dora_jax.model.moe.moe_mlp`); dense configs ignore ``routes`` and keep two values.

    Everything but ``attend`` is position-wise, so with ``cfg.seq_chunk`` it runs in chunks of
    positions (:func:`map_seq_chunks`): only ``x`` and ``q, k, v, o`` are whole-sequence arrays."""

    def project(xp):
        x, positions = xp
        return qkv_projection(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions, cfg)

    def out_and_mlp(xo):
        x, o = xo[:2]
        x = constrain(x + dense("BTNH,NHD->BTD", o, lp["wo"]), ("batch", "seq", "embed"))
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        if cfg.is_moe:
            y, chosen = moe_mlp(lp, h, cfg, xo[2] if len(xo) > 2 else None)
            return constrain(x + y, ("batch", "seq", "embed")), chosen
        return constrain(x + mlp(lp, h), ("batch", "seq", "embed"))

    q, k, v = map_seq_chunks(project, (x, positions), cfg.seq_chunk)
    o, aux = attend(q, k, v, cfg.attention_scale)
    if not cfg.is_moe:
        return map_seq_chunks(out_and_mlp, (x, o), cfg.seq_chunk), aux
    xs = (x, o) if routes is None else (x, o, routes)
    x, chosen = map_seq_chunks(out_and_mlp, xs, cfg.seq_chunk)
    return x, aux, chosen
