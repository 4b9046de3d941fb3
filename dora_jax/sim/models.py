"""Model presets for the cluster simulator: what the cost model needs to know about a model.

- ``params_total``: every weight (what a weight transfer moves and decode streams from HBM);
- ``params_active``: weights a token multiplies (the FLOPs: 2 per parameter forward, 6 with the
  backward); the input embedding is a lookup, so it is left out; MoE: the experts a token uses;
- ``kv_bytes_per_token``: KV cache bytes one token holds over all layers;
- ``attn_flops_per_pair``: attention FLOPs per (query, key) position pair over all layers
  (QK^T and AV: ``4 * heads * head_dim`` per layer for GQA);
- ``allreduces_per_forward``: tensor-parallel all-reduces per forward pass (2 per block);
- MoE only: ``expert_params`` (all routed experts), ``num_experts``, ``active_experts`` (routed
  experts a token uses on average): decode streams only the experts its batch touches.

Dense Qwen2 and Qwen3 and the Qwen3 MoE parameter counts are computed from the architecture
(``qwen2_dense``, ``qwen3``) and checked in the tests against the model cards (Qwen2.5: 7.61B and
32.5B; Qwen3: 32.8B, 30.5B total / 3.3B activated, 235B / 22B).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

BF16 = 2  # bytes per parameter and per KV element


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_total: float
    params_active: float
    num_layers: int  # attention blocks
    hidden: int
    kv_bytes_per_token: int
    attn_flops_per_pair: float
    allreduces_per_forward: int
    expert_params: float = 0.0
    num_experts: int = 0
    active_experts: float = 0.0
    bytes_per_param: int = BF16

    def __post_init__(self):
        if not 0 < self.params_active <= self.params_total:
            raise ValueError(f"{self.name}: need 0 < params_active <= params_total")
        if self.expert_params and not (self.num_experts and 0 < self.active_experts):
            raise ValueError(f"{self.name}: an MoE needs num_experts and active_experts")

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.bytes_per_param

    @property
    def is_moe(self) -> bool:
        return self.expert_params > 0


def _decoder(name, layers, hidden, q, kv, vocab, tied, per_layer, active_layer, **moe) -> ModelSpec:
    """The spec of a decoder of ``layers`` blocks of ``per_layer`` weights (``active_layer`` of
    them multiplied per token), ``q`` / ``kv`` the widths of its query and key/value heads, and
    the embeddings: the input one is a lookup, the LM head (tied or not) multiplies."""
    embed = vocab * hidden
    return ModelSpec(
        name=name,
        params_total=float(layers * per_layer + embed * (1 if tied else 2) + hidden),
        params_active=float(layers * active_layer + embed + hidden),
        num_layers=layers,
        hidden=hidden,
        kv_bytes_per_token=2 * layers * kv * BF16,
        attn_flops_per_pair=4.0 * layers * q,
        allreduces_per_forward=2 * layers,
        **moe,
    )


def qwen2_dense(
    name: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    head_dim: int = 128,
    tied: bool = False,
) -> ModelSpec:
    """A Qwen2-family dense decoder (QKV bias, SwiGLU, RMSNorm) from its ``config.json``."""
    kv = kv_heads * head_dim
    q = heads * head_dim
    per_layer = (
        hidden * q
        + q  # q_proj (+ bias)
        + 2 * (hidden * kv + kv)  # k_proj, v_proj (+ bias)
        + q * hidden  # o_proj
        + 3 * hidden * ffn  # gate, up, down
        + 2 * hidden  # two RMSNorms
    )
    return _decoder(name, layers, hidden, q, kv, vocab, tied, per_layer, per_layer)


def qwen3(
    name: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    ffn: int = 0,
    experts: int = 0,
    experts_per_token: int = 0,
    expert_ffn: int = 0,
    head_dim: int = 128,
) -> ModelSpec:
    """A Qwen3-family decoder (untied) from its ``config.json``: no QKV bias, an RMSNorm on each
    q and k head, SwiGLU; dense (``ffn``) or a routed MoE in every layer (``experts`` of
    ``expert_ffn``, ``experts_per_token`` per token, a linear router, no shared expert)."""
    kv = kv_heads * head_dim
    q = heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden + 2 * head_dim  # q, k, v, o; q/k norms
    norms = 2 * hidden
    moe = {"num_experts": experts, "active_experts": float(experts_per_token)}
    if experts:
        one_expert = 3 * hidden * expert_ffn
        moe["expert_params"] = float(layers * experts * one_expert)
        router = hidden * experts
        per_layer = attn + norms + router + experts * one_expert
        active_layer = attn + norms + router + experts_per_token * one_expert
    else:
        per_layer = active_layer = attn + norms + 3 * hidden * ffn
    return _decoder(name, layers, hidden, q, kv, vocab, False, per_layer, active_layer, **moe)


def _longcat_flash() -> ModelSpec:
    # LongCat-Flash (the base of LongCat-Flash-Thinking, the ~500B MoE the paper trains):
    # - 560B total, 18.6B-31.3B activated per token, 27B on average: LongCat-Flash technical
    #   report (arXiv 2509.01322) abstract; HF transformers docs "LongCatFlash".
    # - config.json (huggingface.co/meituan-longcat/LongCat-Flash-Chat, mirrored by
    #   mlx-community/LongCat-Flash-Chat-bf16): num_layers 28 with two MLA blocks each (the HF port
    #   counts num_hidden_layers = 2 * num_layers), hidden 6144, 64 heads, kv_lora_rank 512,
    #   qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, 512 routed FFN experts (plus 256
    #   zero-computation ones), expert_ffn_hidden_size 2048, moe_topk 12.
    layers, mla_blocks, hidden, heads = 28, 56, 6144, 64
    experts, expert_ffn = 512, 2048
    expert_params = float(layers * experts * 3 * hidden * expert_ffn)  # 541.2B
    total, active = 560e9, 27e9
    dense_part = total - expert_params
    # real FFN experts a token uses on average (the rest of its top-12 are zero experts)
    active_experts = (active - dense_part) / (expert_params / experts)
    return ModelSpec(
        name="longcat-flash-560b",
        params_total=total,
        params_active=active,
        num_layers=mla_blocks,
        hidden=hidden,
        kv_bytes_per_token=mla_blocks * (512 + 64) * BF16,  # MLA caches the latent + rope key
        attn_flops_per_pair=2.0 * mla_blocks * heads * (128 + 64 + 128),
        allreduces_per_forward=2 * mla_blocks,
        expert_params=expert_params,
        num_experts=experts,
        active_experts=active_experts,
    )


# what the Qwen3 MoE configs below share: 4 KV heads, 128 experts, 8 per token, vocab 151936
_qwen3_moe = partial(qwen3, kv_heads=4, vocab=151936, experts=128, experts_per_token=8)

MODELS: dict[str, ModelSpec] = {
    # Qwen2.5-7B config.json (huggingface.co/Qwen/Qwen2.5-7B): 28 layers, hidden 3584, 28 Q / 4
    # KV heads, intermediate 18944, vocab 152064, tie_word_embeddings false -> 7.62B parameters
    # (model card: "Number of Parameters: 7.61B").
    "qwen2.5-7b": qwen2_dense(
        "qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064
    ),
    # Qwen2.5-32B config.json (huggingface.co/Qwen/Qwen2.5-32B): 64 layers, hidden 5120, 40 Q / 8
    # KV heads, intermediate 27648, vocab 152064, untied -> 32.76B parameters (model card: 32.5B;
    # the card rounds differently, the architecture gives 32,763,876,352).
    "qwen2.5-32b": qwen2_dense(
        "qwen2.5-32b", layers=64, hidden=5120, heads=40, kv_heads=8, ffn=27648, vocab=152064
    ),
    # Qwen3-32B config.json (huggingface.co/Qwen/Qwen3-32B): 64 layers, hidden 5120, 64 Q / 8 KV
    # heads of 128, intermediate 25600, vocab 151936, untied -> 32.76B (model card: 32.8B, 31.2B
    # without the embeddings).
    "qwen3-32b": qwen3(
        "qwen3-32b", layers=64, hidden=5120, heads=64, kv_heads=8, vocab=151936, ffn=25600
    ),
    # Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 Q / 4 KV heads of 128, 128 experts of
    # moe_intermediate_size 768, 8 per token, vocab 151936, untied -> 30.5B total, 3.0B multiplied
    # per token (model card: 30.5B, 3.3B activated, which counts the input embedding too).
    "qwen3-30b-a3b": _qwen3_moe("qwen3-30b-a3b", layers=48, hidden=2048, heads=32, expert_ffn=768),
    # Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 Q / 4 KV heads of 128, 128 experts
    # of 1536, 8 per token, vocab 151936, untied -> 235.1B total, 21.6B multiplied per token
    # (model card: 235B, 22B activated).
    "qwen3-235b-a22b": _qwen3_moe(
        "qwen3-235b-a22b", layers=94, hidden=4096, heads=64, expert_ffn=1536
    ),
    "longcat-flash-560b": _longcat_flash(),
    # the default task's policy (configs/default.yaml): 2 layers, hidden 64, 4 Q / 2 KV heads of
    # 16, intermediate 128, vocab 64, tied embeddings: 78k parameters. Its costs come from
    # measurement (hardware 'cpu', benchmarks/calibrate_cpu.py), not from this spec.
    "tiny-default": qwen2_dense(
        "tiny-default",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=64,
        head_dim=16,
        tied=True,
    ),
}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name`` (see :data:`MODELS`)."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None
