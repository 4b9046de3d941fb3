"""GPU check of dora_jax.kernels: compile, compare with the references, time decode attention.

``python launch/gpu_check_kernels.py [--interpret] [--repeats N] [--out PATH]``

1. Correctness: the Pallas kernels (compiled for the default backend, or in interpret mode with
   ``--interpret``) against the pure-jnp references, f32 and bf16, at a few shapes: paged decode
   attention (impl "pallas" and JAX's "jax_gpu"), append_kv, append_kv_chunk, pack/unpack.
2. Timing: paged decode attention per impl and tuning. Achieved bandwidth = bytes of K/V read
   (sum of lengths * K * H * 2 * itemsize) / median time; it is compared with an elementwise
   ``x * 2`` over an array of the same size, whose bandwidth counts read + write (2 * bytes).
   Pack/unpack are timed the same way (bytes moved = read + write).

Prints a table and writes JSON (with units and the command) to --out. Exits 1 if a check fails.
``--interpret`` uses tiny shapes and is only a smoke test of this script on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

from dora_jax.kernels import kv_cache_ops as kv  # noqa: E402
from dora_jax.kernels.paged_attention import (  # noqa: E402
    PagedAttentionTuning,
    paged_decode_attention,
)

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error allowed vs the reference (atol)
# JAX's shipped kernel leaves its dots at DEFAULT precision, which the Triton lowering runs as
# TF32 for f32 inputs on a GPU; it is held to this TF32-level bound for f32 instead.
TOL_TF32 = 1e-2


def tolerance(impl: str, dtype: str, interpret: bool) -> float:
    if impl == "jax_gpu" and dtype == "float32" and not interpret:
        return TOL_TF32
    return TOL[dtype]


def case(shape: dict) -> str:
    """Compact shape label for the timing table, e.g. B64 N32 K8 H128 Z16 S2048."""
    if "batch" in shape:
        seq = shape["page_size"] * shape["pages_per_seq"]
        keys = ("batch", "num_heads", "num_kv_heads", "head_dim", "page_size")
        return " ".join(f"{k}{shape[n]}" for k, n in zip("BNKHZ", keys, strict=True)) + f" S{seq}"
    return " ".join(f"{k}{v}" for k, v in shape.items())


def label(tuning) -> str:
    """Short tuning label for the table, e.g. ppcb8/bh16/ks4."""
    if tuning is None:
        return "-"
    return f"ppcb{tuning.pages_per_compute_block}/bh{tuning.block_h}/ks{tuning.k_splits}"


DEFAULT_OUT = "benchmarks/results/gpu_check_kernels.json"


def attention_inputs(
    seed, batch, num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, dtype, full=False
):
    """Random inputs with shuffled distinct pages (page 0 is padding) and ragged lengths."""
    rng = np.random.default_rng(seed)
    seq = pages_per_seq * page_size
    lengths = np.full(batch, seq) if full else rng.integers(0, seq + 1, batch)
    if not full:
        lengths[0] = 0  # one empty row
    total = batch * pages_per_seq + 1
    tables = (rng.permutation(np.arange(1, total)).reshape(batch, pages_per_seq)).astype(np.int32)
    k = rng.standard_normal((num_kv_heads, total, page_size, head_dim), np.float32)
    v = rng.standard_normal((num_kv_heads, total, page_size, head_dim), np.float32)
    q = rng.standard_normal((batch, num_heads, head_dim), np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(tables),
        jnp.asarray(lengths.astype(np.int32)),
    )


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def check_attention(shapes, interpret: bool) -> list[dict]:
    rows = []
    for shape in shapes:
        for dtype in ("float32", "bfloat16"):
            args = attention_inputs(0, **shape, dtype=jnp.dtype(dtype))
            ref = paged_decode_attention(*args, impl="reference")
            for impl, tuning in (
                ("pallas", PagedAttentionTuning()),
                ("pallas", PagedAttentionTuning(pages_per_compute_block=4, k_splits=4)),
                ("jax_gpu", PagedAttentionTuning(k_splits=2)),
            ):
                out = paged_decode_attention(*args, impl=impl, interpret=interpret, tuning=tuning)
                err = max_err(out, ref)
                tol = tolerance(impl, dtype, interpret)
                rows.append(
                    dict(
                        op="paged_decode_attention",
                        impl=impl,
                        dtype=dtype,
                        shape=shape,
                        tuning=label(tuning),
                        max_abs_err=err,
                        tol=tol,
                        ok=bool(err <= tol and jnp.all(jnp.isfinite(out))),
                    )
                )
    return rows


def kv_ops(impl, interpret, kc, vc, new, ids, tables, start, valid, slot_page, slot_off, active):
    """All four KV ops with one impl; unpack scatters a reference pack into reversed page ids."""
    run = dict(impl=impl, interpret=interpret)
    packed = kv.pack_pages(kc, vc, ids, impl="reference")
    return {
        "append_kv": kv.append_kv(
            kc[0], vc[0], new[:, 0], new[:, 1], slot_page, slot_off, active, **run
        ),
        "append_kv_chunk": kv.append_kv_chunk(kc[0], vc[0], new, new, tables, start, valid, **run),
        "pack_pages": kv.pack_pages(kc, vc, ids, **run),
        "unpack_pages": kv.unpack_pages(kc, vc, packed, ids[::-1], **run),
    }


def check_kv_ops(layers, num_kv_heads, pages, page_size, head_dim, interpret: bool) -> list[dict]:
    rows = []
    rng = np.random.default_rng(1)
    shape = (layers, num_kv_heads, pages, page_size, head_dim)
    batch, chunk = 4, 2 * page_size + 3
    tables = jnp.asarray(rng.permutation(np.arange(1, pages))[: batch * 4].reshape(batch, 4))
    inputs = dict(
        ids=jnp.asarray(rng.permutation(np.arange(1, pages))[:6].astype(np.int32)),
        tables=tables.astype(jnp.int32),
        start=jnp.array([0, 3, page_size - 1, 0], jnp.int32),
        valid=jnp.array([chunk, 5, chunk, 0], jnp.int32),
        slot_page=tables[:, 1].astype(jnp.int32),
        slot_off=jnp.array([0, 1, 2, 3], jnp.int32) % page_size,
        active=jnp.array([True, False, True, True]),
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        kc = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
        vc = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
        new = jnp.asarray(rng.standard_normal((batch, chunk, num_kv_heads, head_dim)), dtype)
        got = kv_ops("pallas", interpret, kc, vc, new, **inputs)
        ref = kv_ops("reference", False, kc, vc, new, **inputs)
        for op in got:
            leaves = zip(jax.tree.leaves(got[op]), jax.tree.leaves(ref[op]), strict=True)
            equal = all(bool(jnp.array_equal(a, b)) for a, b in leaves)
            rows.append(
                dict(
                    op=op,
                    impl="pallas",
                    dtype=jnp.dtype(dtype).name,
                    shape=shape,
                    tuning="-",
                    max_abs_err=0.0 if equal else float("nan"),
                    tol=0.0,
                    ok=equal,
                )
            )
    return rows


def median_seconds(call, repeats: int, inner: int = 10) -> float:
    """Median over `repeats` of (time of `inner` back-to-back calls) / inner, after warmup."""
    for _ in range(3):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, dtype, repeats: int) -> float:
    """GB/s of an elementwise x * 2 over nbytes (read + write counted)."""
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    double = jax.jit(lambda a: a * 2)
    seconds = median_seconds(lambda: double(x), repeats)
    return 2 * nbytes / seconds / 1e9


def time_attention(shapes, interpret: bool, repeats: int) -> list[dict]:
    rows = []
    for shape in shapes:
        args = attention_inputs(2, **shape, dtype=jnp.bfloat16, full=True)
        q, k_pages, _, _, lengths = args
        kv_bytes = int(np.sum(np.asarray(lengths))) * k_pages.shape[0] * q.shape[-1] * 2 * 2
        base = copy_bandwidth(kv_bytes, jnp.bfloat16, repeats)
        variants = (
            [("reference", None)]
            + [
                ("pallas", PagedAttentionTuning(pages_per_compute_block=p, k_splits=s))
                for p, s in ((8, 1), (8, 4), (4, 8))
            ]
            + [("jax_gpu", PagedAttentionTuning(k_splits=8))]
        )
        for impl, tuning in variants:
            fn = jax.jit(
                lambda *a, impl=impl, tuning=tuning: paged_decode_attention(
                    *a, impl=impl, interpret=interpret, tuning=tuning
                )
            )
            seconds = median_seconds(lambda fn=fn, args=args: fn(*args), repeats)
            bw = kv_bytes / seconds / 1e9
            rows.append(
                dict(
                    op="paged_decode_attention",
                    impl=impl,
                    dtype="bfloat16",
                    shape=shape,
                    case=case(shape),
                    tuning=label(tuning),
                    time_us=seconds * 1e6,
                    bytes=kv_bytes,
                    bandwidth_gbs=bw,
                    copy_bandwidth_gbs=base,
                    ratio_to_copy=bw / base,
                )
            )
    return rows


def time_migration(layers, num_kv_heads, pages, page_size, head_dim, n, interpret, repeats):
    shape = (layers, num_kv_heads, pages, page_size, head_dim)
    kc, vc = jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16)
    ids = jnp.arange(1, n + 1, dtype=jnp.int32)
    moved = 2 * 2 * layers * num_kv_heads * n * page_size * head_dim * 2  # k+v, read+write, bf16
    base = copy_bandwidth(moved // 2, jnp.bfloat16, repeats)
    mig_shape = dict(L=layers, K=num_kv_heads, P=pages, Z=page_size, H=head_dim, n=n)
    rows = []
    buf = kv.pack_pages(kc, vc, ids, impl="reference")
    for impl in kv.IMPLS:
        pack = jax.jit(
            lambda k, v, i, impl=impl: kv.pack_pages(k, v, i, impl=impl, interpret=interpret)
        )
        # The destination cache is donated and threaded through the calls, as in the engine;
        # without donation XLA would copy the whole cache on every call.
        unpack = jax.jit(
            lambda k, v, b, i, impl=impl: kv.unpack_pages(
                k, v, b, i, impl=impl, interpret=interpret
            ),
            donate_argnums=(0, 1),
        )
        state = [jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16)]

        def unpack_call(unpack=unpack, state=state):
            state[:] = unpack(state[0], state[1], buf, ids)
            return state[0]

        for op, call in (
            ("pack_pages", lambda pack=pack: pack(kc, vc, ids)),
            ("unpack_pages", unpack_call),
        ):
            seconds = median_seconds(call, repeats)
            bw = moved / seconds / 1e9
            rows.append(
                dict(
                    op=op,
                    impl=impl,
                    dtype="bfloat16",
                    shape=mig_shape,
                    case=case(mig_shape),
                    tuning="-",
                    time_us=seconds * 1e6,
                    bytes=moved,
                    bandwidth_gbs=bw,
                    copy_bandwidth_gbs=base,
                    ratio_to_copy=bw / base,
                )
            )
    return rows


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n== {title}")
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    for row in [cols, *cells]:
        print(" | ".join(f"{x:>{w}}" for x, w in zip(row, widths, strict=True)))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode, tiny shapes")
    ap.add_argument("--repeats", type=int, default=None, help="timing repeats (median)")
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    repeats = a.repeats or (3 if a.interpret else 20)
    out = Path(
        a.out or (DEFAULT_OUT.replace(".json", "_interpret.json") if a.interpret else DEFAULT_OUT)
    )
    small = dict(batch=2, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, pages_per_seq=4)
    if a.interpret:
        check_shapes, bench_shapes, mig = [small], [small], (2, 2, 16, 8, 16, 4)
        kv_shape = (2, 2, 24, 8, 16)
    else:
        check_shapes = [
            small | dict(head_dim=128, pages_per_seq=8),
            dict(batch=3, num_heads=14, num_kv_heads=2, head_dim=64, page_size=32, pages_per_seq=8),
            dict(
                batch=4, num_heads=32, num_kv_heads=4, head_dim=128, page_size=16, pages_per_seq=16
            ),
        ]
        bench_shapes = [
            dict(
                batch=64,
                num_heads=32,
                num_kv_heads=8,
                head_dim=128,
                page_size=16,
                pages_per_seq=128,
            ),
            dict(
                batch=8, num_heads=14, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=256
            ),
        ]
        mig, kv_shape = (24, 2, 4096, 16, 64, 256), (2, 4, 64, 16, 128)
    checks = check_attention(check_shapes, a.interpret) + check_kv_ops(*kv_shape, a.interpret)
    print_table(
        "correctness vs reference",
        checks,
        ["op", "impl", "dtype", "tuning", "max_abs_err", "tol", "ok"],
    )
    timings = time_attention(bench_shapes, a.interpret, repeats)
    timings += time_migration(*mig, a.interpret, repeats)
    print_table(
        "timings (median)",
        timings,
        ["op", "case", "impl", "tuning", "time_us", "bandwidth_gbs", "ratio_to_copy"],
    )
    result = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        created_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        device=str(jax.devices()[0].device_kind),
        interpret=a.interpret,
        units=dict(
            max_abs_err="max |pallas - reference| after casting to float32",
            time_us="microseconds, median of repeats of 10 back-to-back calls",
            bytes="bytes of K/V read (attention) or read + written (pack/unpack)",
            bandwidth_gbs="1e9 bytes per second",
            copy_bandwidth_gbs=(
                "1e9 bytes per second of x * 2 over an equal-sized array, read + write"
            ),
            ratio_to_copy="bandwidth_gbs / copy_bandwidth_gbs",
        ),
        checks=checks,
        timings=timings,
        all_ok=all(r["ok"] for r in checks),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nall checks ok: {result['all_ok']}; wrote {out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
