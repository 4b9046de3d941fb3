"""Model behaviour beyond HF parity: remat policies, dtypes, packed segments, positions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.model import count_params, default_positions, forward, init_params, param_specs

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2)  # fmt: skip


def batch(B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    seg = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens, pos, seg


def loss_fn(params, cfg, tokens, pos, seg):
    return jnp.mean(forward(params, tokens, pos, seg, cfg) ** 2)


@pytest.mark.parametrize("remat, seq_chunk", [("full", 0), ("dots", 0), ("none", 5), ("nested", 5)])
def test_remat_policies_change_nothing_numerically(remat, seq_chunk):
    params = init_params(CFG, jax.random.key(0))
    args = batch()
    cfg_r = dataclasses.replace(CFG, remat=remat, seq_chunk=seq_chunk)
    np.testing.assert_allclose(forward(params, *args, cfg_r), forward(params, *args, CFG),
                               atol=1e-6)  # fmt: skip
    g0 = jax.grad(loss_fn)(params, CFG, *args)
    g1 = jax.grad(loss_fn)(params, cfg_r, *args)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_nested_remat_keeps_16_bit_layer_inputs_exactly():
    """bfloat16: nested remat keeps layer and group inputs as bit patterns; the gradient is the
    one without remat."""
    cfg = dataclasses.replace(CFG, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    grad = jax.jit(jax.grad(loss_fn), static_argnums=1)
    g0 = grad(params, cfg, *batch())
    g1 = grad(params, dataclasses.replace(cfg, remat="nested"), *batch())
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=1e-5)  # fmt: skip


def test_bf16_params_and_compute():
    cfg = dataclasses.replace(CFG, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    out = forward(params, *batch(), cfg)
    ref = forward(p32, *batch(), CFG)
    assert out.dtype == jnp.float32  # logits are always float32
    # bf16 has ~3 significant digits; the logits here are O(0.1).
    assert float(jnp.max(jnp.abs(out - ref))) < 2e-2
    assert float(jnp.max(jnp.abs(ref))) > 1e-2


def test_packed_segments_equal_separate_sequences():
    params = init_params(CFG, jax.random.key(1))
    tokens, _, _ = batch(B=1, T=10)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]], jnp.int32)
    pos = default_positions(seg)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]])
    packed = forward(params, tokens, pos, seg, CFG)
    a = forward(params, tokens[:, :4], pos[:, :4], jnp.ones((1, 4), jnp.int32), CFG)
    b = forward(params, tokens[:, 4:9], pos[:, 4:9], jnp.ones((1, 5), jnp.int32), CFG)
    np.testing.assert_allclose(packed[:, :4], a, atol=1e-5)
    np.testing.assert_allclose(packed[:, 4:9], b, atol=1e-5)
    assert bool(jnp.all(jnp.isfinite(packed)))  # the padding row is finite too


def test_param_count_and_no_qkv_bias_for_llama():
    assert count_params(CFG) == sum(
        int(np.prod(s.shape)) for s in jax.tree.leaves(
            param_specs(CFG), is_leaf=lambda x: hasattr(x, "axes"))
    )  # fmt: skip
    llama = dataclasses.replace(CFG, family="llama")
    assert "bq" not in param_specs(llama)["layers"] and "bq" in param_specs(CFG)["layers"]
    assert "lm_head" in param_specs(dataclasses.replace(CFG, tie_word_embeddings=False))
