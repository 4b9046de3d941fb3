"""The kernels' shared-memory budget: tile bytes, the automatic fit, refusals naming the field.

No GPU is needed: the tile bytes are pure functions of shapes, dtype and tuning, and the compiled
path is checked up to the kernel call (the lowering itself needs a GPU).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from dora_jax.kernels import (
    KVCopyTuning,
    PagedAttentionTuning,
    append_shared_memory_bytes,
    attention_shared_memory_bytes,
    fit_attention_tuning,
    fit_copy_tuning,
    kv_cache_ops,
    page_copy_shared_memory_bytes,
    paged_attention,
)
from dora_jax.kernels.shared_memory import (
    SM90_LIMIT_BYTES,
    device_limit_bytes,
    limit_bytes_for_capability,
)

H200_LIMIT = 232_448  # 227 KiB per thread block


def test_limits():
    assert SM90_LIMIT_BYTES == H200_LIMIT == limit_bytes_for_capability("9.0")
    assert limit_bytes_for_capability(None) == H200_LIMIT  # no GPU: the check's target
    assert limit_bytes_for_capability("8.0") == 166_912
    assert limit_bytes_for_capability("7.5") == 101_376  # unknown: the smallest in the table
    assert device_limit_bytes() == H200_LIMIT  # this CPU-only process


# (H, Z, pages_per_seq): the two float32 check shapes B3 N14 H64 Z32 and B4 N32 H128 Z16.
OVERFLOWING = [(64, 32, 8, 266_240, 135_168), (128, 16, 16, 270_336, 139_264)]


@pytest.mark.parametrize("head_dim,page_size,pages_per_seq,default_bytes,fitted_bytes", OVERFLOWING)
def test_default_tuning_overflows_and_the_fit_brings_it_under(
    head_dim, page_size, pages_per_seq, default_bytes, fitted_bytes
):
    shape = (head_dim, page_size, pages_per_seq, jnp.float32)
    default = PagedAttentionTuning()
    assert attention_shared_memory_bytes(*shape, default) == default_bytes > H200_LIMIT
    # One stage instead of two would fit as well (the same bytes as half the compute block).
    one_stage = PagedAttentionTuning(num_stages=1)
    assert attention_shared_memory_bytes(*shape, one_stage) == fitted_bytes
    fit = fit_attention_tuning(*shape, default, limit=H200_LIMIT)
    # The compute block is halved first; the pipeline keeps its two stages.
    assert fit == PagedAttentionTuning(pages_per_compute_block=4, num_stages=2)
    assert attention_shared_memory_bytes(*shape, fit) == fitted_bytes <= H200_LIMIT
    # bf16 fits as it is.
    bf16 = (head_dim, page_size, pages_per_seq, jnp.bfloat16)
    assert fit_attention_tuning(*bf16, default, limit=H200_LIMIT) == default


def test_kv_copy_budget_drops_stages_then_refuses_naming_the_field():
    assert append_shared_memory_bytes(128, jnp.float32, KVCopyTuning()) == 1024
    assert page_copy_shared_memory_bytes(16, 128, jnp.bfloat16, KVCopyTuning()) == 8192
    # Z128 H128 f32: 128 KiB per stage.
    three = KVCopyTuning(num_stages=3)
    fit = fit_copy_tuning("page_copy", 128, 128, jnp.float32, three, limit=H200_LIMIT)
    assert fit == KVCopyTuning(num_stages=1)
    with pytest.raises(ValueError, match=r"KVCopyTuning\.num_stages=1.*over the 232448 B"):
        fit_copy_tuning("page_copy", 256, 256, jnp.float32, KVCopyTuning(), limit=H200_LIMIT)
    with pytest.raises(ValueError, match="unknown kernel"):
        fit_copy_tuning("gather", 16, 16, jnp.float32, KVCopyTuning())


def test_attention_budget_refuses_naming_the_fields():
    # One page of 256 tokens at H 256 in f32 is 512 KiB of K and V: nothing to shrink.
    with pytest.raises(
        ValueError, match=r"PagedAttentionTuning\.pages_per_compute_block=1, num_stages=1"
    ):
        fit_attention_tuning(256, 256, 4, jnp.float32, PagedAttentionTuning(), limit=H200_LIMIT)


def test_compiled_calls_fit_the_tuning_before_lowering(monkeypatch):
    """The public ops hand the fitted tuning to the kernel (the lowering itself needs a GPU)."""
    seen = {}

    def fake_attention(*args, tuning, **kwargs):
        seen["attention"] = tuning
        return args[0]

    def fake_pack(k_pages, v_pages, page_ids, *, tuning, interpret):
        seen["pack"] = tuning
        return k_pages

    monkeypatch.setattr(paged_attention, "_paged_decode_pallas", fake_attention)
    monkeypatch.setattr(kv_cache_ops, "_pack_pallas", fake_pack)
    q = jnp.zeros((3, 14, 64), jnp.float32)
    pages = jnp.zeros((2, 25, 32, 64), jnp.float32)
    tables = jnp.ones((3, 8), jnp.int32)
    lengths = jnp.full((3,), 256, jnp.int32)
    paged_attention.paged_decode_attention(q, pages, pages, tables, lengths, impl="pallas")
    assert seen["attention"] == PagedAttentionTuning(pages_per_compute_block=4)
    cache = jnp.zeros((1, 1, 4, 128, 128), jnp.float32)
    ids = jnp.arange(2, dtype=jnp.int32)
    kv_cache_ops.pack_pages(cache, cache, ids, impl="pallas", tuning=KVCopyTuning(num_stages=3))
    assert seen["pack"] == KVCopyTuning(num_stages=1)
    # Interpret mode runs the tuning it is given.
    paged_attention.paged_decode_attention(
        q, pages, pages, tables, lengths, impl="pallas", interpret=True
    )
    assert seen["attention"] == PagedAttentionTuning()
