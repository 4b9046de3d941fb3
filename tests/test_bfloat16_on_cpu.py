"""A bfloat16 model on a CPU never makes XLA widen a whole weight stack, embedding or KV cache to
float32 for an operation that reads or writes one slice of it: the structure of the compiled
step (its HLO's array shapes) and the values against the plain path."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.mesh import make_mesh
from dora_jax.model.params import init_params
from dora_jax.model.transformer import hidden_states
from dora_jax.rollout.engine import Engine, _decode_jit
from dora_jax.rollout.steps import kv_cache_dtype

CFG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
)


ROLLOUT = RolloutConfig(
    max_slots=4, page_size=8, num_pages=17, max_prompt_len=16, max_new_tokens=16
)


def _shapes(hlo: str) -> set[str]:
    return set(re.findall(r"\b(?:f32|bf16|u16)\[[0-9,]*\]", hlo))


def test_the_kv_cache_of_a_16_bit_model_on_a_cpu_is_float32():
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    bf16 = ModelConfig(**CFG, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert kv_cache_dtype(bf16, "cpu") == jnp.float32
    assert kv_cache_dtype(bf16, "gpu") == jnp.bfloat16  # a GPU's cache stays in the model's dtype
    assert kv_cache_dtype(ModelConfig(**CFG), "cpu") == jnp.float32
    mixed = ModelConfig(**CFG, compute_dtype="bfloat16")
    rcfg = ROLLOUT
    engine = Engine(mixed, rcfg, mesh, eos_id=-1, interpret=False)
    assert engine.cache.k.dtype == engine.cache.v.dtype == jnp.float32


def test_a_bfloat16_decode_step_copies_neither_its_embedding_nor_its_cache_to_float32():
    cfg = ModelConfig(**CFG, param_dtype="bfloat16", compute_dtype="bfloat16")
    rcfg = ROLLOUT
    engine = Engine(cfg, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1, interpret=False)
    engine.load_params(init_params(cfg, jax.random.key(0)), 0)
    B = 4
    args = engine._put(
        np.ones(B, np.int32),
        np.full(B, 3, np.int32),
        np.tile(np.arange(2, dtype=np.int32)[None], (B, 1)),
        np.ones(B, bool),
        np.zeros((B, 2), np.uint32),
        np.full(B, 2, np.int32),
    )
    hlo = _decode_jit.lower(engine.params, engine.cache, *args, st=engine._st).compile().as_text()
    shapes = _shapes(hlo)
    assert "f32[96,32]" not in shapes  # the embedding, widened for the token lookup
    cache = engine.cache.k.shape
    assert engine.cache.k.dtype == jnp.float32
    assert f"bf16[{','.join(map(str, cache))}]" not in shapes  # no 16-bit copy of the cache


def test_float32_weights_of_a_bfloat16_model_are_cast_one_layer_at_a_time():
    cfg = ModelConfig(**CFG, param_dtype="float32", compute_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    pos = jnp.tile(jnp.arange(8)[None], (2, 1))
    seg = jnp.ones((2, 8), jnp.int32)

    def h(p):
        return hidden_states(p, tokens, pos, seg, cfg)

    shapes = _shapes(jax.jit(h).lower(params).compile().as_text())
    assert "f32[6,32,80]" in shapes  # the MLP's stacked weight [L, D, F], as stored
    assert "bf16[6,32,80]" not in shapes  # never cast as a whole stack
    # the same numbers as casting every weight first
    cast = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    np.testing.assert_array_equal(h(params), h(cast))
