"""The GPU check's kernels section and the measuring helpers the sections share
(``launch/gpu_check.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_plan import (
    KV_OPS,
    AttentionCase,
    Plan,
    attention_cases,
    fitted,
    kernel_variants,
    shape_label,
    tuning_label,
)
from gpu_check_report import Recorder

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error allowed vs the reference
# JAX's shipped kernel leaves its dots at DEFAULT precision, which the Triton lowering runs as
# TF32 for f32 inputs on a GPU; it is held to this TF32-level bound for f32 instead.
TOL_TF32 = 1e-2


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def attention_inputs(seed: int, shape: dict, dtype, full: bool = False):
    """Random inputs with shuffled distinct pages (page 0 is padding) and ragged lengths (one
    empty row), or every sequence full."""
    rng = np.random.default_rng(seed)
    batch, pages_per_seq, page_size = shape["batch"], shape["pages_per_seq"], shape["page_size"]
    kv_heads, head_dim = shape["num_kv_heads"], shape["head_dim"]
    seq = pages_per_seq * page_size
    lengths = np.full(batch, seq) if full else rng.integers(0, seq + 1, batch)
    if not full:
        lengths[0] = 0
    total = batch * pages_per_seq + 1
    tables = rng.permutation(np.arange(1, total)).reshape(batch, pages_per_seq).astype(np.int32)
    k = rng.standard_normal((kv_heads, total, page_size, head_dim), np.float32)
    v = rng.standard_normal((kv_heads, total, page_size, head_dim), np.float32)
    q = rng.standard_normal((batch, shape["num_heads"], head_dim), np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(tables),
        jnp.asarray(lengths.astype(np.int32)),
    )


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def median_seconds(call: Callable[[], Any], plan: Plan) -> float:
    """Median over plan.repeats of (time of plan.inner back-to-back calls) / inner."""
    for _ in range(plan.warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(plan.repeats):
        t0 = time.perf_counter()
        for _ in range(plan.inner):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / plan.inner)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, dtype, plan: Plan) -> dict:
    """GB/s of an elementwise x * 2 over nbytes (read + write counted)."""
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    double = jax.jit(lambda a: a * 2)
    seconds = median_seconds(lambda: double(x), plan)
    return dict(time_us=seconds * 1e6, bytes=2 * nbytes, bandwidth_gbs=2 * nbytes / seconds / 1e9)


def tuning_fields(variant: dict, interpret: bool) -> dict:
    """tuning_used and its modeled shared-memory bytes (interpret mode runs the tuning as is)."""
    tuning, requested_bytes, used, used_bytes = fitted(variant)
    if interpret:
        used, used_bytes = tuning, requested_bytes
    return dict(tuning_used=tuning_label(used), smem_bytes=used_bytes)


# ----------------------------------------------------------------------------------------------
# Section: kernels
# ----------------------------------------------------------------------------------------------


def kernels_section(rec: Recorder, plan: Plan) -> None:
    from dora_jax.kernels import kv_cache_ops as kv
    from dora_jax.kernels import paged_decode_attention

    variants = {v["name"]: v for v in kernel_variants(plan)}

    def tolerance(impl: str, dtype: str) -> float:
        if impl == "jax_gpu" and dtype == "float32" and not plan.interpret:
            return TOL_TF32
        return TOL[dtype]

    def check_attention(c: AttentionCase) -> dict:
        args = attention_inputs(0, c.shape, jnp.dtype(c.dtype))
        ref = paged_decode_attention(*args, impl="reference")
        out = paged_decode_attention(*args, impl=c.impl, interpret=plan.interpret, tuning=c.tuning)
        err, tol = max_err(out, ref), tolerance(c.impl, c.dtype)
        ok = bool(err <= tol and jnp.all(jnp.isfinite(out)))
        return dict(
            max_abs_err=err, tol=tol, ok=ok, **tuning_fields(variants[c.name], plan.interpret)
        )

    baselines: dict[str, dict] = {}  # shape label -> copy figures
    bench_inputs: dict[str, tuple] = {}

    def time_attention(c: AttentionCase) -> dict:
        label = shape_label(c.shape)
        if label not in bench_inputs:
            bench_inputs[label] = attention_inputs(2, c.shape, jnp.bfloat16, full=True)
        args = bench_inputs[label]
        q, k_pages, _, _, lengths = args
        kv_bytes = int(np.sum(np.asarray(lengths))) * k_pages.shape[0] * q.shape[-1] * 2 * 2

        def attend(*a):
            return paged_decode_attention(
                *a, impl=c.impl, interpret=plan.interpret, tuning=c.tuning
            )

        fn = jax.jit(attend)
        seconds = median_seconds(lambda: fn(*args), plan)
        bw = kv_bytes / seconds / 1e9
        base = baselines.get(label, {}).get("bandwidth_gbs")
        row = dict(time_us=seconds * 1e6, bytes=kv_bytes, bandwidth_gbs=bw)
        row.update(copy_bandwidth_gbs=base, ratio_to_copy=bw / base if base else None)
        if c.impl != "reference":
            row.update(tuning_fields(variants[c.name], plan.interpret))
        return row

    # 1. Correctness: paged attention, then the kv-cache kernels.
    cases = attention_cases(plan)
    for c in (c for c in cases if c.kind == "check"):
        labels = dict(op="paged_decode_attention", impl=c.impl, dtype=c.dtype)
        labels.update(shape=shape_label(c.shape), tuning=tuning_label(c.tuning))
        rec.run_case("kernels", "correctness", c.name, lambda c=c: check_attention(c), **labels)

    # Sliding-window decode (Mistral, windowed Qwen layers): the Pallas kernel starts at the
    # first block inside each row's window; checked once per dtype on the first Pallas shape.
    def check_window(c: AttentionCase) -> dict:
        args = attention_inputs(0, c.shape, jnp.dtype(c.dtype))
        window = jnp.maximum(jnp.asarray(args[-1]) // 3, 1).astype(jnp.int32)
        ref = paged_decode_attention(*args, impl="reference", window=window)
        out = paged_decode_attention(
            *args, impl=c.impl, interpret=plan.interpret, tuning=c.tuning, window=window
        )
        err, tol = max_err(out, ref), tolerance(c.impl, c.dtype)
        ok = bool(err <= tol and jnp.all(jnp.isfinite(out)))
        return dict(
            max_abs_err=err, tol=tol, ok=ok, **tuning_fields(variants[c.name], plan.interpret)
        )

    windowed: dict[str, AttentionCase] = {}
    for c in cases:
        if c.kind == "check" and c.impl == "pallas":
            windowed.setdefault(c.dtype, c)
    for c in windowed.values():
        labels = dict(op="paged_decode_attention window", impl=c.impl, dtype=c.dtype)
        labels.update(shape=shape_label(c.shape), tuning=tuning_label(c.tuning))
        name = c.name.replace("/paged_decode_attention/", "/paged_decode_attention_window/")
        rec.run_case("kernels", "correctness", name, lambda c=c: check_window(c), **labels)

    kv_shape = plan.kv_check

    def check_kv(op: str, dtype: str) -> dict:
        got = kv_op(kv, op, "pallas", plan.interpret, kv_shape, jnp.dtype(dtype))
        ref = kv_op(kv, op, "reference", False, kv_shape, jnp.dtype(dtype))
        leaves = zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
        equal = all(bool(jnp.array_equal(a, b)) for a, b in leaves)
        name = f"kernels/check/{op}/pallas/{dtype}/{shape_label(kv_shape)}"
        return dict(
            max_abs_err=0.0 if equal else float("nan"),
            tol=0.0,
            ok=equal,
            **tuning_fields(variants[name], plan.interpret),
        )

    for dtype in ("float32", "bfloat16"):
        for op in KV_OPS:
            name = f"kernels/check/{op}/pallas/{dtype}/{shape_label(kv_shape)}"
            labels = dict(op=op, impl="pallas", dtype=dtype, shape=shape_label(kv_shape))
            rec.run_case(
                "kernels",
                "correctness",
                name,
                lambda op=op, dtype=dtype: check_kv(op, dtype),
                tuning="st1",
                **labels,
            )

    # 2. Timing: a device copy of the same bytes first, then every attention variant.
    for shape in plan.bench_shapes:
        label = shape_label(shape)
        seq_tokens = shape["batch"] * shape["pages_per_seq"] * shape["page_size"]
        kv_bytes = seq_tokens * shape["num_kv_heads"] * shape["head_dim"] * 2 * 2

        def baseline(label=label, kv_bytes=kv_bytes) -> dict:
            baselines[label] = copy_bandwidth(kv_bytes, jnp.bfloat16, plan)
            return baselines[label]

        labels = dict(op="copy x*2", impl="xla", dtype="bfloat16", shape=label, tuning="-")
        rec.run_case("kernels", "timing", f"kernels/time/copy/{label}", baseline, **labels)
        for c in (c for c in cases if c.kind == "time" and c.shape == shape):
            labels = dict(op="paged_decode_attention", impl=c.impl, dtype=c.dtype, shape=label)
            labels["tuning"] = tuning_label(c.tuning)
            rec.run_case("kernels", "timing", c.name, lambda c=c: time_attention(c), **labels)
        bench_inputs.pop(label, None)

    time_migration(rec, plan, kv, variants)


def kv_op(kv, op: str, impl: str, interpret: bool, shape, dtype):
    """One kv-cache op on fixed random inputs (the same for every impl); unpack scatters a
    reference pack into reversed page ids."""
    layers, kv_heads, pages, page_size, head_dim = shape
    rng = np.random.default_rng(1)
    batch, chunk = 4, 2 * page_size + 3
    tables = jnp.asarray(rng.permutation(np.arange(1, pages))[: batch * 4].reshape(batch, 4))
    tables = tables.astype(jnp.int32)
    ids = jnp.asarray(rng.permutation(np.arange(1, pages))[:6].astype(np.int32))
    kc = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    vc = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    new = jnp.asarray(rng.standard_normal((batch, chunk, kv_heads, head_dim)), dtype)
    run = dict(impl=impl, interpret=interpret)
    if op == "append_kv":
        slot_page = tables[:, 1]
        slot_off = jnp.array([0, 1, 2, 3], jnp.int32) % page_size
        active = jnp.array([True, False, True, True])
        return kv.append_kv(kc[0], vc[0], new[:, 0], new[:, 1], slot_page, slot_off, active, **run)
    if op == "append_kv_chunk":
        start = jnp.array([0, 3, page_size - 1, 0], jnp.int32)
        valid = jnp.array([chunk, 5, chunk, 0], jnp.int32)
        return kv.append_kv_chunk(kc[0], vc[0], new, new, tables, start, valid, **run)
    if op == "pack_pages":
        return kv.pack_pages(kc, vc, ids, **run)
    packed = kv.pack_pages(kc, vc, ids, impl="reference")
    return kv.unpack_pages(kc, vc, packed, ids[::-1], **run)


def time_migration(rec: Recorder, plan: Plan, kv, variants: dict) -> None:
    """pack/unpack of n pages of every layer, reference and Pallas (bytes = read + write)."""
    layers, kv_heads, pages, page_size, head_dim, n = plan.migration
    shape = (layers, kv_heads, pages, page_size, head_dim)
    label = shape_label(plan.migration)
    moved = 2 * 2 * layers * kv_heads * n * page_size * head_dim * 2  # k+v, read+write, bf16
    state: dict[str, Any] = {}

    def setup() -> dict:
        state["kc"] = jnp.ones(shape, jnp.bfloat16)
        state["vc"] = jnp.ones(shape, jnp.bfloat16)
        state["ids"] = jnp.arange(1, n + 1, dtype=jnp.int32)
        state["buf"] = kv.pack_pages(state["kc"], state["vc"], state["ids"], impl="reference")
        state["base"] = copy_bandwidth(moved // 2, jnp.bfloat16, plan)
        return state["base"]

    labels = dict(op="copy x*2", impl="xla", dtype="bfloat16", shape=label, tuning="-")
    rec.run_case("kernels", "timing", f"kernels/time/copy/{label}", setup, **labels)

    def run(op: str, impl: str) -> dict:
        if "base" not in state:
            raise RuntimeError(f"no inputs: the case kernels/time/copy/{label} failed")
        kc, vc, ids, buf = state["kc"], state["vc"], state["ids"], state["buf"]
        if op == "pack_pages":
            pack = jax.jit(
                lambda k, v, i: kv.pack_pages(k, v, i, impl=impl, interpret=plan.interpret)
            )

            def call():
                return pack(kc, vc, ids)
        else:
            # The destination cache is donated and threaded through the calls, as in the engine;
            # without donation XLA would copy the whole cache on every call.
            unpack = jax.jit(
                lambda k, v, b, i: kv.unpack_pages(k, v, b, i, impl=impl, interpret=plan.interpret),
                donate_argnums=(0, 1),
            )
            dst = [jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16)]

            def call():
                dst[:] = unpack(dst[0], dst[1], buf, ids)
                return dst[0]

        seconds = median_seconds(call, plan)
        bw = moved / seconds / 1e9
        base = state["base"]["bandwidth_gbs"]
        row = dict(time_us=seconds * 1e6, bytes=moved, bandwidth_gbs=bw)
        row.update(copy_bandwidth_gbs=base, ratio_to_copy=bw / base)
        if impl == "pallas":
            row.update(
                tuning_fields(
                    variants[f"kernels/time/{op}/pallas/bfloat16/{label}"], plan.interpret
                )
            )
        return row

    for impl in kv.IMPLS:
        for op in ("pack_pages", "unpack_pages"):
            labels = dict(op=op, impl=impl, dtype="bfloat16", shape=label)
            labels["tuning"] = "st1" if impl == "pallas" else "-"
            name = f"kernels/time/{op}/{impl}/bfloat16/{label}"
            rec.run_case(
                "kernels", "timing", name, lambda op=op, impl=impl: run(op, impl), **labels
            )
