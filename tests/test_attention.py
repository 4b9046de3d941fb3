"""Full-sequence attention: blockwise (flash-style) and the cuDNN call against the dense reference,
forward and gradients, with padding, packed segments, GQA and offset (prefill-chunk) queries."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ConfigError, ExperimentConfig, ModelConfig, TrainConfig
from dora_jax.model import forward, init_params
from dora_jax.model.attention import (
    blockwise_attention,
    cudnn_attention,
    dense_attention,
    live_blocks,
    segment_causal_mask,
    window_band,
)

B, T, N, K, H = 3, 37, 4, 2, 8
SCALE = 0.3


def _inputs(seed=0, T=T, S=None):
    rng = np.random.default_rng(seed)
    S = T if S is None else S
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)  # cotangent of the output
    return q, k, v, w


def _packed_segments():
    seg = np.zeros((B, T), np.int32)
    seg[0, :30] = 1  # one sequence, then padding
    seg[1, :10], seg[1, 10:25], seg[1, 25:33] = 1, 2, 3  # three packed sequences, padding
    seg[2, :] = 1  # full row
    return jnp.asarray(seg)


def _loss_and_grads(attn, q, k, v, w, valid):
    """Loss on the valid (non-padding) query rows only: padding outputs are unspecified."""

    def loss(q, k, v):
        o = attn(q, k, v)
        return jnp.sum(jnp.where(valid[..., None, None], o * w, 0.0)), o

    (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return o, g


@pytest.mark.parametrize("block", [5, 16, 64])
def test_blockwise_equals_dense_forward_and_gradients(block):
    q, k, v, w = _inputs()
    seg = _packed_segments()
    valid = seg != 0
    mask = segment_causal_mask(seg)
    od, gd = _loss_and_grads(
        lambda q, k, v: dense_attention(q, k, v, mask, SCALE), q, k, v, w, valid
    )
    fn = jax.jit(
        lambda q, k, v: _loss_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, seg, seg, SCALE, block=block),
            q,
            k,
            v,
            w,
            valid,
        )
    )
    ob, gb = fn(q, k, v)
    assert bool(jnp.all(jnp.isfinite(ob)))
    np.testing.assert_allclose(
        np.where(valid[..., None, None], ob, 0), np.where(valid[..., None, None], od, 0), atol=1e-5
    )
    for a, b in zip(gb, gd, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("block", [5, 16])
def test_blockwise_equals_jax_reference_attention(block):
    """Against code we did not write: jax.nn.dot_product_attention (implementation="xla"), its
    GQA broadcast, and a mask built here with NumPy loops (causal, same segment, no padding)."""
    q, k, v, w = _inputs(3)
    seg = np.asarray(_packed_segments())
    mask = np.zeros((B, 1, T, T), bool)
    for b in range(B):
        for i in range(T):
            for j in range(i + 1):
                mask[b, 0, i, j] = seg[b, i] == seg[b, j] != 0
    valid = jnp.asarray(seg != 0)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, mask=jnp.asarray(mask), scale=SCALE, implementation="xla"
        )

    def ours(q, k, v):
        return blockwise_attention(q, k, v, jnp.asarray(seg), jnp.asarray(seg), SCALE, block=block)

    (o_ref, g_ref), (o, g) = (_loss_and_grads(f, q, k, v, w, valid) for f in (ref, ours))
    rows = np.asarray(valid)[..., None, None]
    np.testing.assert_allclose(np.where(rows, o, 0), np.where(rows, o_ref, 0), atol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("block", [8, 64])
def test_blockwise_offset_queries_equal_dense_chunk_over_a_longer_context(block):
    """The engine's prefill chunk: C queries at positions start.., keys 0..S-1 of which the first
    start + num_valid are real."""
    C, S = 11, 40
    q, k, v, _ = _inputs(1, T=C, S=S)
    start = jnp.asarray([0, 7, 29], jnp.int32)
    num_valid = jnp.asarray([11, 5, 11], jnp.int32)
    kv_seg = (jnp.arange(S)[None] < (start + num_valid)[:, None]).astype(jnp.int32)
    q_seg = jnp.ones((B, C), jnp.int32)
    out = blockwise_attention(q, k, v, q_seg, kv_seg, SCALE, q_offset=start, block=block)
    q_pos = start[:, None] + jnp.arange(C)[None]
    kv = jnp.arange(S)
    mask = (kv[None, None] <= q_pos[:, :, None]) & (
        kv[None, None] < (start + num_valid)[:, None, None]
    )
    ref = dense_attention(q, k, v, mask, SCALE)
    rows = (jnp.arange(C)[None] < num_valid[:, None])[..., None, None]
    np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, ref, 0), atol=1e-5)


def test_live_blocks_skip_other_segments_causal_upper_half_and_padding():
    # one row: four packed sequences of 16 tokens, then 64 tokens of padding; blocks of 16
    seg = jnp.asarray(np.repeat([1, 2, 3, 4, 0, 0, 0, 0], 16)[None], jnp.int32)
    live = np.asarray(live_blocks(seg, seg, jnp.zeros((1,), jnp.int32), 16, 16))
    np.testing.assert_array_equal(live, np.diag([True] * 4 + [False] * 4))
    one = jnp.ones((1, 64), jnp.int32)  # one long sequence: the causal lower triangle
    live = np.asarray(live_blocks(one, one, jnp.zeros((1,), jnp.int32), 16, 16))
    np.testing.assert_array_equal(live, np.tril(np.ones((4, 4), bool)))


def _numpy_window_mask(seg, window):
    """Causal, same segment, no padding, and i - window < j (NumPy loops; window 0: none)."""
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for i in range(T):
            for j in range(i + 1):
                mask[b, i, j] = seg[b, i] == seg[b, j] != 0 and (window == 0 or j > i - window)
    return jnp.asarray(mask)


@pytest.mark.parametrize("window", [1, 4, 9, 0])
@pytest.mark.parametrize("block", [4, 16, 64])
def test_sliding_window_blockwise_equals_dense_and_a_numpy_mask(window, block):
    """Forward and gradients with packed segments: the window counts within each segment."""
    q, k, v, w = _inputs(4)
    seg = _packed_segments()
    valid = seg != 0
    mask = _numpy_window_mask(np.asarray(seg), window)
    np.testing.assert_array_equal(segment_causal_mask(seg) & window_band(T, T, window)[None], mask)
    od, gd = _loss_and_grads(
        lambda q, k, v: dense_attention(q, k, v, mask, SCALE), q, k, v, w, valid
    )
    win = jnp.int32(window)
    fn = jax.jit(
        lambda q, k, v, win: _loss_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, seg, seg, SCALE, block=block, window=win),
            q,
            k,
            v,
            w,
            valid,
        )
    )
    ob, gb = fn(q, k, v, win)
    rows = valid[..., None, None]
    np.testing.assert_allclose(np.where(rows, ob, 0), np.where(rows, od, 0), atol=1e-5)
    for a, b in zip(gb, gd, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_live_blocks_skip_key_blocks_behind_the_window():
    one = jnp.ones((1, 64), jnp.int32)  # one long sequence, blocks of 8, a window of 10
    live = np.asarray(live_blocks(one, one, jnp.zeros((1,), jnp.int32), 8, 8, jnp.int32(10)))
    # query block i (first query 8i) sees key blocks whose last key 8j + 7 > 8i - 10
    np.testing.assert_array_equal(
        live, np.tril(np.ones((8, 8), bool)) & ~np.tril(np.ones((8, 8), bool), -3)
    )


def test_blockwise_never_materialises_t_by_s():
    """Compiled (not run) gradient at T = 4096: the dense version's float32 [B,K,G,T,T] scores
    are 128 MiB; the blockwise one stays near its O(T) inputs and outputs."""
    T_long, blk = 4096, 256
    shape_q = jax.ShapeDtypeStruct((1, T_long, 2, 8), jnp.float32)
    shape_kv = jax.ShapeDtypeStruct((1, T_long, 1, 8), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, T_long), jnp.int32)

    def grad_of(attn):
        def loss(q, k, v, s):
            return jnp.sum(attn(q, k, v, s))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def blockwise(q, k, v, s):
        return blockwise_attention(q, k, v, s, s, SCALE, block=blk)

    def dense(q, k, v, s):
        return dense_attention(q, k, v, segment_causal_mask(s), SCALE)

    temps = {
        name: grad_of(fn).lower(shape_q, shape_kv, shape_kv, seg).compile().memory_analysis()
        for name, fn in (("blockwise", blockwise), ("dense", dense))
    }
    scores = 2 * T_long * T_long * 4
    assert temps["dense"].temp_size_in_bytes >= scores
    assert temps["blockwise"].temp_size_in_bytes < scores / 16


def test_cudnn_call_matches_dense_for_one_sequence_per_row():
    """The cuDNN path's arguments (causal + per-row lengths) through the same public function
    with implementation="xla" (no GPU here); and it refuses to run without a GPU."""
    q, k, v, _ = _inputs(2)
    seg = np.zeros((B, T), np.int32)
    seg[0, :30], seg[1, :5], seg[2, :] = 1, 1, 1
    seg = jnp.asarray(seg)
    out = cudnn_attention(q, k, v, seg, SCALE, implementation="xla")
    ref = dense_attention(q, k, v, segment_causal_mask(seg), SCALE)
    valid = (seg != 0)[..., None, None]
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), atol=1e-5)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU"):
            cudnn_attention(q, k, v, seg, SCALE)


@pytest.mark.slow
def test_model_forward_and_gradients_blockwise_equal_dense():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attention="dense",
    )
    params = init_params(cfg, jax.random.key(0))
    seg = _packed_segments()
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 64)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    valid = (seg != 0)[..., None]

    def loss(p, c):
        logits = forward(p, tokens, pos, seg, c)
        return jnp.sum(jnp.where(valid, jax.nn.log_softmax(logits), 0.0)[..., 5])

    results = {}
    for impl in ("dense", "blockwise"):
        c = dataclasses.replace(cfg, attention=impl, attention_block=8)
        grad = jax.jit(jax.grad(loss), static_argnums=1)
        results[impl] = (forward(params, tokens, pos, seg, c), grad(params, c))
    (ld, gd), (lb, gb) = results["dense"], results["blockwise"]
    np.testing.assert_allclose(np.where(valid, lb, 0), np.where(valid, ld, 0), atol=1e-5)
    for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gd), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_cudnn_config_constraints_name_the_field():
    with pytest.raises(ConfigError, match="^attention: cudnn needs compute_dtype bfloat16"):
        ModelConfig(attention="cudnn")
    bf16 = ModelConfig(attention="cudnn", param_dtype="bfloat16", compute_dtype="bfloat16")
    with pytest.raises(ConfigError, match="^model.attention: .*train.packing=rows"):
        ExperimentConfig(model=bf16, train=TrainConfig(pack_rows=4))
    with pytest.raises(ConfigError, match="^model.attention: .*train.packing=rows"):
        ExperimentConfig(model=bf16)  # packed by tokens, the default
    ExperimentConfig(model=bf16, train=TrainConfig(packing="rows"))  # one sequence per row
