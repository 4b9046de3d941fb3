"""Paged decode attention with grouped-query heads (one new query token per sequence).

Axis letters: B batch, N q heads, K kv heads, G = N // K q heads per kv head, H head dim,
P pages (total), Z page size, S kv length (pages_per_seq * Z).

Layout (the one JAX's own paged kernels use):
  q             [B, N, H]       decode queries; q head n attends with kv head n // G
  k_pages       [K, P, Z, H]    (v_pages identical)
  block_tables  int32[B, pages_per_seq]   page ids of each sequence, in token order
  lengths       int32[B]        valid kv tokens per sequence (0 gives an all-zero output)
  window        int32[B]        optional sliding window: only the last `window` of the `lengths`
                                tokens are attended to (0: all of them)

Page 0 is reserved by the allocators as a padding page, so padded block-table entries may be 0.
Entries past a sequence's last page are never attended to; the Pallas wrapper clips every entry to
[0, P) so that no entry can make the kernel read out of bounds.

Implementations (`impl`): "reference" (pure jnp, gathers the pages), "pallas" (our kernel below,
Triton-style `pl.pallas_call`; `interpret=True` runs it on the CPU) and "jax_gpu" (JAX's shipped
`jax.experimental.pallas.ops.gpu.paged_attention`, a dependency used for comparison).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dora_jax.kernels import shared_memory
from dora_jax.kernels.kv_cache_ops import _check_block_tables, _check_pages, _is_pow2

Impl = Literal["reference", "pallas", "jax_gpu"]
IMPLS: tuple[str, ...] = ("reference", "pallas", "jax_gpu")

# Finite "minus infinity": masked logits and the initial running max. Finite so that
# exp(m_split - m_total) stays well defined when a whole split (or a whole sequence) is empty.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# f32 pages get true f32 dots (the Triton lowering would use TF32 at DEFAULT precision); for
# bf16 pages this changes nothing (bf16 products, f32 accumulation).
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PagedAttentionTuning:
    """Block sizes of the Pallas kernel (all powers of two).

    pages_per_compute_block: pages loaded per inner-loop step (the kv block is this times Z).
    block_h: q heads of one kv-head group handled per program (G is padded up to it). The Triton
      dot needs >= 16 rows on a GPU; smaller values are only useful in interpret mode.
    k_splits: the page range of a sequence is split into this many parts handled by separate
      programs and merged afterwards (flash-decoding); raise it when B * K is small.
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).

    Compiled (not interpret), a tuning whose tiles would not fit the GPU's shared memory is
    shrunk before lowering: smaller compute blocks, then fewer stages (fit_attention_tuning).
    """

    pages_per_compute_block: int = 8
    block_h: int = 16
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("pages_per_compute_block", "block_h", "k_splits", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_pow2(value):
                raise ValueError(f"PagedAttentionTuning.{name} must be a power of two, got {value}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"PagedAttentionTuning.num_stages must be >= 1, got {self.num_stages}")


def _split_layout(pages_per_seq: int, tuning: PagedAttentionTuning) -> tuple[int, int]:
    """(pages per split, pages per compute block): the compute block shrinks for short tables,
    and each split is padded up to a whole number of compute blocks."""
    per_split = pl.cdiv(pages_per_seq, tuning.k_splits)
    ppcb = min(tuning.pages_per_compute_block, pl.next_power_of_2(per_split))
    return pl.cdiv(per_split, ppcb) * ppcb, ppcb


# ----------------------------------------------------------------------------------------------
# Shared memory budget of the compiled kernel
# ----------------------------------------------------------------------------------------------

# The Triton dot needs >= 16 rows: the fewest kv tokens a compute block may hold when compiled.
_MIN_BLOCK_TOKENS = 16


def attention_shared_memory_bytes(
    head_dim: int, page_size: int, pages_per_seq: int, dtype, tuning: PagedAttentionTuning
) -> int:
    """Shared memory of one program of the compiled kernel, in bytes (a model, not a measurement).

    The inner loop's K and V tiles ``[pages_per_compute_block * Z, H]`` are staged once per
    pipeline stage, and the q tile ``[block_h, H]`` once. JAX's shipped kernel ("jax_gpu") has the
    same tiles, so the same figure is used for it.
    """
    _, ppcb = _split_layout(pages_per_seq, tuning)
    itemsize = jnp.dtype(dtype).itemsize
    kv_tiles = 2 * ppcb * page_size * head_dim * itemsize
    return tuning.num_stages * kv_tiles + tuning.block_h * head_dim * itemsize


def fit_attention_tuning(
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    dtype,
    tuning: PagedAttentionTuning,
    limit: int | None = None,
) -> PagedAttentionTuning:
    """The tuning the compiled kernel runs with: ``tuning`` itself when its tiles fit ``limit``
    bytes of shared memory (default: the first GPU's per-block limit); otherwise the compute
    block is halved while it keeps >= 16 kv tokens (the pipeline keeps its stages), then the
    stages drop one by one down to 1. Raises ValueError naming the tuning fields if even that
    does not fit.
    """
    limit = shared_memory.device_limit_bytes() if limit is None else limit
    fitted = tuning
    while attention_shared_memory_bytes(head_dim, page_size, pages_per_seq, dtype, fitted) > limit:
        _, ppcb = _split_layout(pages_per_seq, fitted)
        if ppcb > 1 and (ppcb // 2) * page_size >= _MIN_BLOCK_TOKENS:
            fitted = dataclasses.replace(fitted, pages_per_compute_block=ppcb // 2)
        elif fitted.num_stages > 1:
            fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
        else:
            need = attention_shared_memory_bytes(head_dim, page_size, pages_per_seq, dtype, fitted)
            raise ValueError(
                f"the compiled kernel needs {need} B of shared memory per program with "
                f"PagedAttentionTuning.pages_per_compute_block={ppcb}, num_stages=1 and "
                f"block_h={fitted.block_h} (H={head_dim}, Z={page_size}, "
                f"{jnp.dtype(dtype).name}), over the {limit} B per-block limit of this GPU; "
                f'use a smaller page size or impl="reference"'
            )
    return fitted


# ----------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------


def _paged_decode_kernel(
    lengths_ref,  # [1] int32: kv length of this program's sequence
    windows_ref,  # [1] int32: its sliding window (0: none)
    block_table_ref,  # [pages_per_split] int32: page ids of this program's split
    q_ref,  # [block_h, H]: one block of the q heads that share this kv head
    k_pages_ref,  # [P, Z, H]: all pages of this kv head
    v_pages_ref,  # [P, Z, H]
    o_ref,  # [block_h, H] f32: unnormalised output of this split
    m_ref,  # [block_h] f32: running max of this split
    l_ref,  # [block_h] f32: softmax denominator of this split
    *,
    scale: float,
    pages_per_compute_block: int,
):
    split = pl.program_id(3)
    pages_per_split = block_table_ref.shape[0]
    block_h, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_s = pages_per_compute_block * page_size  # kv tokens per inner step

    length = lengths_ref[0]
    window = windows_ref[0]
    first = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)  # first visible token
    split_start = split * (pages_per_split * page_size)  # first token of this split
    tokens_here = jnp.clip(length - split_start, 0, pages_per_split * page_size)
    num_blocks = pl.cdiv(tokens_here, block_s)  # 0 for an empty split: the loop is skipped
    # Blocks wholly before the window are skipped (a start past num_blocks runs no step).
    first_block = jnp.maximum(first - split_start, 0) // block_s

    q = q_ref[...]  # [block_h, H]

    def body(i, carry):
        o_prev, m_prev, l_prev = carry  # [block_h, H], [block_h], [block_h]
        pages = block_table_ref[pl.ds(i * pages_per_compute_block, pages_per_compute_block)]
        k = k_pages_ref[pages].reshape(block_s, head_dim)  # [block_s, H]
        v = v_pages_ref[pages].reshape(block_s, head_dim)  # [block_s, H]
        pos = split_start + i * block_s + jnp.arange(block_s, dtype=jnp.int32)
        valid = (pos < length) & (pos >= first)  # [block_s]
        # Slots past the length may hold anything (stale tokens, NaN): zero them out of V too.
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
        )  # [block_h, block_s]
        s = jnp.where(valid[None, :], s * scale, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(valid[None, :], jnp.exp(s - m_next[:, None]), 0.0)  # [block_h, block_s]
        l_next = alpha * l_prev + p.sum(axis=-1)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=_HIGHEST,
            preferred_element_type=jnp.float32,
        )  # [block_h, H]
        return alpha[:, None] * o_prev + pv, m_next, l_next

    o0 = jnp.zeros((block_h, head_dim), jnp.float32)
    m0 = jnp.full((block_h,), _MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    o, m, l = lax.fori_loop(first_block, num_blocks, body, (o0, m0, l0))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "tuning", "interpret"))
def _paged_decode_pallas(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    windows: jax.Array,
    *,
    scale: float,
    tuning: PagedAttentionTuning,
    interpret: bool,
) -> jax.Array:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, total_pages, _, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]

    # Pages per split and per compute block; pad the block tables (with page 0) to fit.
    k_splits = tuning.k_splits
    per_split, ppcb = _split_layout(pages_per_seq, tuning)
    tables = jnp.clip(block_tables, 0, total_pages - 1)
    tables = jnp.pad(tables, ((0, 0), (0, k_splits * per_split - pages_per_seq)))
    tables = tables.reshape(batch, k_splits, per_split)

    # q heads grouped by kv head, the group padded to a multiple of block_h.
    block_h = tuning.block_h
    group_pad = pl.cdiv(group, block_h) * block_h
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))

    grid = (batch, num_kv_heads, group_pad // block_h, k_splits)
    kernel = functools.partial(_paged_decode_kernel, scale=scale, pages_per_compute_block=ppcb)
    part_shape = (k_splits, batch, num_kv_heads, group_pad)
    per_row = pl.BlockSpec((1,), lambda b, k, h, s: (b,))  # lengths, windows
    table_spec = pl.BlockSpec((None, None, per_split), lambda b, k, h, s: (b, s, 0))
    q_spec = pl.BlockSpec((None, None, block_h, head_dim), lambda b, k, h, s: (b, k, h, 0))
    page_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, k, h, s: (k, 0, 0, 0))
    o_spec = pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, k, h, s: (s, b, k, h, 0))
    stat_spec = pl.BlockSpec((None, None, None, block_h), lambda b, k, h, s: (s, b, k, h))  # m, l
    o_shape = jax.ShapeDtypeStruct((*part_shape, head_dim), jnp.float32)
    stat_shape = jax.ShapeDtypeStruct(part_shape, jnp.float32)
    o, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[per_row, per_row, table_spec, q_spec, page_spec, page_spec],
        out_specs=[o_spec, stat_spec, stat_spec],
        out_shape=[o_shape, stat_shape, stat_shape],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=tuning.num_warps, num_stages=tuning.num_stages
        ),
        name=f"dora_paged_decode_ppcb{ppcb}_bh{block_h}_ks{k_splits}",
    )(lengths, windows, tables, qg, k_pages, v_pages)

    # Merge the splits: [k_splits, B, K, G_pad, ...] -> [B, K, G_pad, ...].
    m_all = m.max(axis=0)
    alpha = jnp.exp(m - m_all[None])
    l_all = (alpha * l).sum(axis=0)
    o_all = (alpha[..., None] * o).sum(axis=0)
    out = o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # length 0 -> zeros
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Reference and JAX's shipped kernel
# ----------------------------------------------------------------------------------------------


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    window: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp paged decode attention: gather each sequence's pages, dense masked softmax (f32).
    ``window int32[B]`` (optional, 0: none): only the last ``window`` tokens are visible."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = _default_scale(head_dim) if scale is None else float(scale)
    seq = block_tables.shape[1] * page_size

    k = k_pages[:, block_tables].reshape(num_kv_heads, batch, seq, head_dim).astype(jnp.float32)
    v = v_pages[:, block_tables].reshape(num_kv_heads, batch, seq, head_dim).astype(jnp.float32)
    valid = jnp.arange(seq)[None, :] < lengths[:, None]  # [B, S]
    if window is not None:
        first = jnp.where(window > 0, lengths - window, 0)
        valid = valid & (jnp.arange(seq)[None, :] >= first[:, None])
    v = jnp.where(valid[None, :, :, None], v, 0.0)  # slots past the length may hold anything
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("bkgh,kbsh->bkgs", qg, k, precision=_HIGHEST) * scale
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkgs,kbsh->bkgh", p, v, precision=_HIGHEST)
    return o.reshape(batch, num_heads, head_dim).astype(q.dtype)


def _paged_decode_jax_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    tuning: PagedAttentionTuning,
    interpret: bool,
) -> jax.Array:
    # Imported here: an optional comparison path that the other impls must not depend on.
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    if tuning.block_h % 16:
        raise ValueError(f'impl="jax_gpu" needs tuning.block_h % 16 == 0, got {tuning.block_h}')
    pages_per_seq = block_tables.shape[1]
    # Pad the tables so that pages_per_seq divides by k_splits (JAX's kernel asserts it) and each
    # partition divides by the compute block.
    per_split, ppcb = _split_layout(pages_per_seq, tuning)
    tables = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)
    tables = jnp.pad(tables, ((0, 0), (0, tuning.k_splits * per_split - pages_per_seq)))
    q_scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)  # JAX's kernel takes no scale
    return jax_paged.paged_attention(
        q_scaled,
        k_pages,
        v_pages,
        tables,
        lengths,
        block_h=tuning.block_h,
        pages_per_compute_block=ppcb,
        k_splits=tuning.k_splits,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        interpret=interpret,
    )


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _validate(q, k_pages, v_pages, block_tables, lengths) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
    _check_pages(k_pages, v_pages, 4, "[K, P, Z, H]")
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, _, head_dim_kv = k_pages.shape
    if q.dtype != k_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the kv pages dtype {k_pages.dtype}")
    if head_dim != head_dim_kv:
        raise ValueError(f"q head dim {head_dim} differs from the kv head dim {head_dim_kv}")
    if num_heads % num_kv_heads:
        raise ValueError(f"N % K must be 0: {num_heads} q heads, {num_kv_heads} kv heads")
    _check_block_tables(block_tables, batch)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [B={batch}], got shape {lengths.shape}")
    if lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32, got {lengths.dtype}")


def _validate_for_gpu(
    head_dim: int, page_size: int, pages_per_seq: int, tuning: PagedAttentionTuning
) -> None:
    """Shape rules of the Triton lowering (tiles are powers of two, dots need >= 16 per side)."""
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"the compiled kernel needs a power-of-two H >= 16, got H={head_dim}")
    if not _is_pow2(page_size):
        raise ValueError(f"the compiled kernel needs a power-of-two page size, got Z={page_size}")
    if tuning.block_h < 16:
        raise ValueError(f"the compiled kernel needs tuning.block_h >= 16, got {tuning.block_h}")
    _, ppcb = _split_layout(pages_per_seq, tuning)
    if ppcb * page_size < _MIN_BLOCK_TOKENS:
        raise ValueError(
            f"the compiled kernel needs >= {_MIN_BLOCK_TOKENS} kv tokens per compute block, got "
            f"{ppcb} page(s) of {page_size} (pages_per_seq={pages_per_seq}, "
            f"k_splits={tuning.k_splits})"
        )


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    impl: Impl,
    scale: float | None = None,
    interpret: bool = False,
    tuning: PagedAttentionTuning | None = None,
    window: jax.Array | int | None = None,
) -> jax.Array:
    """Decode attention of one query token per sequence over its paged K/V.

    Args:
      q: [B, N, H] queries; same dtype as the pages.
      k_pages, v_pages: [K, P, Z, H] with N % K == 0.
      block_tables: int32[B, pages_per_seq], entries in [0, P).
      lengths: int32[B], at most pages_per_seq * Z; a length 0 row yields zeros.
      impl: "reference", "pallas" or "jax_gpu" (explicit; there is no fallback).
      scale: softmax scale, default 1 / sqrt(H). The softmax is computed in float32.
      interpret: run the Pallas kernels in interpret mode (CPU).
      tuning: block sizes of the Pallas kernels (default PagedAttentionTuning()). Compiled
        (not interpret), a tuning whose tiles exceed the GPU's shared memory is shrunk first
        (see fit_attention_tuning).
      window: sliding window, int32 scalar or [B] (0: none; default None: none). The query (the
        token at ``lengths - 1``) attends to tokens ``lengths - window .. lengths - 1`` only.
        Not supported by "jax_gpu".

    Returns:
      [B, N, H] in q's dtype.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    _validate(q, k_pages, v_pages, block_tables, lengths)
    if tuning is None:
        tuning = PagedAttentionTuning()
    if not isinstance(tuning, PagedAttentionTuning):
        raise ValueError(f"tuning must be a PagedAttentionTuning, got {type(tuning).__name__}")
    scale = _default_scale(q.shape[-1]) if scale is None else float(scale)
    if window is not None:
        window = jnp.asarray(window)
        if window.dtype != jnp.int32 or window.shape not in ((), lengths.shape):
            raise ValueError(
                f"window must be int32 of shape () or {lengths.shape}, got {window.dtype} "
                f"{window.shape}"
            )
        window = jnp.broadcast_to(window, lengths.shape)
        if impl == "jax_gpu":
            raise ValueError('impl="jax_gpu" does not support a sliding window; use "pallas"')
    if impl == "reference":
        return paged_decode_attention_reference(
            q, k_pages, v_pages, block_tables, lengths, scale=scale, window=window
        )
    if not interpret:
        # The shape rules of the Triton lowering, then the tiles shrunk to the device's shared
        # memory before lowering (the shrunk tuning still keeps those rules).
        head_dim, page_size, pages_per_seq = q.shape[-1], k_pages.shape[2], block_tables.shape[1]
        _validate_for_gpu(head_dim, page_size, pages_per_seq, tuning)
        tuning = fit_attention_tuning(head_dim, page_size, pages_per_seq, q.dtype, tuning)
    if impl == "pallas":
        windows = jnp.zeros_like(lengths) if window is None else window
        return _paged_decode_pallas(
            q,
            k_pages,
            v_pages,
            block_tables,
            lengths,
            windows,
            scale=scale,
            tuning=tuning,
            interpret=interpret,
        )
    return _paged_decode_jax_gpu(
        q, k_pages, v_pages, block_tables, lengths, scale=scale, tuning=tuning, interpret=interpret
    )
