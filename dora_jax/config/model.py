"""The model section of the configuration: the decoder's architecture, dtypes and attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dora_jax.config.errors import check as _check
from dora_jax.config.errors import check_non_negative, check_positive

Dtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class RopeScalingConfig:
    """Llama-3 style frequency-dependent RoPE scaling (HF ``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _check(self.factor >= 1.0, "factor", f"must be >= 1, got {self.factor}")
        _check(
            self.high_freq_factor > self.low_freq_factor > 0,
            "high_freq_factor",
            "must be > low_freq_factor > 0, got "
            f"{self.high_freq_factor} and {self.low_freq_factor}",
        )
        check_positive(self, "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen2-, Qwen3-, Llama- or Mistral-family decoder, or a Qwen3-MoE / Qwen2-MoE mixture of
    experts. Defaults: a tiny Qwen2 for the built-in CPU task. ``qwen3`` and ``qwen3_moe`` add a
    per-head RMSNorm on q and k (before RoPE)."""

    family: Literal["qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "qwen2_moe"] = "qwen2"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool | None = None  # None: the family's default (qwen2 True, others False)
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    # none; full (keep each layer's input only, recompute the layer in the backward pass); dots
    # (also keep matmul outputs); nested (full within groups of ~sqrt(L) layers and again over
    # the groups: L/g + g saved layer inputs instead of L, for one more forward pass)
    remat: Literal["none", "full", "dots", "nested"] = "none"
    hf_path: str | None = None  # a Hugging Face checkpoint directory to start from
    # Full-sequence attention (train step, warm start, engine prefill chunks): "dense" (the
    # reference; float32 [B, K, G, T, S] scores), "blockwise" (flash-style online softmax in plain
    # JAX, never T x S) or "cudnn" (GPU, bfloat16, one sequence per row). See model/attention.py.
    attention: Literal["dense", "blockwise", "cudnn"] = "blockwise"
    attention_block: int = 512  # query and key block of "blockwise"
    # Position-wise work of the full-sequence pass (the MLP, the trainer's log-probabilities) in
    # chunks of this many positions per row, each rematerialised: the backward pass then holds
    # [B, seq_chunk, F] instead of [B, T, F]. 0: whole sequences.
    seq_chunk: int = 0
    # Sliding-window attention: a query at position i sees keys j with i - sliding_window < j <= i.
    # None: full causal attention everywhere. The first ``full_attention_layers`` layers attend
    # fully and the rest use the window (Mistral: 0; Qwen2/Qwen3: HF's max_window_layers); it has
    # no effect without a window.
    sliding_window: int | None = None
    full_attention_layers: int = 0
    # Mixture of experts: used by the families in MOE_FAMILIES, ignored by dense ones. Every
    # layer's MLP is a routed MoE block (see model/moe.py); ``intermediate_size`` is then unused.
    # The router's load-balancing loss coefficient of HF configs is not a field: RL fine-tuning
    # here adds no auxiliary loss, so checkpoints' router_aux_loss_coef is ignored.
    num_experts: int = 8
    num_experts_per_tok: int = 2  # top-k experts per token
    moe_intermediate_size: int = 64  # each expert's ffn width
    norm_topk_prob: bool | None = None  # renormalise top-k probs; None: qwen3_moe yes, qwen2_moe no
    shared_expert_intermediate_size: int = 0  # qwen2_moe's sigmoid-gated shared expert; 0: none
    decoder_sparse_step: int = 1  # only 1 (every layer MoE) is supported
    mlp_only_layers: tuple[int, ...] = ()  # only () (no dense layers) is supported

    def __post_init__(self):
        check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers")
        check_positive(self, "num_heads", "num_kv_heads", "rope_theta", "rms_norm_eps")
        check_positive(self, "max_position_embeddings", "attention_block")
        check_non_negative(self, "seq_chunk")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
        )
        if self.head_dim is None:
            _check(
                self.hidden_size % self.num_heads == 0,
                "head_dim",
                f"is unset, so hidden_size ({self.hidden_size}) must divide by num_heads "
                f"({self.num_heads}); set head_dim explicitly",
            )
        hd = self.resolved_head_dim
        _check(hd > 0 and hd % 2 == 0, "head_dim", f"must be a positive even number, got {hd}")
        if self.sliding_window is not None:
            _check(
                self.sliding_window > 0,
                "sliding_window",
                f"must be > 0 or null (no window), got {self.sliding_window}",
            )
            _check(
                self.family != "llama",
                "sliding_window",
                f"is not part of the {self.family} architecture (llama has none); set it to null",
            )
            _check(
                self.attention != "cudnn",
                "attention",
                "cudnn does not support sliding_window; use attention: blockwise or dense",
            )
        _check(
            0 <= self.full_attention_layers <= self.num_layers,
            "full_attention_layers",
            f"must be in [0, num_layers={self.num_layers}], got {self.full_attention_layers}",
        )
        _check(
            self.full_attention_layers == 0
            or self.sliding_window is None
            or self.family != "mistral",
            "full_attention_layers",
            "must be 0 for family mistral with a sliding_window (every Mistral layer has the same "
            f"window), got {self.full_attention_layers}",
        )
        if self.attention == "cudnn":
            _check(
                self.compute_dtype == "bfloat16",
                "attention",
                "cudnn needs compute_dtype bfloat16 (cuDNN flash attention has no float32 path); "
                "use attention: blockwise",
            )
            _check(
                hd % 8 == 0 and hd <= 128,
                "attention",
                f"cudnn needs a head_dim that is a multiple of 8 and <= 128, got {hd}; "
                "use attention: blockwise",
            )
        if self.is_moe:
            self._check_moe()

    def _check_moe(self):
        E, k = self.num_experts, self.num_experts_per_tok
        _check(E > 0, "num_experts", f"must be > 0 for family {self.family}, got {E}")
        _check(1 <= k <= E, "num_experts_per_tok", f"must be in [1, num_experts={E}], got {k}")
        check_positive(self, "moe_intermediate_size")
        check_non_negative(self, "shared_expert_intermediate_size")
        _check(
            self.family == "qwen2_moe" or self.shared_expert_intermediate_size == 0,
            "shared_expert_intermediate_size",
            f"a shared expert is a qwen2_moe feature; family {self.family} needs 0, got "
            f"{self.shared_expert_intermediate_size}",
        )
        _check(
            self.decoder_sparse_step == 1,
            "decoder_sparse_step",
            f"only 1 (every layer is a MoE layer) is supported, got {self.decoder_sparse_step}",
        )
        _check(
            not self.mlp_only_layers,
            "mlp_only_layers",
            f"only [] (every layer is a MoE layer) is supported, got {list(self.mlp_only_layers)}",
        )
        _check(not self.mlp_bias, "mlp_bias", "MoE families have no MLP biases")

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def resolved_norm_topk_prob(self) -> bool:
        if self.norm_topk_prob is not None:
            return self.norm_topk_prob
        return self.family == "qwen3_moe"

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every attention implementation (decided once, here)."""
        return self.resolved_head_dim**-0.5

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k after their projections, before RoPE (Qwen3, Qwen3-MoE)."""
        return self.family in ("qwen3", "qwen3_moe")

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full causal attention)."""
        w = self.sliding_window or 0
        return tuple(0 if i < self.full_attention_layers else w for i in range(self.num_layers))

    @property
    def qkv_bias(self) -> bool:
        if self.attention_bias is not None:
            return self.attention_bias
        return self.family in ("qwen2", "qwen2_moe")


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
