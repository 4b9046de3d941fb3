"""Logit parity with Hugging Face transformers (code we did not write) on tiny random models.

Every parameter (norm weights and q/k/v biases included) is randomised so that a mistake in any
of them shows. Tolerance: max |logits difference| <= 1e-4 in float32, never loosened.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dora_jax.model import forward
from dora_jax.model.hf_checkpoint import (
    load_hf_config,
    load_hf_params,
    save_hf_checkpoint,
)

TOL = 1e-4

CASES = {
    # name: (family, config kwargs)
    "qwen2-gqa1-untied": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    ),
    "qwen2-gqa4-tied": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "llama-gqa4-rope-llama3-untied": (
        "llama",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-gqa1-headdim-tied": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim != hidden / heads (48 / 4 = 12, 48 / 8 = 6)
    "qwen3-gqa2-headdim-untied": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    "qwen3-gqa4-headdim-tied": (
        "qwen3",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    ),
    # Mistral: a sliding window of 5 over rows of up to 40 tokens, and no window
    "mistral-window5-gqa2-untied": (
        "mistral",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=5,
            tie_word_embeddings=False,
        ),
    ),
    "mistral-nowindow-gqa3-tied": (
        "mistral",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            sliding_window=None,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2 with use_sliding_window: layer 0 attends fully, layers 1 and 2 through a window of 7
    "qwen2-window7-after-1-layer-tied": (
        "qwen2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=7,
            max_window_layers=1,
        ),
    ),
    # mixture of experts: 8 experts, top-2 (Qwen3-MoE: q/k norms, renormalised top-k; Qwen2-MoE:
    # q/k/v biases, raw top-k probabilities, the sigmoid-gated shared expert)
    "qwen3_moe-e8-top2-untied": (
        "qwen3_moe",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe-e8-top2-shared-tied": (
        "qwen2_moe",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            shared_expert_intermediate_size=56,
        ),
    ),
}

HF_CLASSES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
}


def make_hf_model(family: str, kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    common.update(kwargs)
    config_cls, model_cls = HF_CLASSES[family]
    model = model_cls(config_cls(**common))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if "norm" in name:
                p.add_(1.0)
    return model.eval()


def padded_batch(vocab: int, seed: int = 1):
    """Three rows: full length, right padding, left padding; positions count real tokens."""
    rng = np.random.default_rng(seed)
    B, T = 3, 40
    tokens = rng.integers(0, vocab, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 29:] = 0
    mask[2, :11] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None) * mask
    return tokens, mask, positions


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def our_logits(params, cfg, tokens, mask, positions) -> np.ndarray:
    out = forward(
        params,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        cfg,
    )
    return np.asarray(out)


def max_real_diff(a, b, mask) -> float:
    return float(np.max(np.abs(a - b) * mask[..., None]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    family, kwargs = CASES[case]
    model = make_hf_model(family, kwargs)
    model.save_pretrained(tmp_path / "hf")
    cfg = load_hf_config(tmp_path / "hf")
    assert cfg.family == family
    assert cfg.tie_word_embeddings == kwargs["tie_word_embeddings"]
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in kwargs)
    assert cfg.sliding_window == kwargs.get("sliding_window")
    assert cfg.qk_norm == (family in ("qwen3", "qwen3_moe"))
    params = load_hf_params(tmp_path / "hf", cfg)

    tokens, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, tokens, mask, positions)
    ours = our_logits(params, cfg, tokens, mask, positions)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits
    assert max_real_diff(ref, ours, mask) <= TOL


@pytest.mark.parametrize(
    "case",
    [
        "qwen2-gqa4-tied",
        "llama-gqa4-rope-llama3-untied",
        "qwen3-gqa2-headdim-untied",
        "mistral-window5-gqa2-untied",
        "qwen2-window7-after-1-layer-tied",
        "qwen3_moe-e8-top2-untied",
        "qwen2_moe-e8-top2-shared-tied",
    ],
)
def test_export_round_trip_loads_in_transformers(case, tmp_path):
    family, kwargs = CASES[case]
    model = make_hf_model(family, kwargs, seed=3)
    model.save_pretrained(tmp_path / "hf")
    cfg = load_hf_config(tmp_path / "hf")
    params = load_hf_params(tmp_path / "hf", cfg)

    # Ours -> HF directory (sharded into several files with an index) -> transformers.
    out_dir = save_hf_checkpoint(params, cfg, tmp_path / "export", max_shard_bytes=64 << 10)
    assert (out_dir / "model.safetensors.index.json").is_file()
    cls = HF_CLASSES[family][1]
    reloaded = cls.from_pretrained(out_dir, attn_implementation="eager").eval()
    tokens, mask, positions = padded_batch(cfg.vocab_size, seed=5)
    ref = hf_logits(model, tokens, mask, positions)
    again = hf_logits(reloaded, tokens, mask, positions)
    ours = our_logits(params, cfg, tokens, mask, positions)
    assert max_real_diff(ref, again, mask) <= TOL
    assert max_real_diff(again, ours, mask) <= TOL
    # And the exported directory loads back into the same params.
    params2 = load_hf_params(out_dir, load_hf_config(out_dir))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "case", ["mistral-window5-gqa2-untied", "qwen2-window7-after-1-layer-tied"]
)
def test_sliding_window_matches_transformers_in_every_attention(case, tmp_path):
    """The window is honoured by the dense path and by the blockwise path with blocks smaller
    than the sequence (whole key blocks outside the window are skipped), and it matters: without
    it the logits differ."""
    family, kwargs = CASES[case]
    model = make_hf_model(family, kwargs, seed=7)
    model.save_pretrained(tmp_path / "hf")
    tokens, mask, positions = padded_batch(97, seed=9)
    ref = hf_logits(model, tokens, mask, positions)
    for overrides in (dict(attention="dense"), dict(attention="blockwise", attention_block=8)):
        cfg = load_hf_config(tmp_path / "hf", **overrides)
        params = load_hf_params(tmp_path / "hf", cfg)
        assert max_real_diff(ref, our_logits(params, cfg, tokens, mask, positions), mask) <= TOL
    no_window = dataclasses.replace(cfg, sliding_window=None, full_attention_layers=0)
    assert max_real_diff(ref, our_logits(params, no_window, tokens, mask, positions), mask) > 0.1
