"""What the GPU check runs: the GPU plan and the CPU smoke plan, the attention cases and
the kernel tunings (``launch/gpu_check.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# ----------------------------------------------------------------------------------------------
# What to run: the GPU plan and the CPU smoke plan
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes and repeat counts of one run."""

    interpret: bool  # Pallas interpret mode (the CPU smoke run)
    repeats: int  # timed repeats (median)
    inner: int  # back-to-back calls per timed repeat
    warmup: int  # calls before timing
    check_shapes: tuple[dict, ...]  # paged attention correctness
    bench_shapes: tuple[dict, ...]  # paged attention timing (bf16, every sequence full)
    kv_check: tuple[int, int, int, int, int]  # L K P Z H of the kv-op correctness cache
    migration: tuple[int, int, int, int, int, int]  # L K P Z H n of the pack/unpack timing
    engine_model: dict  # ModelConfig fields (bf16 params and compute)
    engine_rollout: dict  # RolloutConfig fields
    train_model: dict  # ModelConfig fields of the train-step timing (bf16, fp32 master weights)
    train_lengths: tuple[int, ...]  # tokens per row of the timed train steps
    train_rows: int  # rows per train step (one trajectory each)
    moe_dims: tuple[int, int, int, int] = (256, 128, 2, 2048)  # D, expert ffn, top-k, tokens
    # the packed-against-padded train step: trajectories, median response length, longest
    # trajectory, length buckets (lognormal lengths, p99/median > 10)
    train_mix: tuple[int, int, int, tuple[int, ...]] = (16, 256, 8192, (1024, 2048, 4096, 8192))
    # the GRPO run of SmolLM2-135M-Instruct (launch/gpu_check_grpo.py): the recipe
    # configs/recipes/smollm2-add-cpu.yaml on one device, these settings replacing its own
    grpo: dict = dataclasses.field(default_factory=lambda: dict(GRPO_GPU))
    # where its weights come from (relative to the repository root unless absolute): the
    # prepared Hugging Face directory, else the GGUF it is converted from (on this machine)
    grpo_model_dir: str = "models/smollm2-135m-instruct"
    grpo_gguf: str = ".gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf"


# The GRPO case on one GPU: trainer and rollout groups colocated on device 0 (as
# configs/qwen2.5-0.5b-1gpu.yaml), bf16 params and compute with float32 master weights, the Pallas
# decode kernels, the wall clock; 16 prompts x 8 samples a step (4x the recipe's batch), the
# recipe's 200 held-out problems before and after.
GRPO_GPU = dict(
    steps=5,
    train_batch_prompts=16,
    rollout_batch_prompts=32,
    group_size=8,
    groups=2,
    max_slots=128,
    max_new_tokens=64,
    eval_prompts=200,
    dtype="bfloat16",
    attention_impl="pallas",
)
# The CPU smoke run: one step of 1 prompt x 2 samples of 8 tokens, 2 held-out problems; float32
# and the reference attention (the engine would swap interpret-mode Pallas for it on a CPU).
GRPO_SMOKE = dict(
    steps=1,
    train_batch_prompts=1,
    rollout_batch_prompts=1,
    group_size=2,
    groups=1,
    max_slots=2,
    max_new_tokens=8,
    eval_prompts=2,
    dtype="float32",
    attention_impl="reference",
)


def _attn(batch, num_heads, num_kv_heads, head_dim, page_size, pages_per_seq) -> dict:
    return dict(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
    )


def gpu_plan(repeats: int | None = None) -> Plan:
    return Plan(
        interpret=False,
        repeats=repeats or 20,
        inner=10,
        warmup=3,
        check_shapes=(
            _attn(2, 4, 2, 128, 8, 8),
            _attn(3, 14, 2, 64, 32, 8),
            _attn(4, 32, 4, 128, 16, 16),
        ),
        bench_shapes=(_attn(64, 32, 8, 128, 16, 128), _attn(8, 14, 2, 64, 16, 256)),
        kv_check=(2, 4, 64, 16, 128),
        migration=(24, 2, 4096, 16, 64, 256),
        # Qwen2.5-0.5B's attention and MLP widths with 8 of its 24 layers and a smaller vocabulary.
        engine_model=dict(
            vocab_size=32768,
            hidden_size=896,
            intermediate_size=4864,
            num_layers=8,
            num_heads=14,
            num_kv_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
        ),
        engine_rollout=dict(
            max_slots=64, page_size=16, max_prompt_len=128, max_new_tokens=256, prefill_chunk=128
        ),
        # Qwen2.5-0.5B's shape (494M params), blockwise attention, nested remat
        train_model=dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            attention_block=256,
            seq_chunk=256,
        ),
        train_lengths=(4096, 16384),
        train_rows=4,
        moe_dims=(2048, 768, 8, 8192),  # Qwen3-30B-A3B's hidden, expert width and top-8
    )


def smoke_plan(repeats: int | None = None) -> Plan:
    small = _attn(2, 4, 2, 16, 8, 4)
    return Plan(
        interpret=True,
        repeats=repeats or 2,
        inner=2,
        warmup=1,
        check_shapes=(small,),
        bench_shapes=(small,),
        kv_check=(2, 2, 24, 8, 16),
        migration=(2, 2, 16, 8, 16, 4),
        engine_model=dict(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=256,
        ),
        engine_rollout=dict(
            max_slots=4, page_size=8, max_prompt_len=8, max_new_tokens=8, prefill_chunk=8
        ),
        train_model=dict(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=256,
            attention_block=16,
            seq_chunk=16,
        ),
        train_lengths=(32, 64),
        train_rows=2,
        moe_dims=(64, 32, 2, 256),
        train_mix=(8, 4, 64, (16, 32, 64)),
        grpo=dict(GRPO_SMOKE),
    )


def shape_label(shape: dict | tuple) -> str:
    """B64 N32 K8 H128 Z16 S2048 for attention shapes; L.. K.. P.. Z.. H.. (n..) for caches."""
    if isinstance(shape, dict):
        seq = shape["page_size"] * shape["pages_per_seq"]
        keys = ("batch", "num_heads", "num_kv_heads", "head_dim", "page_size")
        return " ".join(f"{k}{shape[n]}" for k, n in zip("BNKHZ", keys, strict=True)) + f" S{seq}"
    return " ".join(f"{k}{v}" for k, v in zip("LKPZHn", shape, strict=False))


def tuning_label(tuning) -> str:
    """ppcb8/bh16/ks1/st2 for attention tunings, st1 for copy tunings, - for none."""
    if tuning is None:
        return "-"
    if hasattr(tuning, "pages_per_compute_block"):
        return (
            f"ppcb{tuning.pages_per_compute_block}/bh{tuning.block_h}/ks{tuning.k_splits}"
            f"/st{tuning.num_stages}"
        )
    return f"st{tuning.num_stages}"


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    kind: str  # "check" or "time"
    shape: dict
    dtype: str
    impl: str  # "reference", "pallas" or "jax_gpu"
    tuning: Any  # PagedAttentionTuning or None (reference)

    @property
    def name(self) -> str:
        return (
            f"kernels/{self.kind}/paged_decode_attention/{self.impl}/{self.dtype}/"
            f"{shape_label(self.shape)}/{tuning_label(self.tuning)}"
        )


def attention_cases(plan: Plan) -> list[AttentionCase]:
    """Every paged-attention case of the kernels section, correctness first."""
    from dora_jax.kernels import PagedAttentionTuning as T

    check = (("pallas", T()), ("pallas", T(pages_per_compute_block=4, k_splits=4)))
    check += (("jax_gpu", T(k_splits=2)),)
    bench = (("reference", None),)
    bench += tuple(("pallas", T(pages_per_compute_block=p, k_splits=s)) for p, s in PALLAS_BENCH)
    bench += (("jax_gpu", T(k_splits=8)),)
    cases = [
        AttentionCase("check", shape, dtype, impl, tuning)
        for shape in plan.check_shapes
        for dtype in ("float32", "bfloat16")
        for impl, tuning in check
    ]
    return cases + [
        AttentionCase("time", shape, "bfloat16", impl, tuning)
        for shape in plan.bench_shapes
        for impl, tuning in bench
    ]


PALLAS_BENCH = ((8, 1), (8, 4), (4, 8))  # (pages_per_compute_block, k_splits) timed
KV_OPS = ("append_kv", "append_kv_chunk", "pack_pages", "unpack_pages")
KV_KERNEL = dict(append_kv="append", append_kv_chunk="append", pack_pages="page_copy")
KV_KERNEL.update(unpack_pages="page_copy")


def kernel_variants(plan: Plan) -> list[dict]:
    """Every compiled Pallas kernel launch of this check (name, kernel, dtype, shapes, tuning):
    what the shared-memory budget must cover. kernel is "attention", "append" or "page_copy"."""
    from dora_jax.kernels import KVCopyTuning

    out = []
    for c in attention_cases(plan):
        if c.impl != "reference":
            out.append(
                dict(
                    name=c.name,
                    kernel="attention",
                    dtype=c.dtype,
                    head_dim=c.shape["head_dim"],
                    page_size=c.shape["page_size"],
                    pages_per_seq=c.shape["pages_per_seq"],
                    tuning=c.tuning,
                )
            )
    _, _, _, page_size, head_dim = plan.kv_check
    for dtype in ("float32", "bfloat16"):
        for op in KV_OPS:
            out.append(
                dict(
                    name=f"kernels/check/{op}/pallas/{dtype}/{shape_label(plan.kv_check)}",
                    kernel=KV_KERNEL[op],
                    dtype=dtype,
                    head_dim=head_dim,
                    page_size=page_size,
                    tuning=KVCopyTuning(),
                )
            )
    _, _, _, page_size, head_dim, _ = plan.migration
    for op in ("pack_pages", "unpack_pages"):
        out.append(
            dict(
                name=f"kernels/time/{op}/pallas/bfloat16/{shape_label(plan.migration)}",
                kernel="page_copy",
                dtype="bfloat16",
                head_dim=head_dim,
                page_size=page_size,
                tuning=KVCopyTuning(),
            )
        )
    m, r = plan.engine_model, plan.engine_rollout
    pages_per_seq = -(-(r["max_prompt_len"] + r["max_new_tokens"]) // r["page_size"])
    for kernel in ("attention", "append"):
        out.append(
            dict(
                name=f"engine/decode/pallas/{kernel}",
                kernel=kernel,
                dtype="bfloat16",
                head_dim=m["head_dim"],
                page_size=r["page_size"],
                pages_per_seq=pages_per_seq,
                tuning=None,  # the engine runs the default tunings
            )
        )
    return out


def fitted(variant: dict, limit: int | None = None) -> tuple[Any, int, Any, int]:
    """(requested tuning, its modeled bytes, the tuning the compiled kernel runs with, its bytes)
    of one kernel_variants entry, from the kernels' own budget functions."""
    from dora_jax import kernels as k

    v, dtype = variant, jnp.dtype(variant["dtype"])
    if v["kernel"] == "attention":
        tuning = v["tuning"] or k.PagedAttentionTuning()
        shape = (v["head_dim"], v["page_size"], v["pages_per_seq"], dtype)
        used = k.fit_attention_tuning(*shape, tuning, limit)
        nbytes = k.attention_shared_memory_bytes
        return tuning, nbytes(*shape, tuning), used, nbytes(*shape, used)
    tuning = v["tuning"] or k.KVCopyTuning()
    used = k.fit_copy_tuning(v["kernel"], v["page_size"], v["head_dim"], dtype, tuning, limit)
    if v["kernel"] == "append":
        return (
            tuning,
            k.append_shared_memory_bytes(v["head_dim"], dtype, tuning),
            used,
            k.append_shared_memory_bytes(v["head_dim"], dtype, used),
        )
    nbytes = k.page_copy_shared_memory_bytes
    shape = (v["page_size"], v["head_dim"], dtype)
    return tuning, nbytes(*shape, tuning), used, nbytes(*shape, used)
