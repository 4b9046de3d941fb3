"""The engine's attention steps over the paged KV cache, for one layer.

The kernels in :mod:`dora_jax.kernels` are single-device; here they are wrapped in
``jax.shard_map`` over the group mesh's ``model`` axis (q heads and kv heads split the same way,
so every shard holds whole GQA groups). Axis letters: B batch, C prefill chunk, N q heads,
K kv heads, H head dim, P pages, Z page size, S = pages_per_seq * Z.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dora_jax.kernels.kv_cache_ops import append_kv, append_kv_chunk
from dora_jax.kernels.paged_attention import paged_decode_attention
from dora_jax.model.attention import NEG_INF, blockwise_attention, effective_window

HEADS = P(None, None, "model", None)  # [B, C, N|K, H]
PAGES = P("model", None, None, None)  # [K, P, Z, H]
REPLICATED = P()


def resolve_impl(impl: str, interpret: bool | None) -> tuple[str, bool]:
    """``(impl, interpret)`` the engine runs. On a CPU the Pallas kernels only run in interpret
    mode (an order of magnitude slower than the reference): unless ``interpret=True`` is asked
    for explicitly (tests), ``rollout.attention_impl=pallas`` on a CPU warns and runs the
    reference instead."""
    on_cpu = jax.devices()[0].platform == "cpu"
    if impl == "pallas" and on_cpu and interpret is not True:
        warnings.warn(
            "rollout.attention_impl=pallas on a CPU would run the Pallas kernels in interpret "
            "mode (much slower than the reference): using rollout.attention_impl=reference",
            stacklevel=3,
        )
        return "reference", False
    return impl, bool(interpret)


def _shard_attend(local, mesh: Mesh, replicated: int):
    """``local(q, k, v, k_pages, v_pages, *rest) -> (out, k_pages, v_pages)`` over the ``model``
    axis: q, k, v, out and the pages split by head, the ``replicated`` inputs ``rest`` whole."""
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(HEADS, HEADS, HEADS, PAGES, PAGES) + (REPLICATED,) * replicated,
        out_specs=(HEADS, PAGES, PAGES),
        check_vma=False,
    )


def decode_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    active: jax.Array,
    *,
    scale: float,
    mesh: Mesh,
    impl: str,
    interpret: bool,
    window: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's K/V at position ``lengths - 1`` and attend over ``lengths`` tokens.

    ``q [B,1,N,H]``, ``k, v [B,1,K,H]``; ``lengths`` counts the new token. Inactive rows write
    nothing and attend over nothing. ``window`` (int32 scalar, 0: none; None: none): the layer's
    sliding window, only the last ``window`` tokens are attended to. Returns
    ``(out [B,1,N,H], k_pages, v_pages)``.
    """
    windowed = window is not None
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    Z = k_pages.shape[2]
    pos = jnp.maximum(lengths - 1, 0)
    slot_page = jnp.take_along_axis(block_tables, (pos // Z)[:, None], axis=1)[:, 0]
    slot_offset = (pos % Z).astype(jnp.int32)
    lengths = jnp.where(active, lengths, 0).astype(jnp.int32)

    def local(q, k, v, kp, vp, bt, ln, sp, so, act, w):
        # the cache may be wider than the model (kv_cache_dtype): the new token's k and v and
        # the query are cast to it, the result back (exact: the attention runs in float32)
        k, v = k[:, 0].astype(kp.dtype), v[:, 0].astype(vp.dtype)
        kp, vp = append_kv(kp, vp, k, v, sp, so, act, impl=impl, interpret=interpret)
        out = paged_decode_attention(
            q[:, 0].astype(kp.dtype),
            kp,
            vp,
            bt,
            ln,
            scale=scale,
            impl=impl,
            interpret=interpret,
            window=w if windowed else None,
        )
        return out[:, None].astype(q.dtype), kp, vp

    return _shard_attend(local, mesh, replicated=6)(
        q, k, v, k_pages, v_pages, block_tables, lengths, slot_page, slot_offset, active, window
    )


def prefill_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    start: jax.Array,
    num_valid: jax.Array,
    *,
    scale: float,
    mesh: Mesh,
    impl: str,
    interpret: bool,
    chunk_attention: str = "dense",
    block: int = 512,
    window: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write a prompt chunk's K/V (positions ``start .. start+num_valid-1``) and attend each chunk
    token causally over everything the sequence has in the cache so far.

    ``q [B,C,N,H]``, ``k, v [B,C,K,H]``. Rows with ``num_valid = 0`` write nothing. Query rows past
    ``num_valid`` produce finite values that callers ignore. ``chunk_attention`` is ``"dense"``
    (``[B, K, G, C, S]`` scores) or ``"blockwise"`` (:func:`blockwise_attention` over the gathered
    pages, blocks of ``block``). ``window`` (int32 scalar, 0 or None: none): the layer's sliding
    window, key ``s`` is visible to position ``p`` only if ``s > p - window``. Returns
    ``(out, k_pages, v_pages)``.
    """
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    if chunk_attention not in ("dense", "blockwise"):
        raise ValueError(f"chunk_attention must be 'dense' or 'blockwise', got {chunk_attention!r}")

    def local(q, k, v, kp, vp, bt, st, nv, w):
        k, v = k.astype(kp.dtype), v.astype(vp.dtype)  # the cache may be wider (kv_cache_dtype)
        kp, vp = append_kv_chunk(kp, vp, k, v, bt, st, nv, impl=impl, interpret=interpret)
        if chunk_attention == "blockwise":
            out = _paged_chunk_blockwise(q, kp, vp, bt, st, nv, scale, block, w)
        else:
            out = _paged_chunk_attention(q, kp, vp, bt, st, nv, scale, w)
        return out, kp, vp

    fn = _shard_attend(local, mesh, replicated=4)
    return fn(q, k, v, k_pages, v_pages, block_tables, start, num_valid, window)


def _gather_pages(k_pages, v_pages, block_tables):
    """A sequence's pages in token order: ``[K, P, Z, H]`` pages -> ``[B, S, K, H]``."""
    K, _, Z, H = k_pages.shape
    B, S = block_tables.shape[0], block_tables.shape[1] * Z
    ks = k_pages[:, block_tables].reshape(K, B, S, H).transpose(1, 2, 0, 3)
    vs = v_pages[:, block_tables].reshape(K, B, S, H).transpose(1, 2, 0, 3)
    return ks, vs


@partial(jax.named_call, name="paged_chunk_blockwise")
def _paged_chunk_blockwise(
    q, k_pages, v_pages, block_tables, start, num_valid, scale, block, window=None
):
    """Blockwise attention of a chunk over its gathered pages: key ``s`` is visible to chunk
    token ``c`` iff ``s <= start + c``, ``s < start + num_valid`` and ``s > start + c - window``
    (for a window > 0; pure jnp, one device)."""
    B, C = q.shape[:2]
    ks, vs = _gather_pages(k_pages, v_pages, block_tables)
    ks, vs = ks.astype(q.dtype), vs.astype(q.dtype)  # a float32 cache of a 16-bit model
    S = ks.shape[1]
    kv_seg = (jnp.arange(S)[None, :] < (start + num_valid)[:, None]).astype(jnp.int32)
    q_seg = jnp.ones((B, C), jnp.int32)
    return blockwise_attention(
        q, ks, vs, q_seg, kv_seg, scale, q_offset=start, block=block, window=window
    )


@partial(jax.named_call, name="paged_chunk_attention")
def _paged_chunk_attention(q, k_pages, v_pages, block_tables, start, num_valid, scale, window=None):
    """Dense attention of a chunk over its sequence's gathered pages (pure jnp, single device);
    a ``window`` > 0 also hides keys ``s <= position - window``."""
    B, C, N, H = q.shape
    K = k_pages.shape[0]
    ks, vs = _gather_pages(k_pages, v_pages, block_tables)
    ks, vs = ks.astype(q.dtype), vs.astype(q.dtype)  # a float32 cache of a 16-bit model
    S = ks.shape[1]
    q_pos = start[:, None] + jnp.arange(C)[None, :]  # [B, C]
    kv_pos = jnp.arange(S)
    end = (start + num_valid)[:, None, None]
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < end)
    mask = mask & (kv_pos[None, None, :] > q_pos[:, :, None] - effective_window(window))
    qg = q.reshape(B, C, K, N // K, H)
    scores = jnp.einsum("BCKGH,BSKH->BKGCS", qg, ks, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(vs.dtype)
    out = jnp.einsum("BKGCS,BSKH->BCKGH", probs, vs)
    return out.reshape(B, C, N, H)
