"""Paged KV-cache writes (decode append, prefill-chunk append) and page pack/unpack for migration.

Axis letters: B batch, T chunk length, M write slots, L layers, K kv heads, P pages (total),
Z page size, H head dim, n pages moved.

Layouts:
  one layer's cache   k_pages, v_pages  [K, P, Z, H]      (append_kv, append_kv_chunk)
  whole cache         k_pages, v_pages  [L, K, P, Z, H]   (pack_pages, unpack_pages)
  migration buffer    [2, L, K, n, Z, H]: buffer[0] holds K, buffer[1] holds V, and
                      buffer[:, :, :, j] is page page_ids[j] of every layer and kv head.

Every op returns new caches; callers jit them with the cache donated, and the Pallas kernels alias
the cache inputs to their outputs (`input_output_aliases`), so the update happens in place.

Implementations (`impl`): "reference" is a jnp scatter/gather, which XLA already runs at memory
speed and in place on a donated cache; it is the intended production path. "pallas" is a small
copy kernel (one program per slot or page and kv head) kept for comparison on the GPU
(launch/gpu_check.py) and for fusing into larger kernels later; it gives nothing over
XLA for these pure copies and is not expected to be faster.

Out-of-range indices never touch memory out of bounds: a write slot or destination page outside
the cache is skipped (both impls), and a source page id of pack_pages is clipped into [0, P).
Active write slots and destination page ids must be distinct (duplicate writes race).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dora_jax.kernels import shared_memory

Impl = Literal["reference", "pallas"]
IMPLS: tuple[str, ...] = ("reference", "pallas")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KVCopyTuning:
    """Triton compiler parameters of the copy kernels (ignored in interpret mode). Compiled,
    num_stages is lowered when the tiles would not fit the GPU's shared memory (fit_copy_tuning)."""

    num_warps: int = 1
    num_stages: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.num_warps, int) or not _is_pow2(self.num_warps):
            raise ValueError(f"KVCopyTuning.num_warps must be a power of two, got {self.num_warps}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"KVCopyTuning.num_stages must be >= 1, got {self.num_stages}")

    def compiler_params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


# ----------------------------------------------------------------------------------------------
# Shared memory budget of the compiled kernels: a model and an upper bound (these kernels have no
# loop to pipeline, so Triton may well keep their tiles in registers)
# ----------------------------------------------------------------------------------------------


def append_shared_memory_bytes(head_dim: int, dtype, tuning: KVCopyTuning) -> int:
    """Bytes of the slot-write kernel behind append_kv and append_kv_chunk: one program loads
    one token's K and V rows ``[H]``, counted once per pipeline stage."""
    return tuning.num_stages * 2 * head_dim * jnp.dtype(dtype).itemsize


def page_copy_shared_memory_bytes(
    page_size: int, head_dim: int, dtype, tuning: KVCopyTuning
) -> int:
    """Bytes of the pack and unpack kernels (the same tiles): one program moves one page of K and
    one of V ``[Z, H]``, counted once per pipeline stage."""
    return tuning.num_stages * 2 * page_size * head_dim * jnp.dtype(dtype).itemsize


def fit_copy_tuning(
    kernel: Literal["append", "page_copy"],
    page_size: int,
    head_dim: int,
    dtype,
    tuning: KVCopyTuning,
    limit: int | None = None,
) -> KVCopyTuning:
    """The tuning a compiled copy kernel runs with: ``tuning`` itself when its tiles fit ``limit``
    bytes of shared memory (default: the first GPU's per-block limit), else fewer pipeline
    stages. The tiles are set by the shapes alone, so if one stage does not fit either this
    raises ValueError naming the tuning field.
    """
    if kernel == "append":
        nbytes = functools.partial(append_shared_memory_bytes, head_dim, dtype)
    elif kernel == "page_copy":
        nbytes = functools.partial(page_copy_shared_memory_bytes, page_size, head_dim, dtype)
    else:
        raise ValueError(f"unknown kernel {kernel!r}; expected 'append' or 'page_copy'")
    limit = shared_memory.device_limit_bytes() if limit is None else limit
    fitted = tuning
    while nbytes(fitted) > limit:
        if fitted.num_stages == 1:
            raise ValueError(
                f"the compiled {kernel} kernel needs {nbytes(fitted)} B of shared memory per "
                f"program with KVCopyTuning.num_stages=1 (Z={page_size}, H={head_dim}, "
                f"{jnp.dtype(dtype).name}), over the {limit} B per-block limit of this GPU; "
                f'use impl="reference"'
            )
        fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
    return fitted


# ----------------------------------------------------------------------------------------------
# Slot writes: the core of append_kv and append_kv_chunk
# ----------------------------------------------------------------------------------------------


def _write_slots_kernel(
    page_ref,  # [1] int32: destination page of this slot
    offset_ref,  # [1] int32: position inside the page
    ok_ref,  # [1] int32: 1 to write, 0 to skip
    new_k_ref,  # [H]: this slot's key for this program's kv head
    new_v_ref,  # [H]
    k_in_ref,  # [P, Z, H]: aliased to k_out_ref, never read
    v_in_ref,  # [P, Z, H]: aliased to v_out_ref, never read
    k_out_ref,  # [P, Z, H]: this kv head's pages
    v_out_ref,  # [P, Z, H]
):
    del k_in_ref, v_in_ref

    @pl.when(ok_ref[0] != 0)
    def _write():
        k_out_ref[page_ref[0], offset_ref[0], :] = new_k_ref[...]
        v_out_ref[page_ref[0], offset_ref[0], :] = new_v_ref[...]


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def _write_slots_pallas(k_pages, v_pages, new_k, new_v, page, offset, ok, *, tuning, interpret):
    num_slots, num_kv_heads, head_dim = new_k.shape
    scalar = pl.BlockSpec((1,), lambda m, k: (m,))
    token = pl.BlockSpec((None, None, head_dim), lambda m, k: (m, k, 0))
    cache = pl.BlockSpec((None, *k_pages.shape[1:]), lambda m, k: (k, 0, 0, 0))
    return pl.pallas_call(
        _write_slots_kernel,
        grid=(num_slots, num_kv_heads),
        in_specs=[scalar, scalar, scalar, token, token, cache, cache],
        out_specs=[cache, cache],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2,
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret,
        compiler_params=tuning.compiler_params(),
        name="dora_kv_write_slots",
    )(page, offset, ok.astype(jnp.int32), new_k, new_v, k_pages, v_pages)


@jax.jit
def _write_slots_reference(k_pages, v_pages, new_k, new_v, page, offset, ok):
    page = jnp.where(ok, page, k_pages.shape[1])  # an out-of-bounds page: dropped by the scatter
    offset = jnp.where(ok, offset, 0)
    k_pages = k_pages.at[:, page, offset].set(jnp.swapaxes(new_k, 0, 1), mode="drop")
    v_pages = v_pages.at[:, page, offset].set(jnp.swapaxes(new_v, 0, 1), mode="drop")
    return k_pages, v_pages


def _write_slots(k_pages, v_pages, new_k, new_v, page, offset, ok, impl, interpret, tuning):
    """Writes new_k/new_v [M, K, H] to (page, offset) [M] where ok [M]; skips out-of-range slots."""
    _, total_pages, page_size, head_dim = k_pages.shape
    ok = ok & (page >= 0) & (page < total_pages) & (offset >= 0) & (offset < page_size)
    if impl == "reference":
        return _write_slots_reference(k_pages, v_pages, new_k, new_v, page, offset, ok)
    if not interpret:
        if not _is_pow2(head_dim):
            raise ValueError(f"the compiled kernel needs a power-of-two H, got H={head_dim}")
        tuning = fit_copy_tuning("append", page_size, head_dim, k_pages.dtype, tuning)
    return _write_slots_pallas(
        k_pages, v_pages, new_k, new_v, page, offset, ok, tuning=tuning, interpret=interpret
    )


# ----------------------------------------------------------------------------------------------
# Public append API
# ----------------------------------------------------------------------------------------------


def _check_impl(impl: str, tuning: KVCopyTuning | None) -> KVCopyTuning:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if tuning is None:
        return KVCopyTuning()
    if not isinstance(tuning, KVCopyTuning):
        raise ValueError(f"tuning must be a KVCopyTuning, got {type(tuning).__name__}")
    return tuning


def _check_pages(k_pages: jax.Array, v_pages: jax.Array, ndim: int, layout: str) -> None:
    if k_pages.ndim != ndim:
        raise ValueError(f"k_pages must be {layout}, got shape {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ in dtype")


def _check_block_tables(block_tables: jax.Array, batch: int) -> None:
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [B={batch}, pages_per_seq], got {block_tables.shape}"
        )
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")


def _check_vector(name: str, x: jax.Array, batch: int, dtype) -> None:
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {x.shape}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")


def _check_new_kv(new_k, new_v, k_pages, shape: tuple[int, ...], layout: str) -> None:
    if new_k.shape != shape:
        raise ValueError(f"new_k must be {layout} = {shape}, got {new_k.shape}")
    if new_v.shape != new_k.shape:
        raise ValueError(f"new_v {new_v.shape} and new_k {new_k.shape} differ in shape")
    if new_k.dtype != k_pages.dtype or new_v.dtype != k_pages.dtype:
        raise ValueError(
            f"new_k/new_v dtypes ({new_k.dtype}, {new_v.dtype}) must equal the cache dtype "
            f"{k_pages.dtype}"
        )


def append_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_page: jax.Array,
    slot_offset: jax.Array,
    active: jax.Array | None = None,
    *,
    impl: Impl,
    interpret: bool = False,
    tuning: KVCopyTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes one decode step's K/V: new_k[b] goes to k_pages[:, slot_page[b], slot_offset[b]].

    Args:
      k_pages, v_pages: [K, P, Z, H] one layer's cache (donate it in the caller's jit).
      new_k, new_v: [B, K, H], same dtype as the cache.
      slot_page, slot_offset: int32[B], page id and position inside the page of each row.
      active: bool[B]; rows with False write nothing. None means all rows are active.

    Returns:
      The updated (k_pages, v_pages).
    """
    tuning = _check_impl(impl, tuning)
    _check_pages(k_pages, v_pages, 4, "[K, P, Z, H]")
    if new_k.ndim != 3:
        raise ValueError(f"new_k must be [B, K, H], got shape {new_k.shape}")
    batch = new_k.shape[0]
    num_kv_heads, _, _, head_dim = k_pages.shape
    _check_new_kv(new_k, new_v, k_pages, (batch, num_kv_heads, head_dim), "[B, K, H]")
    _check_vector("slot_page", slot_page, batch, jnp.int32)
    _check_vector("slot_offset", slot_offset, batch, jnp.int32)
    if active is None:
        active = jnp.ones((batch,), jnp.bool_)
    _check_vector("active", active, batch, jnp.bool_)
    return _write_slots(
        k_pages, v_pages, new_k, new_v, slot_page, slot_offset, active, impl, interpret, tuning
    )


def append_kv_chunk(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    block_tables: jax.Array,
    start: jax.Array,
    num_valid: jax.Array,
    *,
    impl: Impl,
    interpret: bool = False,
    tuning: KVCopyTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes a prefill chunk: token t of row b goes to position start[b] + t of that sequence.

    Only tokens t < num_valid[b] are written (num_valid[b] = 0 marks an inactive row); positions
    past the block table (pages_per_seq * Z) are skipped.

    Args:
      k_pages, v_pages: [K, P, Z, H] one layer's cache.
      new_k, new_v: [B, T, K, H], same dtype as the cache.
      block_tables: int32[B, pages_per_seq], the page ids of each sequence.
      start: int32[B], position of the chunk's first token.
      num_valid: int32[B], tokens of the chunk to write.

    Returns:
      The updated (k_pages, v_pages).
    """
    tuning = _check_impl(impl, tuning)
    _check_pages(k_pages, v_pages, 4, "[K, P, Z, H]")
    if new_k.ndim != 4:
        raise ValueError(f"new_k must be [B, T, K, H], got shape {new_k.shape}")
    batch, chunk = new_k.shape[:2]
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    _check_new_kv(new_k, new_v, k_pages, (batch, chunk, num_kv_heads, head_dim), "[B, T, K, H]")
    _check_block_tables(block_tables, batch)
    _check_vector("start", start, batch, jnp.int32)
    _check_vector("num_valid", num_valid, batch, jnp.int32)

    pages_per_seq = block_tables.shape[1]
    t = jnp.arange(chunk, dtype=jnp.int32)
    pos = start[:, None] + t[None, :]  # [B, T]
    page_index = pos // page_size
    ok = (t[None, :] < num_valid[:, None]) & (pos >= 0) & (page_index < pages_per_seq)
    page = jnp.take_along_axis(block_tables, jnp.clip(page_index, 0, pages_per_seq - 1), axis=1)
    slots = batch * chunk
    return _write_slots(
        k_pages,
        v_pages,
        new_k.reshape(slots, num_kv_heads, head_dim),
        new_v.reshape(slots, num_kv_heads, head_dim),
        page.reshape(slots),
        (pos % page_size).reshape(slots),
        ok.reshape(slots),
        impl,
        interpret,
        tuning,
    )


# ----------------------------------------------------------------------------------------------
# Page pack / unpack (migration between caches)
# ----------------------------------------------------------------------------------------------


def _pack_kernel(
    page_ref,  # [1] int32: source page id (already clipped into range)
    k_ref,  # [P, Z, H]: pages of this program's layer and kv head
    v_ref,  # [P, Z, H]
    out_ref,  # [2, Z, H]: buffer[:, layer, kv head, j]
):
    out_ref[0] = k_ref[page_ref[0]]
    out_ref[1] = v_ref[page_ref[0]]


def _unpack_kernel(
    page_ref,  # [1] int32: destination page id
    ok_ref,  # [1] int32: 1 to write, 0 to skip (out-of-range id)
    buf_ref,  # [2, Z, H]: buffer[:, layer, kv head, j]
    k_in_ref,  # [P, Z, H]: aliased to k_out_ref, never read
    v_in_ref,  # [P, Z, H]: aliased to v_out_ref, never read
    k_out_ref,  # [P, Z, H]: pages of this program's layer and kv head
    v_out_ref,  # [P, Z, H]
):
    del k_in_ref, v_in_ref

    @pl.when(ok_ref[0] != 0)
    def _write():
        k_out_ref[page_ref[0]] = buf_ref[0]
        v_out_ref[page_ref[0]] = buf_ref[1]


def _specs(k_pages: jax.Array):
    layers, num_kv_heads, _, page_size, head_dim = k_pages.shape
    scalar = pl.BlockSpec((1,), lambda l, k, j: (j,))
    cache = pl.BlockSpec((None, None, *k_pages.shape[2:]), lambda l, k, j: (l, k, 0, 0, 0))
    buf = pl.BlockSpec(
        (2, None, None, None, page_size, head_dim), lambda l, k, j: (0, l, k, j, 0, 0)
    )
    return (layers, num_kv_heads), scalar, cache, buf


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def _pack_pallas(k_pages, v_pages, page_ids, *, tuning, interpret):
    grid_lk, scalar, cache, buf = _specs(k_pages)
    layers, num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
    n = page_ids.shape[0]
    return pl.pallas_call(
        _pack_kernel,
        grid=(*grid_lk, n),
        in_specs=[scalar, cache, cache],
        out_specs=buf,
        out_shape=jax.ShapeDtypeStruct(
            (2, layers, num_kv_heads, n, page_size, head_dim), k_pages.dtype
        ),
        interpret=interpret,
        compiler_params=tuning.compiler_params(),
        name="dora_kv_pack_pages",
    )(jnp.clip(page_ids, 0, total_pages - 1), k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def _unpack_pallas(k_pages, v_pages, buffer, page_ids, *, tuning, interpret):
    grid_lk, scalar, cache, buf = _specs(k_pages)
    ok = ((page_ids >= 0) & (page_ids < k_pages.shape[2])).astype(jnp.int32)
    return pl.pallas_call(
        _unpack_kernel,
        grid=(*grid_lk, page_ids.shape[0]),
        in_specs=[scalar, scalar, buf, cache, cache],
        out_specs=[cache, cache],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=tuning.compiler_params(),
        name="dora_kv_unpack_pages",
    )(page_ids, ok, buffer, k_pages, v_pages)


@jax.jit
def pack_pages_reference(k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array) -> jax.Array:
    """jnp gather of pages `page_ids` (clipped into [0, P)) into a [2, L, K, n, Z, H] buffer."""
    ids = jnp.clip(page_ids, 0, k_pages.shape[2] - 1)
    return jnp.stack([k_pages[:, :, ids], v_pages[:, :, ids]])


@jax.jit
def unpack_pages_reference(
    k_pages: jax.Array, v_pages: jax.Array, buffer: jax.Array, page_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """jnp scatter of a [2, L, K, n, Z, H] buffer into pages `page_ids` (out-of-range skipped)."""
    total_pages = k_pages.shape[2]
    ids = jnp.where((page_ids >= 0) & (page_ids < total_pages), page_ids, total_pages)
    k_pages = k_pages.at[:, :, ids].set(buffer[0], mode="drop")
    v_pages = v_pages.at[:, :, ids].set(buffer[1], mode="drop")
    return k_pages, v_pages


def _check_page_copy(impl: str, tuning, k_pages, v_pages, page_ids: jax.Array) -> KVCopyTuning:
    """The checks of pack_pages and unpack_pages; returns the tuning (default if None)."""
    tuning = _check_impl(impl, tuning)
    _check_pages(k_pages, v_pages, 5, "[L, K, P, Z, H]")
    if page_ids.ndim != 1:
        raise ValueError(f"page_ids must be 1-D [n], got shape {page_ids.shape}")
    if page_ids.dtype != jnp.int32:
        raise ValueError(f"page_ids must be int32, got {page_ids.dtype}")
    return tuning


def _compiled_page_copy_tuning(
    k_pages: jax.Array, interpret: bool, tuning: KVCopyTuning
) -> KVCopyTuning:
    """The shape rule of the compiled pack/unpack kernels, and their tuning fitted to the GPU's
    shared memory (unchanged in interpret mode)."""
    if interpret:
        return tuning
    page_size, head_dim = k_pages.shape[-2:]
    if not _is_pow2(page_size * head_dim):
        raise ValueError(
            f"the compiled kernel needs a power-of-two Z * H, got {page_size * head_dim}"
        )
    return fit_copy_tuning("page_copy", page_size, head_dim, k_pages.dtype, tuning)


def pack_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_ids: jax.Array,
    *,
    impl: Impl,
    interpret: bool = False,
    tuning: KVCopyTuning | None = None,
) -> jax.Array:
    """Gathers pages `page_ids` of every layer into one buffer.

    Args:
      k_pages, v_pages: [L, K, P, Z, H] the whole (multi-layer) cache.
      page_ids: int32[n] page ids to gather, in the order the pages appear in the buffer.

    Returns:
      buffer [2, L, K, n, Z, H]: buffer[0, l, k, j] = k_pages[l, k, page_ids[j]], buffer[1] the same
      for v_pages.
    """
    tuning = _check_page_copy(impl, tuning, k_pages, v_pages, page_ids)
    if impl == "reference" or page_ids.shape[0] == 0:
        return pack_pages_reference(k_pages, v_pages, page_ids)
    tuning = _compiled_page_copy_tuning(k_pages, interpret, tuning)
    return _pack_pallas(k_pages, v_pages, page_ids, tuning=tuning, interpret=interpret)


def unpack_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    buffer: jax.Array,
    page_ids: jax.Array,
    *,
    impl: Impl,
    interpret: bool = False,
    tuning: KVCopyTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatters a pack_pages buffer into pages `page_ids` (distinct, freshly allocated) of a cache.

    Args:
      k_pages, v_pages: [L, K, P, Z, H] destination cache (donate it in the caller's jit).
      buffer: [2, L, K, n, Z, H] from pack_pages, same dtype as the cache.
      page_ids: int32[n], destination page of each buffer page.

    Returns:
      The updated (k_pages, v_pages); pages not in page_ids are unchanged.
    """
    tuning = _check_page_copy(impl, tuning, k_pages, v_pages, page_ids)
    layers, num_kv_heads, _, page_size, head_dim = k_pages.shape
    expected = (2, layers, num_kv_heads, page_ids.shape[0], page_size, head_dim)
    if buffer.shape != expected:
        raise ValueError(f"buffer must be [2, L, K, n, Z, H] = {expected}, got {buffer.shape}")
    if buffer.dtype != k_pages.dtype:
        raise ValueError(
            f"buffer dtype {buffer.dtype} differs from the cache dtype {k_pages.dtype}"
        )
    if impl == "reference" or page_ids.shape[0] == 0:
        return unpack_pages_reference(k_pages, v_pages, buffer, page_ids)
    tuning = _compiled_page_copy_tuning(k_pages, interpret, tuning)
    return _unpack_pallas(k_pages, v_pages, buffer, page_ids, tuning=tuning, interpret=interpret)
