"""Paged decode attention: reference vs a NumPy oracle, Pallas (interpret mode) vs reference."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.kernels.paged_attention import (
    PagedAttentionTuning,
    paged_decode_attention,
    paged_decode_attention_reference,
)

# Tolerances per dtype, compared after casting both sides to float32. Never loosen these.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(
    seed: int,
    *,
    batch: int = 3,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    page_size: int = 8,
    pages_per_seq: int = 4,
    lengths: tuple[int, ...] | None = None,
    dtype=jnp.float32,
    garbage: float | None = None,
):
    """Random q/pages; block tables are a shuffled set of distinct pages, padded with page 0.

    With `garbage`, page 0 and every slot past a sequence's length hold that value (e.g. NaN).
    """
    rng = np.random.default_rng(seed)
    seq = pages_per_seq * page_size
    if lengths is None:
        # Not multiples of the page size, plus an empty and a full sequence.
        lengths = tuple(int(x) for x in rng.integers(1, seq, size=batch))
    assert len(lengths) == batch
    total_pages = batch * pages_per_seq + 3  # page 0 is padding; a few pages stay unused
    perm = rng.permutation(np.arange(1, total_pages))
    tables = np.zeros((batch, pages_per_seq), np.int32)
    k = rng.standard_normal((num_kv_heads, total_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, total_pages, page_size, head_dim)).astype(np.float32)
    used = 0
    for b, length in enumerate(lengths):
        n_pages = -(-length // page_size)
        tables[b, :n_pages] = perm[used : used + n_pages]
        used += n_pages
        if garbage is not None:
            for s in range(length, n_pages * page_size):
                k[:, tables[b, s // page_size], s % page_size] = garbage
                v[:, tables[b, s // page_size], s % page_size] = garbage
    if garbage is not None:
        k[:, 0] = garbage
        v[:, 0] = garbage
    q = rng.standard_normal((batch, num_kv_heads * group, head_dim)).astype(np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(tables),
        jnp.asarray(np.array(lengths, np.int32)),
    )


def numpy_oracle(q, k_pages, v_pages, block_tables, lengths, scale=None, window=None) -> np.ndarray:
    """Dense float64 attention over each sequence's K/V gathered token by token; with a sliding
    ``window`` (per row, 0: none) only the last ``window`` tokens of each sequence."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    block_tables, lengths = np.asarray(block_tables), np.asarray(lengths)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros_like(q)
    for b in range(batch):
        length = int(lengths[b])
        if length == 0:
            continue
        w = 0 if window is None else int(np.broadcast_to(window, lengths.shape)[b])
        first = max(length - w, 0) if w > 0 else 0
        pages = [block_tables[b, s // page_size] for s in range(first, length)]
        offsets = [s % page_size for s in range(first, length)]
        for n in range(num_heads):
            kv = n // group
            keys = k_pages[kv, pages, offsets]  # [length, H]
            values = v_pages[kv, pages, offsets]
            logits = keys @ q[b, n] * scale
            w = np.exp(logits - logits.max())
            out[b, n] = (w / w.sum()) @ values
    return out


def assert_close(actual, expected, dtype) -> None:
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        **TOL[dtype],
    )


def run_pallas(args, tuning=None, scale=None):
    return paged_decode_attention(*args, impl="pallas", interpret=True, tuning=tuning, scale=scale)


# ---------------------------------------------------------------------------------------------
# Reference vs the NumPy oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group,page_size,lengths,scale",
    [(1, 8, (13, 0, 32), None), (4, 16, (1, 47, 20), 0.3)],
)
def test_reference_matches_numpy_oracle(group, page_size, lengths, scale):
    args = make_case(0, group=group, page_size=page_size, lengths=lengths)
    out = paged_decode_attention(*args, impl="reference", scale=scale)
    np.testing.assert_allclose(np.asarray(out), numpy_oracle(*args, scale=scale), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Pallas (interpret mode) vs reference
# ---------------------------------------------------------------------------------------------

# Each GQA ratio, page size and dtype appears at least once; the full product is marked slow.
COVERING = [
    (1, 8, jnp.float32),
    (2, 16, jnp.bfloat16),
    (4, 32, jnp.float32),
    (8, 8, jnp.bfloat16),
    (2, 32, jnp.float32),
    (8, 16, jnp.float32),
    (1, 32, jnp.bfloat16),
    (4, 8, jnp.bfloat16),
]


@pytest.mark.parametrize("group,page_size,dtype", COVERING)
def test_pallas_matches_reference(group, page_size, dtype):
    args = make_case(group * 100 + page_size, group=group, page_size=page_size, dtype=dtype)
    expected = paged_decode_attention(*args, impl="reference")
    out = run_pallas(args)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert_close(out, expected, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    "group,page_size,dtype,k_splits",
    list(itertools.product((1, 2, 4, 8), (8, 16, 32), (jnp.float32, jnp.bfloat16), (1, 2))),
)
def test_pallas_matches_reference_sweep(group, page_size, dtype, k_splits):
    args = make_case(
        7, batch=4, group=group, page_size=page_size, pages_per_seq=5, dtype=dtype, head_dim=32
    )
    tuning = PagedAttentionTuning(pages_per_compute_block=2, k_splits=k_splits)
    assert_close(run_pallas(args, tuning), paged_decode_attention(*args, impl="reference"), dtype)


@pytest.mark.parametrize(
    "tuning",
    [
        PagedAttentionTuning(pages_per_compute_block=1, block_h=4, k_splits=2),
        PagedAttentionTuning(pages_per_compute_block=2, block_h=8, k_splits=4),
    ],
    ids=["ppcb1-bh4-ks2", "ppcb2-bh8-ks4"],
)
def test_pallas_tuning_variants(tuning):
    # group 8 with block_h 4 gives two head blocks; k_splits leaves some splits empty.
    args = make_case(3, group=8, page_size=8, pages_per_seq=6, lengths=(5, 48, 17))
    assert_close(
        run_pallas(args, tuning), paged_decode_attention(*args, impl="reference"), jnp.float32
    )


def test_pallas_qwen_like_shape():
    """GQA 7 (14 q heads over 2 kv heads, as in Qwen2.5-0.5B), H 64, bf16, two splits."""
    args = make_case(
        10, batch=5, group=7, head_dim=64, page_size=16, pages_per_seq=6, dtype=jnp.bfloat16
    )
    tuning = PagedAttentionTuning(pages_per_compute_block=2, k_splits=2)
    expected = paged_decode_attention(*args, impl="reference")
    assert_close(run_pallas(args, tuning), expected, jnp.bfloat16)


def test_pallas_custom_scale_and_jit():
    args = make_case(4, group=2, page_size=16)
    fn = jax.jit(
        functools.partial(paged_decode_attention, impl="pallas", interpret=True, scale=0.7)
    )
    assert_close(fn(*args), numpy_oracle(*args, scale=0.7), jnp.float32)


def test_zero_length_rows_give_zeros():
    args = make_case(5, lengths=(0, 9, 0))
    for impl in ("reference", "pallas"):
        out = np.asarray(paged_decode_attention(*args, impl=impl, interpret=True))
        assert np.all(out[[0, 2]] == 0.0), impl
        assert np.all(np.isfinite(out)), impl


def test_slots_past_length_are_ignored_even_if_nan():
    lengths = (13, 0, 30)
    clean = make_case(6, group=2, page_size=8, lengths=lengths)
    dirty = make_case(6, group=2, page_size=8, lengths=lengths, garbage=np.nan)
    expected = numpy_oracle(*clean)
    for impl in ("reference", "pallas"):
        out = paged_decode_attention(*dirty, impl=impl, interpret=True)
        assert np.all(np.isfinite(np.asarray(out))), impl
        assert_close(out, expected, jnp.float32)


def test_last_valid_token_matters():
    """Guards against an off-by-one in the length mask: token length - 1 changes the output."""
    q, k, v, tables, lengths = make_case(8, lengths=(13, 9, 30))
    page, offset = int(tables[0, 12 // 8]), 12 % 8
    v2 = v.at[:, page, offset].add(5.0)
    for impl in ("reference", "pallas"):
        a = paged_decode_attention(q, k, v, tables, lengths, impl=impl, interpret=True)
        b = paged_decode_attention(q, k, v2, tables, lengths, impl=impl, interpret=True)
        assert np.abs(np.asarray(a[0] - b[0])).min() > 1e-3, impl
        np.testing.assert_array_equal(np.asarray(a[1:]), np.asarray(b[1:]))


def test_jax_gpu_impl_matches_reference():
    args = make_case(9, group=4, page_size=16, lengths=(0, 33, 64))
    expected = paged_decode_attention(*args, impl="reference")
    out = paged_decode_attention(*args, impl="jax_gpu", interpret=True)
    assert_close(out, expected, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _bad_inputs():
    q, k, v, t, n = make_case(0)
    return {
        "q rank": ((q[0], k, v, t, n), "q must be"),
        "kv shape": ((q, k, v[:, :-1], t, n), "differ in shape"),
        "kv dtype": ((q, k, v.astype(jnp.bfloat16), t, n), "differ in dtype"),
        "q dtype": ((q.astype(jnp.bfloat16), k, v, t, n), "q dtype"),
        "head dim": ((q[..., :8], k, v, t, n), "head dim"),
        "gqa": ((q[:, :3], k, v, t, n), "N % K"),
        "tables batch": ((q, k, v, t[:2], n), "block_tables must be"),
        "tables dtype": ((q, k, v, t.astype(jnp.int16), n), "block_tables must be int32"),
        "lengths shape": ((q, k, v, t, n[:2]), "lengths must be"),
        "lengths dtype": ((q, k, v, t, n.astype(jnp.float32)), "lengths must be int32"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_inputs_raise(name):
    args, match = _bad_inputs()[name]
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*args, impl="pallas", interpret=True)


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="unknown impl"):
        paged_decode_attention(*make_case(0), impl="triton")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pages_per_compute_block=3), "pages_per_compute_block must be a power of two"),
        (dict(block_h=0), "block_h must be a power of two"),
        (dict(k_splits=6), "k_splits must be a power of two"),
        (dict(num_stages=0), "num_stages must be >= 1"),
    ],
)
def test_tuning_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedAttentionTuning(**kwargs)


def test_compiled_kernel_shape_rules_checked_before_lowering():
    # H = 24 is not a power of two: the Triton lowering could not tile it.
    args = make_case(0, head_dim=24)
    with pytest.raises(ValueError, match="power-of-two H"):
        paged_decode_attention(*args, impl="pallas", interpret=False)
    with pytest.raises(ValueError, match="block_h >= 16"):
        paged_decode_attention(*make_case(0), impl="pallas", tuning=PagedAttentionTuning(block_h=8))
    with pytest.raises(ValueError, match="16 kv tokens per compute block"):
        paged_decode_attention(
            *make_case(0, page_size=8, pages_per_seq=4),
            impl="pallas",
            tuning=PagedAttentionTuning(k_splits=4),
        )
    # The reference accepts any head dim.
    out = paged_decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(out), numpy_oracle(*args), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize(
    "window,tuning",
    [
        (1, PagedAttentionTuning(pages_per_compute_block=1, block_h=4)),
        (5, PagedAttentionTuning(pages_per_compute_block=1, block_h=4, k_splits=2)),
        (12, PagedAttentionTuning(pages_per_compute_block=2, block_h=4)),
        ((3, 0, 9, 40), PagedAttentionTuning(pages_per_compute_block=1, block_h=4, k_splits=4)),
        (64, PagedAttentionTuning(block_h=4)),
    ],
)
def test_windowed_decode_matches_numpy_oracle(impl, window, tuning):
    """Only the last ``window`` tokens count; windows shorter than a page, across pages, per row
    (0: none) and longer than the sequence; compute blocks and splits before the window are
    skipped by the kernel."""
    args = make_case(11, batch=4, lengths=(29, 17, 8, 30), pages_per_seq=4, page_size=8)
    w = jnp.asarray(np.array(window, np.int32))
    out = paged_decode_attention(*args, impl=impl, interpret=True, tuning=tuning, window=w)
    assert_close(out, numpy_oracle(*args, window=np.array(window)), jnp.float32)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_tokens_before_the_window_are_ignored_even_if_nan(impl):
    q, k, v, tables, lengths = make_case(12, lengths=(21, 9, 32), pages_per_seq=4, page_size=8)
    window = 6
    k_np, v_np = np.array(k), np.array(v)
    for b, length in enumerate(np.asarray(lengths)):
        for s in range(0, length - window):
            k_np[:, int(tables[b, s // 8]), s % 8] = np.nan
            v_np[:, int(tables[b, s // 8]), s % 8] = np.nan
    clean = numpy_oracle(q, k, v, tables, lengths, window=window)
    tuning = PagedAttentionTuning(pages_per_compute_block=1, block_h=4)
    out = paged_decode_attention(
        q,
        jnp.asarray(k_np),
        jnp.asarray(v_np),
        tables,
        lengths,
        impl=impl,
        interpret=True,
        tuning=tuning,
        window=jnp.int32(window),
    )
    assert np.isfinite(np.asarray(out)).all()
    assert_close(out, clean, jnp.float32)


def test_window_input_rules():
    args = make_case(13)
    with pytest.raises(ValueError, match="window must be int32"):
        paged_decode_attention(*args, impl="reference", window=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match='"jax_gpu" does not support a sliding window'):
        paged_decode_attention(*args, impl="jax_gpu", interpret=True, window=jnp.int32(4))
