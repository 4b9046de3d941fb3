"""Full-sequence attention for the forward pass (train step, warm start, engine prefill chunks).

Three implementations sit behind the decoder layer's one ``attend`` seam, chosen explicitly by
``model.attention`` (no implementation falls back to another on its own):

- ``dense``: the reference (:func:`dense_attention`). It materialises float32 scores
  ``[B, K, G, T, S]`` and a ``[B, T, S]`` mask: fine for short sequences and tests, quadratic in
  memory for long ones.
- ``blockwise``: :func:`blockwise_attention`, flash-style attention in plain JAX. Queries are
  cut into blocks of ``bq`` and keys into blocks of ``bk``; each query block walks its key blocks
  with an online softmax (running max ``m``, running sum ``l``, rescaled output), so no pass
  holds more than one ``[B, K, G, bq, bk]`` score block. A ``jax.custom_vjp`` saves only ``q, k,
  v``, the output and the per-query log-sum-exp; the backward pass recomputes each block's
  probabilities (FlashAttention-2's algorithm: ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``)
  and never stores per-block probabilities. Block pairs that no query can attend to (above the
  causal diagonal, between segments that share no id, padding) are skipped with data-dependent
  loop bounds, so a packed row of short samples costs little more than its samples.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN's fused flash
  attention, GPU only, bfloat16). The public API expresses causal masking and right padding but
  not packed segments, so it needs one sequence per row starting at index 0 (``train.pack_rows =
  0``); the config refuses other settings.

Masking convention (all three): query ``t`` attends to key ``s`` iff the key's segment id is
non-zero and is the query's own or the query's *root* (:func:`segment_root`), and ``s <= t +
q_offset`` (causal by array index; ``q_offset`` shifts a chunk of
queries that starts later in the sequence, as the engine's prefill chunks do). With a sliding
``window`` w > 0 (dense and blockwise; an int32 scalar, data scanned with the layers) the key must
also satisfy ``s > t + q_offset - w``: the w most recent positions, the query's own included.
Segments are contiguous, so index distance is position distance (a window over a shared prefix is
not expressible: the trainer refuses the combination). ``window`` 0 means no window.

Shared prefixes: an id below ``ROOT_SPAN`` is its own root, so plain packed segments (1, 2, ...)
attend within themselves. An id ``r + k * ROOT_SPAN`` (``k >= 1``) has root ``r``: its queries
also see the keys of segment ``r``, which sits before it in the row. The trainer packs a GRPO
group's prompt once as segment ``r`` and each response as ``r + k * ROOT_SPAN``, so every
response attends to the one copy of its prompt exactly as it would to its own.
Outputs of query rows that attend to nothing (padding) are unspecified but finite.

Axis letters: B batch, T queries, S keys, N q heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig

NEG_INF = -1e30  # finite, so fully masked rows (padding queries) stay NaN-free
ATTENTION_IMPLS = ("dense", "blockwise", "cudnn")


# ---------------------------------------------------------------------------------------------
# dense reference


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float
) -> jax.Array:
    """GQA attention. ``q [B,T,N,H]``, ``k, v [B,S,K,H]``, ``mask bool[B,T,S]`` -> ``[B,T,N,H]``.

    Scores and softmax in float32.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


_NO_WINDOW = 1 << 30  # a window no sequence reaches (window 0 is mapped to it)


def effective_window(window: jax.Array | int | None) -> jax.Array:
    """int32 window with 0 (or None) replaced by one longer than any sequence."""
    if window is None:
        return jnp.int32(_NO_WINDOW)
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, window, _NO_WINDOW)


def window_band(T: int, S: int, window: jax.Array | int | None, q_offset: int = 0) -> jax.Array:
    """``bool[T, S]``: key ``s`` is within the sliding window of query ``t`` (``s > t + q_offset
    - window``; all true for window 0). Combine with a causal mask."""
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None] + q_offset
    return jnp.arange(S, dtype=jnp.int32)[None, :] > q_idx - effective_window(window)


ROOT_SPAN = 1 << 16  # segment ids r + k * ROOT_SPAN (k >= 1) also attend to segment r


def segment_root(segment_ids: jax.Array) -> jax.Array:
    """The segment each id's queries also attend to: ``id % ROOT_SPAN`` (the id itself below
    ``ROOT_SPAN``)."""
    return segment_ids % ROOT_SPAN


def visible_segments(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """``q_seg[..., :, None]`` may attend to ``k_seg[..., None, :]`` by segment (no causality):
    the key is real and is the query's segment or its root."""
    q, k = q_seg[..., :, None], k_seg[..., None, :]
    return ((k == q) | (k == segment_root(q))) & (k != 0)


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """``bool[B, T, T]``: causal, within the same segment or onto its root (a shared prefix),
    never onto padding (segment 0)."""
    T = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    return causal[None] & visible_segments(segment_ids, segment_ids)


# ---------------------------------------------------------------------------------------------
# blockwise (flash-style) attention


def _segment_ranges(
    seg: jax.Array, n: int, b: int, roots: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Per row and block, the smallest and largest non-zero segment id (``[B, n]`` each); an
    all-padding block gets the empty range ``(int32 max, -1)``. ``roots``: the range also covers
    the ids' roots (what a query block can see besides its own ids)."""
    s = seg.reshape(seg.shape[0], n, b)
    real = s != 0
    low = segment_root(s) if roots else s  # a root is never above its id
    lo = jnp.min(jnp.where(real, low, jnp.iinfo(jnp.int32).max), axis=-1)
    hi = jnp.max(jnp.where(real, s, -1), axis=-1)
    return lo, hi


def live_blocks(
    q_seg: jax.Array,
    kv_seg: jax.Array,
    q_offset: jax.Array,
    bq: int,
    bk: int,
    window: jax.Array | None = None,
) -> jax.Array:
    """``bool[nq, nk]``: a conservative "some query of block ``i`` may attend to some key of block
    ``j``" for any row. Two blocks whose non-zero segment-id ranges (the query block's widened to
    its ids' roots) do not overlap share no visible id (so the test holds for any segment
    numbering), a key block that starts after a query
    block's last causal index is invisible to it, and so is one that ends before the sliding
    window of the block's first query (``window``, 0 or None: no window)."""
    nq, nk = q_seg.shape[1] // bq, kv_seg.shape[1] // bk
    qlo, qhi = _segment_ranges(q_seg, nq, bq, roots=True)
    klo, khi = _segment_ranges(kv_seg, nk, bk)
    overlap = (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
    last_q = (jnp.arange(nq, dtype=jnp.int32) + 1) * bq - 1
    first_k = jnp.arange(nk, dtype=jnp.int32) * bk
    causal = first_k[None, None, :] <= last_q[None, :, None] + q_offset[:, None, None]
    first_q = jnp.arange(nq, dtype=jnp.int32) * bq
    last_k = first_k + bk - 1
    in_window = last_k[None, None, :] > (
        first_q[None, :, None] + q_offset[:, None, None] - effective_window(window)
    )
    return jnp.any(overlap & causal & in_window, axis=0)


def _hull(live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each row of ``live [n, m]``, the loop bounds ``[lo, hi)`` covering its true entries
    (``lo == hi`` when it has none)."""
    m = live.shape[1]
    some = jnp.any(live, axis=1)
    lo = jnp.argmax(live, axis=1).astype(jnp.int32)
    hi = (m - jnp.argmax(live[:, ::-1], axis=1)).astype(jnp.int32)
    return jnp.where(some, lo, 0), jnp.where(some, hi, 0)


def _block_mask(qs, ks, q_idx, k_idx, w):
    """``bool[B, bq, bk]`` from query/key segment ids ``[B, bq]``, ``[B, bk]``, causal query
    indices ``[B, bq]`` (offset applied), key indices ``[bk]`` and the effective window ``w``."""
    same = visible_segments(qs, ks)
    causal = k_idx[None, None, :] <= q_idx[:, :, None]
    return same & causal & (k_idx[None, None, :] > q_idx[:, :, None] - w)


def _scores(qi, kj, scale):
    # qi [B,bq,K,G,H], kj [B,bk,K,H] -> [B,K,G,bq,bk] float32
    return jnp.einsum("BqKGH,BkKH->BKGqk", qi, kj, preferred_element_type=jnp.float32) * scale


def _block(x: jax.Array, i: jax.Array, b: int) -> jax.Array:
    """Block ``i`` of ``b`` positions along axis 1 (no relayout of the whole array)."""
    return jax.lax.dynamic_slice_in_dim(x, i * b, b, axis=1)


def _put_block(x: jax.Array, update: jax.Array, i: jax.Array, b: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update, i * b, axis=1)


def _flash_forward(q, k, v, q_seg, kv_seg, q_offset, window, scale, bq, bk):
    """``(out [B,Tp,K,G,H], lse float32[B,K,G,Tp], live)`` for inputs padded to whole blocks."""
    B, Tp, K, G, H = q.shape
    nq = Tp // bq
    live = live_blocks(q_seg, kv_seg, q_offset, bq, bk, window)
    lo, hi = _hull(live)
    w = effective_window(window)

    def q_block(i, acc):
        out_all, lse_all = acc
        qi, qsi = _block(q, i, bq), _block(q_seg, i, bq)
        q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[None, :] + q_offset[:, None]

        def kv_step(j, carry):
            o, m, l = carry
            kj, vj, ksj = _block(k, j, bk), _block(v, j, bk), _block(kv_seg, j, bk)
            mask = _block_mask(qsi, ksj, q_idx, j * bk + jnp.arange(bk, dtype=jnp.int32), w)
            mask = mask[:, None, None]  # [B,1,1,bq,bk]
            s = jnp.where(mask, _scores(qi, kj, scale), NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "BKGqk,BkKH->BqKGH", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32
            )
            return o * jnp.moveaxis(alpha, 3, 1)[..., None] + pv, m_new, l

        init = (
            jnp.zeros((B, bq, K, G, H), jnp.float32),
            jnp.full((B, K, G, bq), NEG_INF, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
        )
        o, m, l = jax.lax.fori_loop(lo[i], hi[i], kv_step, init)
        seen = l > 0
        l_q = jnp.moveaxis(jnp.where(seen, l, 1.0), 3, 1)[..., None]  # [B,bq,K,G,1]
        out = jnp.where(jnp.moveaxis(seen, 3, 1)[..., None], o / l_q, 0.0).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        out_all = _put_block(out_all, out, i, bq)
        lse_all = jax.lax.dynamic_update_slice_in_dim(lse_all, lse, i * bq, axis=3)
        return out_all, lse_all

    init = (jnp.zeros_like(q), jnp.zeros((B, K, G, Tp), jnp.float32))
    out, lse = jax.lax.fori_loop(0, nq, q_block, init)
    return out, lse, live


def _flash_backward(q, k, v, q_seg, kv_seg, q_offset, window, out, lse, live, do, scale, bq, bk):
    B, Tp, K, G, H = q.shape
    w = effective_window(window)
    Sp = k.shape[1]
    nk = Sp // bk
    lo, hi = _hull(live.T)
    # rowsum(dO * O) per query, in the score layout [B,K,G,Tp]
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", do, out, preferred_element_type=jnp.float32)

    def kv_block(j, acc):
        dq, dk_all, dv_all = acc
        kj, vj, ksj = _block(k, j, bk), _block(v, j, bk), _block(kv_seg, j, bk)
        k_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)

        def q_step(i, carry):
            dq, dk, dv = carry
            qi, doi, qsi = _block(q, i, bq), _block(do, i, bq), _block(q_seg, i, bq)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[None, :] + q_offset[:, None]
            mask = _block_mask(qsi, ksj, q_idx, k_idx, w)[:, None, None]
            s = _scores(qi, kj, scale)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)  # [B,K,G,bq,bk]
            dv = dv + jnp.einsum(
                "BKGqk,BqKGH->BkKH", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("BqKGH,BkKH->BKGqk", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * scale
            dk = dk + jnp.einsum(
                "BKGqk,BqKGH->BkKH", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32
            )
            dqi = jnp.einsum(
                "BKGqk,BkKH->BqKGH", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32
            )
            return _put_block(dq, _block(dq, i, bq) + dqi, i, bq), dk, dv

        zeros = jnp.zeros((B, bk, K, H), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(lo[j], hi[j], q_step, (dq, zeros, zeros))
        return dq, _put_block(dk_all, dk, j, bk), _put_block(dv_all, dv, j, bk)

    init = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    dq, dk, dv = jax.lax.fori_loop(0, nk, kv_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, q_seg, kv_seg, q_offset, window, scale, bq, bk):
    out, _, _ = _flash_forward(q, k, v, q_seg, kv_seg, q_offset, window, scale, bq, bk)
    return out


def _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, window, scale, bq, bk):
    out, lse, live = _flash_forward(q, k, v, q_seg, kv_seg, q_offset, window, scale, bq, bk)
    return out, (q, k, v, q_seg, kv_seg, q_offset, window, out, lse, live)


def _flash_bwd(scale, bq, bk, res, do):
    q, k, v, q_seg, kv_seg, q_offset, window, out, lse, live = res
    dq, dk, dv = _flash_backward(
        q, k, v, q_seg, kv_seg, q_offset, window, out, lse, live, do, scale, bq, bk
    )
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_axis1(x: jax.Array, n: int) -> jax.Array:
    if x.shape[1] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    scale: float,
    *,
    q_offset: jax.Array | None = None,
    block: int = 512,
    window: jax.Array | int | None = None,
) -> jax.Array:
    """Flash-style GQA attention (see the module docstring for the masking convention).

    ``q [B,T,N,H]``, ``k, v [B,S,K,H]``, segment ids ``int32[B,T]`` and ``int32[B,S]`` (0 is
    padding), ``q_offset int32[B]`` (default 0), sliding ``window`` (int32 scalar; 0 or None: no
    window; blocks wholly outside every query's window are skipped). Blocks of ``min(block, T)``
    queries and ``min(block, S)`` keys; ragged ends are padded. Differentiable in ``q, k, v`` with a
    memory-efficient custom backward. Returns ``[B,T,N,H]`` in ``q``'s dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bq, bk = min(block, T), min(block, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    if q_offset is None:
        q_offset = jnp.zeros((B,), jnp.int32)
    qg = _pad_axis1(q.reshape(B, T, K, N // K, H), Tp)
    out = _flash(
        qg,
        _pad_axis1(k, Sp),
        _pad_axis1(v, Sp),
        _pad_axis1(q_segment_ids.astype(jnp.int32), Tp),
        _pad_axis1(kv_segment_ids.astype(jnp.int32), Sp),
        q_offset.astype(jnp.int32),
        jnp.asarray(0 if window is None else window, jnp.int32),
        float(scale),
        bq,
        bk,
    )
    return out[:, :T].reshape(B, T, N, H)


# ---------------------------------------------------------------------------------------------
# cuDNN


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    scale: float,
    *,
    implementation: str = "cudnn",
) -> jax.Array:
    """Causal self-attention through ``jax.nn.dot_product_attention`` for rows that each hold ONE
    sequence starting at index 0 followed by padding (``segment_ids`` 1 then 0): the padding is
    passed as sequence lengths. Packed rows are not expressible here (see the module docstring).
    ``implementation="xla"`` runs the same call through XLA (tests on the CPU)."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            "model.attention=cudnn needs a GPU (cuDNN flash attention), the default backend is "
            f"{jax.default_backend()!r}; use model.attention=blockwise"
        )
    lengths = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )


# ---------------------------------------------------------------------------------------------
# the attend seam for full sequences

# attend(q, k, v, scale) -> (out, aux): the one seam every attention implementation sits behind
# (the rollout engine's paged attention included); ``aux`` threads a KV cache through a layer.
Attend = Callable[[jax.Array, jax.Array, jax.Array, float], tuple[jax.Array, Any]]


def make_attend(
    cfg: ModelConfig, segment_ids: jax.Array, window: jax.Array | None = None
) -> Attend:
    """The decoder layer's ``attend(q, k, v, scale) -> (out, None)`` for self-attention over
    ``segment_ids [B, T]`` with ``model.attention``'s implementation. ``window``: this layer's
    sliding window (int32 scalar, 0: none), read only when ``cfg.sliding_window`` is set."""
    impl = cfg.attention
    if cfg.sliding_window is None:
        window = None
    if impl == "dense":
        mask = segment_causal_mask(segment_ids)
        if window is not None:
            T = segment_ids.shape[1]
            mask = mask & window_band(T, T, window)[None]
        return lambda q, k, v, scale: (dense_attention(q, k, v, mask, scale), None)
    if impl == "blockwise":
        block = cfg.attention_block
        return lambda q, k, v, scale: (
            blockwise_attention(
                q, k, v, segment_ids, segment_ids, scale, block=block, window=window
            ),
            None,
        )
    if impl == "cudnn":
        if window is not None:
            raise ValueError("model.attention=cudnn does not support sliding_window")
        return lambda q, k, v, scale: (cudnn_attention(q, k, v, segment_ids, scale), None)
    raise ValueError(f"model.attention: unknown implementation {impl!r} ({ATTENTION_IMPLS})")
