"""Per-token log-probabilities and entropies without materialising ``[B, T, V]`` logits.

The unembedding ``[D, V]`` is cut into ``C`` vocabulary chunks; ``lax.scan`` walks them with an
online (running) log-sum-exp: per position it carries the running max ``m``, the rescaled sum of
exponentials ``s``, the rescaled sum ``t`` of ``exp(z) * z`` (for the entropy) and the target's
logit. At the end ``lse = m + log s``, ``logp = z_target - lse`` and the entropy
``H = lse - t / s`` (since ``H = -sum p log p = lse - E_p[z]``). The scan body is rematerialised
(``jax.checkpoint``), so the backward pass keeps only the small ``[B, T]`` carries per chunk and
recomputes each chunk's logits: neither pass holds more than one ``[B, T, V / C]`` chunk.

Chunks are *strided*: chunk ``k`` holds vocabulary ids ``k, k + C, k + 2C, ...``. Reshaping a
vocabulary axis that is sharded over the ``model`` mesh axis into ``(V / C, C)`` keeps the
sharding on the within-chunk axis, so every chunk is spread over all tensor-parallel devices and
the scan does not serialise on one of them. The vocabulary is padded to ``C * ceil(V / C)`` with
masked (logit ``-1e30``) columns.

A tied embedding is taken as stored, ``[V, D]`` rows (``rows=True``): its strided chunks are then
whole rows, gathered by a row copy, where the ``[D, V]`` view would be transposed element by
element into chunks in every forward pass (and its gradient back in every backward pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.model.dense import dense
from dora_jax.model.layers import map_seq_chunks
from dora_jax.model.params import Params
from dora_jax.model.transformer import hidden_states, unembed_matrix
from dora_jax.sharding import constrain

NEG = -1e30  # finite stand-in for -inf: padded vocabulary columns


def chunk_layout(vocab_size: int, chunk: int) -> tuple[int, int]:
    """``(num_chunks C, chunk_width c)`` with ``C * c >= vocab_size`` and ``c <= chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    num_chunks = -(-vocab_size // chunk)
    width = -(-vocab_size // num_chunks)
    return num_chunks, width


def chunked_logprobs(
    h: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
    seq_chunk: int = 0,
    rows: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)``, both ``float32[B, T]``, of ``softmax(h @ w)`` at ``targets``.

    ``h [B, T, D]`` hidden states (compute dtype), ``w [D, V]`` unembedding (``rows``: its
    transpose ``[V, D]``, as a tied embedding is stored), ``targets int32[B, T]`` in ``[0, V)``.
    Logits are accumulated in float32. With ``seq_chunk > 0`` the positions are also taken
    ``seq_chunk`` per row at a time (:func:`map_seq_chunks`), so no pass holds more than a
    ``[B, seq_chunk, V / C]`` block of logits.
    """
    V, D = w.shape if rows else w.shape[::-1]
    C, c = chunk_layout(V, chunk)
    Vp = C * c
    w = w.astype(h.dtype)
    if rows:
        if Vp != V:
            w = jnp.pad(w, ((0, Vp - V), (0, 0)))
        # vocab id v = i * C + k  ->  w_chunks[k, i, :]
        w_chunks = jnp.swapaxes(w.reshape(c, C, D), 0, 1)
        w_chunks = constrain(w_chunks, (None, "vocab", "embed"))
    else:
        if Vp != V:
            w = jnp.pad(w, ((0, 0), (0, Vp - V)))
        # vocab id v = i * C + k  ->  w_chunks[k, :, i]
        w_chunks = jnp.transpose(w.reshape(D, c, C), (2, 0, 1))
        w_chunks = constrain(w_chunks, (None, "embed", "vocab"))
    col = jnp.arange(c, dtype=jnp.int32) * C  # [c]: vocab id of column i in chunk 0
    spec = "BTD,cD->BTc" if rows else "BTD,Dc->BTc"
    return map_seq_chunks(
        lambda ht: _vocab_scan(ht[0], ht[1].astype(jnp.int32), w_chunks, col, V, spec),
        (h, targets),
        seq_chunk,
    )


def _vocab_scan(h, targets, w_chunks, col, V, spec):
    C = w_chunks.shape[0]
    B, T = targets.shape

    @jax.checkpoint
    def body(carry, xs):
        m, s, t, tgt = carry
        wk, k = xs
        z = dense(spec, h, wk, jnp.float32)
        z = constrain(z, ("batch", "seq", "vocab"))
        ids = col + k
        z = jnp.where(ids < V, z, NEG)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[..., None])
        s = s * scale + jnp.sum(e, axis=-1)
        t = t * scale + jnp.sum(e * z, axis=-1)
        tgt = tgt + jnp.sum(jnp.where(ids == targets[..., None], z, 0.0), axis=-1)
        return (m_new, s, t, tgt), None

    zeros = jnp.zeros((B, T), jnp.float32)
    init = (jnp.full((B, T), NEG, jnp.float32), zeros, zeros, zeros)
    (m, s, t, tgt), _ = jax.lax.scan(body, init, (w_chunks, jnp.arange(C, dtype=jnp.int32)))
    lse = m + jnp.log(s)
    return tgt - lse, lse - t / s


def token_logprobs(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    cfg: ModelConfig,
    *,
    chunk: int,
    routes: jax.Array | None = None,
    return_routes: bool = False,
) -> tuple[jax.Array, ...]:
    """``(logp, entropy)`` ``float32[B, T]``: the model's log-probability of ``targets[b, t]``
    given the sequence up to position ``t`` (targets are the next tokens), and the entropy of
    that next-token distribution.

    Mixture-of-experts models: ``routes int[B, T, L, k]`` replays those experts (-1: the
    router's own choice); ``return_routes`` appends the experts used, ``int32[B, T, L, k]``."""
    if routes is None and not return_routes:
        h = hidden_states(params, tokens, positions, segment_ids, cfg)
        chosen = None
    else:
        h, chosen = hidden_states(
            params, tokens, positions, segment_ids, cfg, routes=routes, return_routes=True
        )
    tied = cfg.tie_word_embeddings
    w = params["embed"] if tied else unembed_matrix(params, cfg)
    logp, ent = chunked_logprobs(h, w, targets, chunk=chunk, seq_chunk=cfg.seq_chunk, rows=tied)
    return (logp, ent, chosen) if return_routes else (logp, ent)
