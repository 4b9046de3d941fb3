"""An independent Qwen2/Llama decoder forward pass for test oracles (no ``dora_jax.model`` code).

Written from the architecture's definition (pre-norm RMSNorm, rotate-half RoPE, grouped-query
attention with a causal mask within packed segments, SwiGLU MLP, tied or untied unembedding),
over an array namespace ``xp``:

- ``xp = numpy`` with float64 arrays: a NumPy reference;
- ``xp = jax.numpy`` under ``jax.enable_x64()``: the same function in float64 that ``jax.grad``
  can differentiate (the gradient oracle of the train step).

The params pytree has the layout of ``dora_jax.model.params`` (stacked ``L`` leading axis).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _rms(xp, x, w, eps):
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate(xp, x, positions, theta):
    """Rotate-half RoPE on ``x [B, T, heads, H]`` at integer ``positions [B, T]``."""
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)  # [H/2]
    ang = positions[..., None] * inv  # [B, T, H/2]
    cos = xp.concatenate([xp.cos(ang), xp.cos(ang)], -1)[:, :, None, :]
    sin = xp.concatenate([xp.sin(ang), xp.sin(ang)], -1)[:, :, None, :]
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return x * cos + xp.concatenate([-x2, x1], axis=-1) * sin


def reference_logits(
    params: dict,
    tokens: np.ndarray,
    positions: np.ndarray,
    segment_ids: np.ndarray,
    cfg: Any,
    xp: Any = np,
) -> Any:
    """Logits ``[B, T, V]``.

    ``params`` leaves must already be ``xp`` float64 arrays; the integer inputs are ``xp`` arrays
    too (so a jitted caller can pass them as arguments). ``cfg`` is a ``ModelConfig``
    (only its numbers are read); RoPE scaling is not mirrored here.
    """
    if cfg.rope_scaling is not None:
        raise NotImplementedError("reference_logits does not mirror RoPE scaling")
    T = tokens.shape[1]
    N, K, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    H = cfg.hidden_size // N if cfg.head_dim is None else cfg.head_dim
    # attend to earlier-or-same positions of the same non-padding segment
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    allowed = np.tril(np.ones((T, T), bool))[None] & same & (segment_ids != 0)[:, None, :]
    allowed = allowed | ~allowed.any(-1, keepdims=True)  # padding queries (ignored): finite
    lay = params["layers"]
    x = params["embed"][tokens]
    for i in range(lay["wq"].shape[0]):
        h = _rms(xp, x, lay["attn_norm"][i], eps)
        q = xp.einsum("btd,dnh->btnh", h, lay["wq"][i])
        k = xp.einsum("btd,dkh->btkh", h, lay["wk"][i])
        v = xp.einsum("btd,dkh->btkh", h, lay["wv"][i])
        if "bq" in lay:
            q, k, v = q + lay["bq"][i], k + lay["bk"][i], v + lay["bv"][i]
        q = _rotate(xp, q, positions, cfg.rope_theta)
        k = _rotate(xp, k, positions, cfg.rope_theta)
        kv_of_head = np.arange(N) // (N // K)  # q head n reads kv head n // (N / K)
        k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]
        s = xp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        s = xp.where(allowed[:, None], s, -np.inf)
        s = s - xp.max(s, axis=-1, keepdims=True)
        p = xp.exp(s) / xp.sum(xp.exp(s), axis=-1, keepdims=True)
        o = xp.einsum("bnts,bsnh->btnh", p, v)
        x = x + xp.einsum("btnh,nhd->btd", o, lay["wo"][i])
        h = _rms(xp, x, lay["mlp_norm"][i], eps)
        gate = xp.einsum("btd,df->btf", h, lay["w_gate"][i])
        up = xp.einsum("btd,df->btf", h, lay["w_up"][i])
        x = x + xp.einsum("btf,fd->btd", gate / (1.0 + xp.exp(-gate)) * up, lay["w_down"][i])
    x = _rms(xp, x, params["final_norm"], eps)
    unembed = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return xp.einsum("btd,dv->btv", x, unembed)


def reference_logprobs(params, tokens, positions, segment_ids, targets, cfg, xp=np):
    """``log softmax(logits)`` at ``targets`` (``[B, T]``), in float64."""
    z = reference_logits(params, tokens, positions, segment_ids, cfg, xp)
    z = z - xp.max(z, axis=-1, keepdims=True)
    ls = z - xp.log(xp.sum(xp.exp(z), axis=-1, keepdims=True))
    return xp.take_along_axis(ls, targets[..., None], axis=-1)[..., 0]


def as_float64(params: dict, xp: Any = np) -> dict:
    """The params tree with every leaf a float64 ``xp`` array."""
    if isinstance(params, dict):
        return {k: as_float64(v, xp) for k, v in params.items()}
    return xp.asarray(np.asarray(params, np.float64))
