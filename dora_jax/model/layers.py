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
from dora_jax.model.attention import (  # noqa: F401  (re-exported: the dense reference)
    NEG_INF,
    Attend,
    dense_attention,
    segment_causal_mask,
)
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
    """Project normed ``x [B, T, D]`` to ``q [B,T,N,H]``, ``k, v [B,T,K,H]``, RoPE applied."""
    q = jnp.einsum("BTD,DNH->BTNH", x, lp["wq"])
    k = jnp.einsum("BTD,DKH->BTKH", x, lp["wk"])
    v = jnp.einsum("BTD,DKH->BTKH", x, lp["wv"])
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    cos, sin = rope_cos_sin(positions, cfg)
    q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "q_heads", "head_dim"))
    k = constrain(apply_rope(k, cos, sin), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v


def mlp(lp: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
    gate = jnp.einsum("BTD,DF->BTF", x, lp["w_gate"])
    up = jnp.einsum("BTD,DF->BTF", x, lp["w_up"])
    h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    return jnp.einsum("BTF,FD->BTD", h, lp["w_down"])


def decoder_layer(
    lp: dict[str, jax.Array],
    x: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    attend: Attend,
) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer. ``attend(q, k, v, scale) -> (out [B,T,N,H], aux)``; returns
    ``(x [B,T,D], aux)`` so a caller can thread a KV cache through ``aux``. The softmax scale is
    decided here, once for every implementation (``cfg.attention_scale``)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv_projection(lp, h, positions, cfg)
    o, aux = attend(q, k, v, cfg.attention_scale)
    x = x + jnp.einsum("BTNH,NHD->BTD", o, lp["wo"])
    x = constrain(x, ("batch", "seq", "embed"))
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = constrain(x + mlp(lp, h), ("batch", "seq", "embed"))
    return x, aux
