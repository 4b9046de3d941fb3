"""KV append (decode step and prefill chunk) and page pack/unpack, both impls vs NumPy oracles."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.kernels.kv_cache_ops import (
    IMPLS,
    KVCopyTuning,
    append_kv,
    append_kv_chunk,
    pack_pages,
    unpack_pages,
)
from dora_jax.kernels.paged_attention import paged_decode_attention

DTYPES = [jnp.float32, jnp.bfloat16]
K, P, Z, H = 2, 10, 4, 8  # kv heads, pages, page size, head dim


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def kv_cache(seed, dtype, layers=None):
    rng = np.random.default_rng(seed)
    shape = (K, P, Z, H) if layers is None else (layers, K, P, Z, H)
    return rand(rng, shape, dtype), rand(rng, shape, dtype)


def as_np(x):
    return np.array(jnp.asarray(x, jnp.float32))  # a writable copy


def run(fn, *args, impl, **kw):
    return fn(*args, impl=impl, interpret=True, **kw)


# ---------------------------------------------------------------------------------------------
# append_kv (one decode step)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_append_kv_matches_oracle(impl, dtype):
    rng = np.random.default_rng(1)
    k_pages, v_pages = kv_cache(0, dtype)
    batch = 5
    new_k, new_v = rand(rng, (batch, K, H), dtype), rand(rng, (batch, K, H), dtype)
    slot_page = np.array([3, 7, 9, P, 2], np.int32)  # row 3: page out of range -> skipped
    slot_offset = np.array([1, 0, 3, 0, Z], np.int32)  # row 4: offset out of range -> skipped
    active = np.array([True, False, True, True, True])  # row 1 inactive

    expected_k, expected_v = as_np(k_pages), as_np(v_pages)
    for b in (0, 2):
        expected_k[:, slot_page[b], slot_offset[b]] = as_np(new_k[b])
        expected_v[:, slot_page[b], slot_offset[b]] = as_np(new_v[b])

    out_k, out_v = run(
        append_kv,
        k_pages,
        v_pages,
        new_k,
        new_v,
        jnp.asarray(slot_page),
        jnp.asarray(slot_offset),
        jnp.asarray(active),
        impl=impl,
    )
    assert out_k.dtype == dtype and out_k.shape == k_pages.shape
    np.testing.assert_array_equal(as_np(out_k), expected_k)
    np.testing.assert_array_equal(as_np(out_v), expected_v)
    # The inactive row's slot is untouched.
    np.testing.assert_array_equal(as_np(out_k[:, 7, 0]), as_np(k_pages[:, 7, 0]))


def test_append_kv_active_default_is_all_rows():
    k_pages, v_pages = kv_cache(0, jnp.float32)
    new = jnp.ones((2, K, H), jnp.float32)
    pages, offsets = jnp.array([1, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
    for impl in IMPLS:
        out_k, _ = run(append_kv, k_pages, v_pages, new, new, pages, offsets, impl=impl)
        assert np.all(as_np(out_k[:, 1, 0]) == 1.0) and np.all(as_np(out_k[:, 2, 3]) == 1.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_append_kv_donated_cache_is_aliased(impl):
    """Jitted with the cache donated, the update reuses the cache buffers (no copy warning)."""
    k_pages, v_pages = kv_cache(0, jnp.float32)
    new = jnp.ones((2, K, H), jnp.float32)
    step = jax.jit(functools.partial(append_kv, impl=impl, interpret=True), donate_argnums=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
        out_k, _ = step(
            k_pages, v_pages, new, new, jnp.array([1, 2], jnp.int32), jnp.array([0, 1], jnp.int32)
        )
        out_k.block_until_ready()
    assert k_pages.is_deleted() and v_pages.is_deleted()


# ---------------------------------------------------------------------------------------------
# append_kv_chunk (prefill chunk)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_append_kv_chunk_matches_oracle(impl, dtype):
    rng = np.random.default_rng(2)
    k_pages, v_pages = kv_cache(3, dtype)
    batch, chunk = 4, 6
    new_k, new_v = rand(rng, (batch, chunk, K, H), dtype), rand(rng, (batch, chunk, K, H), dtype)
    tables = np.array([[4, 1, 8], [2, 6, 0], [5, 9, 3], [7, 0, 0]], np.int32)
    start = np.array([2, 0, 9, 3], np.int32)  # row 0 crosses a page; row 2 runs past its table
    num_valid = np.array([6, 3, 6, 0], np.int32)  # row 1 partly valid; row 3 inactive

    expected_k, expected_v = as_np(k_pages), as_np(v_pages)
    for b in range(batch):
        for t in range(num_valid[b]):
            pos = start[b] + t
            if pos // Z >= tables.shape[1]:
                continue
            page, offset = tables[b, pos // Z], pos % Z
            expected_k[:, page, offset] = as_np(new_k[b, t])
            expected_v[:, page, offset] = as_np(new_v[b, t])

    out_k, out_v = run(
        append_kv_chunk,
        k_pages,
        v_pages,
        new_k,
        new_v,
        jnp.asarray(tables),
        jnp.asarray(start),
        jnp.asarray(num_valid),
        impl=impl,
    )
    np.testing.assert_array_equal(as_np(out_k), expected_k)
    np.testing.assert_array_equal(as_np(out_v), expected_v)
    np.testing.assert_array_equal(as_np(out_k[:, 7]), as_np(k_pages[:, 7]))  # inactive row 3


@pytest.mark.parametrize("impl", IMPLS)
def test_chunks_then_decode_append_give_dense_attention(impl):
    """Prefill two chunks and one decode token through the paged cache; attention over it must
    equal dense attention over the same tokens."""
    rng = np.random.default_rng(4)
    k_pages = jnp.zeros((K, P, Z, H), jnp.float32)
    v_pages = jnp.zeros((K, P, Z, H), jnp.float32)
    tables = jnp.array([[3, 8, 1], [6, 2, 0]], jnp.int32)
    keys, values = rand(rng, (2, 9, K, H), jnp.float32), rand(rng, (2, 9, K, H), jnp.float32)
    lengths = np.array([9, 6], np.int32)  # row 1 stops after its first chunk and decode token
    append = functools.partial(append_kv_chunk, impl=impl, interpret=True)
    k_pages, v_pages = append(
        k_pages,
        v_pages,
        keys[:, :5],
        values[:, :5],
        tables,
        jnp.array([0, 0], jnp.int32),
        jnp.array([5, 5], jnp.int32),
    )
    k_pages, v_pages = append(
        k_pages,
        v_pages,
        keys[:, 5:8],
        values[:, 5:8],
        tables,
        jnp.array([5, 5], jnp.int32),
        jnp.array([3, 0], jnp.int32),
    )
    pos = lengths - 1  # the decode token of each row
    k_pages, v_pages = append_kv(
        k_pages,
        v_pages,
        keys[jnp.arange(2), pos],
        values[jnp.arange(2), pos],
        tables[jnp.arange(2), pos // Z],
        jnp.asarray(pos % Z),
        impl=impl,
        interpret=True,
    )
    q = rand(rng, (2, 2 * K, H), jnp.float32)
    out = paged_decode_attention(
        q, k_pages, v_pages, tables, jnp.asarray(lengths), impl="reference"
    )
    for b in range(2):
        kk, vv = np.asarray(keys[b, : lengths[b]]), np.asarray(values[b, : lengths[b]])
        for n in range(2 * K):
            logits = kk[:, n // 2] @ np.asarray(q[b, n]) / np.sqrt(H)
            w = np.exp(logits - logits.max())
            np.testing.assert_allclose(
                np.asarray(out[b, n]), (w / w.sum()) @ vv[:, n // 2], atol=1e-5
            )


# ---------------------------------------------------------------------------------------------
# pack_pages / unpack_pages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_pack_unpack_round_trip(impl, dtype):
    layers = 3
    src_k, src_v = kv_cache(5, dtype, layers)
    dst_k, dst_v = kv_cache(6, dtype, layers)
    src_ids = np.array([4, 1, 7], np.int32)
    dst_ids = np.array([2, 9, 5], np.int32)

    buffer = run(pack_pages, src_k, src_v, jnp.asarray(src_ids), impl=impl)
    assert buffer.shape == (2, layers, K, 3, Z, H) and buffer.dtype == dtype
    for j, page in enumerate(src_ids):  # documented layout: [2, L, K, n, Z, H]
        np.testing.assert_array_equal(as_np(buffer[0, :, :, j]), as_np(src_k[:, :, page]))
        np.testing.assert_array_equal(as_np(buffer[1, :, :, j]), as_np(src_v[:, :, page]))

    out_k, out_v = run(unpack_pages, dst_k, dst_v, buffer, jnp.asarray(dst_ids), impl=impl)
    np.testing.assert_array_equal(as_np(out_k[:, :, dst_ids]), as_np(src_k[:, :, src_ids]))
    np.testing.assert_array_equal(as_np(out_v[:, :, dst_ids]), as_np(src_v[:, :, src_ids]))
    others = np.setdiff1d(np.arange(P), dst_ids)
    np.testing.assert_array_equal(as_np(out_k[:, :, others]), as_np(dst_k[:, :, others]))
    np.testing.assert_array_equal(as_np(out_v[:, :, others]), as_np(dst_v[:, :, others]))


@pytest.mark.parametrize("impl", IMPLS)
def test_unpack_skips_out_of_range_ids_and_pack_handles_empty(impl):
    dst_k, dst_v = kv_cache(7, jnp.float32, 2)
    buffer = jnp.ones((2, 2, K, 3, Z, H), jnp.float32)
    out_k, out_v = run(
        unpack_pages, dst_k, dst_v, buffer, jnp.array([P, 3, -1], jnp.int32), impl=impl
    )
    expected_k = as_np(dst_k)
    expected_k[:, :, 3] = 1.0
    np.testing.assert_array_equal(as_np(out_k), expected_k)
    empty = run(pack_pages, dst_k, dst_v, jnp.zeros((0,), jnp.int32), impl=impl)
    assert empty.shape == (2, 2, K, 0, Z, H)


def test_kv_copy_tuning_validation():
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        KVCopyTuning(num_warps=3)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        KVCopyTuning(num_stages=0)


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _bad_append():
    k, v = kv_cache(0, jnp.float32)
    new = jnp.zeros((2, K, H), jnp.float32)
    page, off = jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32)
    return {
        "cache rank": ((k[0], v[0], new, new, page, off), "k_pages must be"),
        "kv shape": ((k, v[:1], new, new, page, off), "differ in shape"),
        "new shape": ((k, v, new[:, :1], new[:, :1], page, off), "new_k must be"),
        "new dtype": ((k, v, new.astype(jnp.bfloat16), new, page, off), "cache dtype"),
        "page dtype": ((k, v, new, new, page.astype(jnp.float32), off), "slot_page must be int32"),
        "offset shape": ((k, v, new, new, page, off[:1]), "slot_offset must have shape"),
        "active dtype": ((k, v, new, new, page, off, page), "active must be bool"),
    }


@pytest.mark.parametrize("name", list(_bad_append()))
def test_append_kv_bad_inputs_raise(name):
    args, match = _bad_append()[name]
    with pytest.raises(ValueError, match=match):
        append_kv(*args, impl="pallas", interpret=True)


def test_append_kv_chunk_bad_inputs_raise():
    k, v = kv_cache(0, jnp.float32)
    new = jnp.zeros((2, 3, K, H), jnp.float32)
    tables, vec = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"new_k must be \[B, T, K, H\]"):
        append_kv_chunk(k, v, new[0], new[0], tables, vec, vec, impl="reference")
    with pytest.raises(ValueError, match="block_tables must be"):
        append_kv_chunk(k, v, new, new, tables[:1], vec, vec, impl="reference")
    with pytest.raises(ValueError, match="num_valid must have shape"):
        append_kv_chunk(k, v, new, new, tables, vec, vec[:1], impl="reference")


def test_pack_unpack_bad_inputs_raise():
    k, v = kv_cache(0, jnp.float32, 2)
    ids = jnp.array([1, 2], jnp.int32)
    buffer = pack_pages(k, v, ids, impl="reference")
    with pytest.raises(ValueError, match=r"\[L, K, P, Z, H\]"):
        pack_pages(k[0], v[0], ids, impl="reference")
    with pytest.raises(ValueError, match="page_ids must be int32"):
        pack_pages(k, v, ids.astype(jnp.float32), impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="page_ids must be 1-D"):
        pack_pages(k, v, ids[None], impl="reference")
    with pytest.raises(ValueError, match="buffer must be"):
        unpack_pages(k, v, buffer[:, :, :, :1], ids, impl="reference")
    with pytest.raises(ValueError, match="buffer dtype"):
        unpack_pages(k, v, buffer.astype(jnp.bfloat16), ids, impl="reference")
    with pytest.raises(ValueError, match="unknown impl"):
        unpack_pages(k, v, buffer, ids, impl="xla")
    with pytest.raises(ValueError, match="tuning must be a KVCopyTuning"):
        pack_pages(k, v, ids, impl="pallas", tuning=object())
