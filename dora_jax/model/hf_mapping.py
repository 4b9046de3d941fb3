"""Hugging Face <-> dora_jax: the weight-name table and the config translation.

One declarative table (:data:`WEIGHT_RULES`) says, for each of our parameters, which HF tensor
holds it, the HF shape, and the two array transforms. Adding a model family means adding rows
(or a predicate) here, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dora_jax.config import ModelConfig, RopeScalingConfig

# HF architecture -> our ModelConfig.family (one entry per family; add a family here, in
# WEIGHT_RULES and in the config translation below).
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}

# HF tensors that carry no parameters of ours and are skipped on load.
IGNORED_HF_TENSORS = (r".*rotary_emb\.inv_freq$",)


class UnsupportedModelError(ValueError):
    """A checkpoint's architecture or options are outside what the decoder implements."""


Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _same(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    return w


@dataclass(frozen=True)
class WeightRule:
    ours: str  # path in our params tree, "/"-separated; "layers/..." leaves are stacked on L
    # HF tensor name; "{i}" is the layer index, "{e}" the expert index (one HF tensor per layer
    # and expert; our leaf is stacked [L, E, ...])
    hf: str
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Transform = _same
    to_hf: Transform = _same
    when: Callable[[ModelConfig], bool] = lambda cfg: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf

    def hf_tensors(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """Each HF tensor of this rule: its name and the index of its part of our leaf (``()``:
        all of it, ``(layer,)`` or ``(layer, expert)``)."""
        if not self.per_layer:
            return [(self.hf, ())]
        experts = range(cfg.num_experts) if self.per_expert else [None]
        return [
            (self.hf.format(i=i, e=e), (i,) if e is None else (i, e))
            for i in range(cfg.num_layers)
            for e in experts
        ]


def _t(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _proj_in(heads: Callable[[ModelConfig], int]) -> tuple[Transform, Transform]:
    """HF ``[heads*H, D]`` <-> ours ``[D, heads, H]``."""

    def to_ours(w, c):
        return np.ascontiguousarray(w.T).reshape(c.hidden_size, heads(c), c.resolved_head_dim)

    def to_hf(w, c):
        return np.ascontiguousarray(w.reshape(c.hidden_size, -1).T)

    return to_ours, to_hf


def _bias(heads: Callable[[ModelConfig], int]) -> tuple[Transform, Transform]:
    return (
        lambda w, c: w.reshape(heads(c), c.resolved_head_dim),
        lambda w, c: w.reshape(-1),
    )


def _o_to_ours(w, c):  # HF [D, N*H] -> ours [N, H, D]
    return np.ascontiguousarray(w.T).reshape(c.num_heads, c.resolved_head_dim, c.hidden_size)


def _o_to_hf(w, c):
    return np.ascontiguousarray(w.reshape(-1, c.hidden_size).T)


def _q(c):
    return c.num_heads


def _kv(c):
    return c.num_kv_heads


def _qkv_bias(c):
    return c.qkv_bias


def _dense(c):
    return not c.is_moe


def _moe(c):
    return c.is_moe


def _shared(c):
    return c.is_moe and c.shared_expert_intermediate_size > 0


def _qk_norm(c):
    return c.qk_norm


def _flat(w, c):  # HF [1, D] <-> ours [D]
    return w.reshape(-1)


def _row(w, c):
    return w.reshape(1, -1)


_P = "model.layers.{i}."

WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule("embed", "model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    WeightRule("layers/attn_norm", _P + "input_layernorm.weight", lambda c: (c.hidden_size,)),
    WeightRule(
        "layers/wq",
        _P + "self_attn.q_proj.weight",
        lambda c: (c.num_heads * c.resolved_head_dim, c.hidden_size),
        *_proj_in(_q),
    ),
    WeightRule(
        "layers/wk",
        _P + "self_attn.k_proj.weight",
        lambda c: (c.num_kv_heads * c.resolved_head_dim, c.hidden_size),
        *_proj_in(_kv),
    ),
    WeightRule(
        "layers/wv",
        _P + "self_attn.v_proj.weight",
        lambda c: (c.num_kv_heads * c.resolved_head_dim, c.hidden_size),
        *_proj_in(_kv),
    ),
    WeightRule(
        "layers/bq",
        _P + "self_attn.q_proj.bias",
        lambda c: (c.num_heads * c.resolved_head_dim,),
        *_bias(_q),
        when=_qkv_bias,
    ),
    WeightRule(
        "layers/bk",
        _P + "self_attn.k_proj.bias",
        lambda c: (c.num_kv_heads * c.resolved_head_dim,),
        *_bias(_kv),
        when=_qkv_bias,
    ),
    WeightRule(
        "layers/bv",
        _P + "self_attn.v_proj.bias",
        lambda c: (c.num_kv_heads * c.resolved_head_dim,),
        *_bias(_kv),
        when=_qkv_bias,
    ),
    WeightRule(
        "layers/q_norm",
        _P + "self_attn.q_norm.weight",
        lambda c: (c.resolved_head_dim,),
        when=_qk_norm,
    ),
    WeightRule(
        "layers/k_norm",
        _P + "self_attn.k_norm.weight",
        lambda c: (c.resolved_head_dim,),
        when=_qk_norm,
    ),
    WeightRule(
        "layers/wo",
        _P + "self_attn.o_proj.weight",
        lambda c: (c.hidden_size, c.num_heads * c.resolved_head_dim),
        _o_to_ours,
        _o_to_hf,
    ),
    WeightRule(
        "layers/mlp_norm", _P + "post_attention_layernorm.weight", lambda c: (c.hidden_size,)
    ),
    WeightRule(
        "layers/w_gate",
        _P + "mlp.gate_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_dense,
    ),
    WeightRule(
        "layers/w_up",
        _P + "mlp.up_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_dense,
    ),
    WeightRule(
        "layers/w_down",
        _P + "mlp.down_proj.weight",
        lambda c: (c.hidden_size, c.intermediate_size),
        _t,
        _t,
        when=_dense,
    ),
    # mixture of experts: transformers saves (and loads) one tensor per expert
    WeightRule(
        "layers/router",
        _P + "mlp.gate.weight",
        lambda c: (c.num_experts, c.hidden_size),
        _t,
        _t,
        when=_moe,
    ),
    WeightRule(
        "layers/moe_gate",
        _P + "mlp.experts.{e}.gate_proj.weight",
        lambda c: (c.moe_intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_moe,
    ),
    WeightRule(
        "layers/moe_up",
        _P + "mlp.experts.{e}.up_proj.weight",
        lambda c: (c.moe_intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_moe,
    ),
    WeightRule(
        "layers/moe_down",
        _P + "mlp.experts.{e}.down_proj.weight",
        lambda c: (c.hidden_size, c.moe_intermediate_size),
        _t,
        _t,
        when=_moe,
    ),
    WeightRule(
        "layers/shared_gate",
        _P + "mlp.shared_expert.gate_proj.weight",
        lambda c: (c.shared_expert_intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_shared,
    ),
    WeightRule(
        "layers/shared_up",
        _P + "mlp.shared_expert.up_proj.weight",
        lambda c: (c.shared_expert_intermediate_size, c.hidden_size),
        _t,
        _t,
        when=_shared,
    ),
    WeightRule(
        "layers/shared_down",
        _P + "mlp.shared_expert.down_proj.weight",
        lambda c: (c.hidden_size, c.shared_expert_intermediate_size),
        _t,
        _t,
        when=_shared,
    ),
    WeightRule(
        "layers/shared_expert_gate",
        _P + "mlp.shared_expert_gate.weight",
        lambda c: (1, c.hidden_size),
        _flat,
        _row,
        when=_shared,
    ),
    WeightRule("final_norm", "model.norm.weight", lambda c: (c.hidden_size,)),
    WeightRule(
        "lm_head",
        "lm_head.weight",
        lambda c: (c.vocab_size, c.hidden_size),
        _t,
        _t,
        when=lambda c: not c.tie_word_embeddings,
    ),
)


def active_rules(cfg: ModelConfig) -> list[WeightRule]:
    return [r for r in WEIGHT_RULES if r.when(cfg)]


def expected_hf_tensors(cfg: ModelConfig) -> dict[str, WeightRule]:
    """Every HF tensor name the checkpoint must hold -> its rule."""
    return {name: rule for rule in active_rules(cfg) for name, _ in rule.hf_tensors(cfg)}


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the transformers-5 ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` keys."""
    rp = hf.get("rope_parameters") or {}
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or rp)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"config.json: rope type {kind!r} is not supported (supported: default, llama3)"
        )
    return float(theta), scaling


_FAMILIES = frozenset(SUPPORTED_ARCHITECTURES.values())


def _sliding_window(hf: dict[str, Any], family: str) -> tuple[int | None, int]:
    """(window or None, leading full-attention layers) of a HF config. Mistral: ``sliding_window``
    for every layer. Qwen2/Qwen3: only with ``use_sliding_window``, for the layers that
    ``layer_types`` (or else ``max_window_layers``) marks sliding, which must come after the full
    ones. Llama has no window."""
    if family == "llama":
        return None, 0
    if family == "mistral":
        if "layer_types" in hf and any(t != "sliding_attention" for t in hf["layer_types"]):
            raise UnsupportedModelError(
                "config.json: Mistral with per-layer layer_types is not supported"
            )
        window = hf.get("sliding_window", 4096)  # HF MistralConfig's default
        return (int(window) if window else None), 0
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return None, 0
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(L)
    ]
    full = sum(t == "full_attention" for t in types)
    # (also refuses unknown layer types: they never match this list)
    if types != ["full_attention"] * full + ["sliding_attention"] * (L - full):
        raise UnsupportedModelError(
            f"config.json: layer_types {types} is not supported (full-attention layers must "
            "all come before the sliding-window ones)"
        )
    if full == L:
        return None, 0
    return int(window), full


def model_config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Translate a HF ``config.json`` dict; unsupported options raise naming the option."""
    archs = hf.get("architectures") or []
    if archs:
        family = SUPPORTED_ARCHITECTURES.get(archs[0])
    else:  # no architectures list: the model_type names the family
        family = hf.get("model_type") if hf.get("model_type") in _FAMILIES else None
    if family is None:
        name = f"architecture {archs[0]}" if archs else f"model_type {hf.get('model_type')!r}"
        raise UnsupportedModelError(
            f"config.json: {name} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)"
        )
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("config.json: mlp_bias=true is not supported")
    theta, scaling = _rope_params(hf)
    window, full_layers = _sliding_window(hf, family)
    heads = hf["num_attention_heads"]
    moe = _moe_fields(hf, family) if family in ("qwen3_moe", "qwen2_moe") else {}
    kw: dict[str, Any] = dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        # HF Qwen3 defaults head_dim to 128 rather than hidden_size // heads
        head_dim=hf.get("head_dim") or (128 if family == "qwen3" else None),
        rope_theta=theta,
        rope_scaling=None
        if scaling is None
        else RopeScalingConfig(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        ),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "qwen2")),
        attention_bias={"qwen2": True, "mistral": False}.get(
            family, bool(hf.get("attention_bias", False))
        ),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        sliding_window=window,
        full_attention_layers=full_layers,
    )
    kw.update(moe)
    kw.update(overrides)
    return ModelConfig(**kw)


def _moe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE / Qwen2-MoE ``config.json``. Only
    all-MoE layer stacks are supported; ``router_aux_loss_coef`` (a load-balancing loss for
    pretraining) is ignored: RL fine-tuning here adds no auxiliary loss."""
    step = int(hf.get("decoder_sparse_step", 1))
    if step != 1:
        raise UnsupportedModelError(
            f"config.json: decoder_sparse_step={step} is not supported "
            "(only 1: every layer is a MoE layer)"
        )
    dense = list(hf.get("mlp_only_layers") or [])
    if dense:
        raise UnsupportedModelError(
            f"config.json: mlp_only_layers={dense} is not supported "
            "(only []: every layer is a MoE layer)"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError("config.json: num_experts is missing or 0")
    out: dict[str, Any] = dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size", 0))
        out["attention_bias"] = bool(hf.get("qkv_bias", True))
    return out


def model_config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads as the matching architecture."""
    arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[cfg.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **asdict(cfg.rope_scaling)}
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.family == "llama":
        out["attention_bias"] = cfg.qkv_bias
        out["mlp_bias"] = False
    elif cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:  # the Qwen families
        windows = cfg.layer_windows()
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
        out["max_window_layers"] = cfg.full_attention_layers
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
        if cfg.family in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = cfg.qkv_bias
        elif cfg.family == "qwen2_moe":
            out["qkv_bias"] = cfg.qkv_bias
    if cfg.is_moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.resolved_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
        if cfg.family == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out
