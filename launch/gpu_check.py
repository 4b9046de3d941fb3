"""The project's GPU check: compiled kernels and the engine on a real device, section by section.

On a GPU machine, from the repository root, without installing anything::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 launch/gpu_check.py --out DIR

and on the CPU, at tiny shapes with the Pallas kernels in interpret mode (a smoke test)::

    PYTHONPATH=. python3 launch/gpu_check.py --cpu-smoke --out /tmp/gc

Sections (``--sections``, default all), each independent of the others:

kernels  Compiled Pallas paged decode attention (ours and JAX's) and the kv-cache kernels against
         the pure-jnp references (correctness), then timings: achieved bandwidth of paged decode
         and of page pack/unpack against an elementwise device copy of the same bytes.
engine   Decode tokens/s of the rollout engine (a small bf16 model, greedy, continuous batching)
         with the reference attention and with the Pallas kernels.
train    Train-step tokens/s and MFU of the GRPO step at Qwen2.5-0.5B's shape (bf16, float32
         master weights, blockwise attention, nested remat) at 4k and 16k tokens per row.

Every case runs in its own try: a case that raises is recorded with its error text and the run
goes on. Results are written after every case, so a crash or a kill loses only the case in
flight. Files written to DIR: ``gpu_check.json`` (everything, with units), ``gpu_check.md`` (the
tables) and ``gpu_check.log`` (what was printed).

Exit status: 0 every case ran and passed; 1 some case raised, failed its check or was skipped (the
other figures are written); 2 bad arguments; 3 the default backend is not a GPU and --cpu-smoke
was not given (nothing is run).

Only jax, numpy and the standard library are imported here; the sections import the parts of
dora_jax they need when they start, so an import error is recorded as that section's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runs without PYTHONPATH=.
    sys.path.insert(0, str(ROOT))

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.log")

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error allowed vs the reference
# JAX's shipped kernel leaves its dots at DEFAULT precision, which the Triton lowering runs as
# TF32 for f32 inputs on a GPU; it is held to this TF32-level bound for f32 instead.
TOL_TF32 = 1e-2

UNITS = dict(
    max_abs_err="max |kernel - reference| after casting to float32",
    smem_bytes="modeled shared memory per program of the compiled kernel (tuning_used), bytes",
    time_us="microseconds, median of repeats of `inner` back-to-back calls",
    bytes="bytes of K/V read (attention) or read + written (pack/unpack)",
    bandwidth_gbs="1e9 bytes per second",
    copy_bandwidth_gbs="1e9 bytes per second of x * 2 over an equal-sized array, read + write",
    ratio_to_copy="bandwidth_gbs / copy_bandwidth_gbs",
    decode_tokens_per_s="tokens sampled by decode steps / wall seconds of the decode calls",
    tokens_per_s="all sampled tokens / wall seconds of the whole round (prefill included)",
)


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


# ----------------------------------------------------------------------------------------------
# Recording: one row per case, written after every case
# ----------------------------------------------------------------------------------------------


def error_text(exc: BaseException, limit: int = 2000) -> str:
    """`Type: message`, the middle cut out past `limit` characters (compiler errors are long)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > limit:
        cut = len(text) - limit
        text = f"{text[: limit // 2]} [... {cut} characters cut ...] {text[-limit // 2 :]}"
    return text


class WarningLog:
    """A `warnings.showwarning` that prints the first warning of each kind and place once and
    counts the rest (the Triton lowering warns at every kernel it lowers, perhaps with the
    kernel's name in the text, so the place, not the text, identifies a warning)."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.seen: dict[tuple[str, str, int], dict] = {}

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        key = (category.__name__, str(filename), int(lineno))
        if key in self.seen:
            self.seen[key]["count"] += 1
            return
        text = " ".join(str(message).split())[:300]
        self.seen[key] = dict(category=category.__name__, message=text, count=1)
        self.say(f"warning (shown once): {category.__name__}: {text} [{filename}:{lineno}]")

    def rows(self) -> list[dict]:
        return [dict(row) for row in self.seen.values()]


class Recorder:
    """Runs cases in isolation and keeps DIR/gpu_check.{json,md,log} up to date."""

    def __init__(self, out_dir: Path, meta: dict, *, only, fail_case, deadline: float):
        self.out_dir = out_dir
        self.only, self.fail_case, self.deadline = only, fail_case, deadline
        self.result = dict(meta, units=UNITS, sections={}, warnings=[], finished=False)
        self.log = (out_dir / "gpu_check.log").open("w")
        self.warning_log = WarningLog(self.say)

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def section(self, name: str) -> dict:
        return self.result["sections"].setdefault(name, dict(status="running", cases=[]))

    def run_case(self, section: str, table: str, name: str, fn: Callable[[], dict], **labels):
        """Runs fn() (a dict of figures; ok=False marks a failed check) as one case. Returns the
        recorded row, or None when --only leaves the case out."""
        if self.only and not any(s in name for s in self.only):
            return None
        row = dict(case=name, table=table, **labels)
        t0 = time.perf_counter()
        if time.monotonic() > self.deadline:
            row.update(status="skipped", error="time budget (--max-seconds) spent")
        else:
            try:
                if any(s in name for s in self.fail_case):
                    raise RuntimeError(f"forced failure of {name} (--fail-case)")
                figures = fn()
                row.update(figures)
                row["status"] = "ok" if figures.get("ok", True) else "failed"
            except Exception as exc:  # every failure is a figure to keep
                row.update(status="error", error=error_text(exc))
                row["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
        row["seconds"] = round(time.perf_counter() - t0, 3)
        self.section(section)["cases"].append(row)
        shown = {k: row[k] for k in SHOWN.get(table, ()) if k in row}
        extra = row.get("error") or " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
        self.say(f"[{row['status']}] {name} ({row['seconds']:.1f}s) {extra}")
        self.write()
        return row

    def end_section(self, name: str, exc: BaseException | None = None) -> None:
        sec = self.section(name)
        sec["status"] = "done" if exc is None else "error"
        if exc is not None:
            sec["error"] = error_text(exc)
            sec["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
            self.say(f"[section error] {name}: {sec['error']}")
        for table, cols in TABLES.items():
            rows = [r for r in sec["cases"] if r["table"] == table]
            if rows:
                self.say(f"\n== {name}: {table}")
                for line in text_table(rows, cols):
                    self.say(line)
        self.say()
        self.write()

    def summary(self) -> dict:
        rows = [r for s in self.result["sections"].values() for r in s["cases"]]
        counts = {k: sum(r["status"] == k for r in rows) for k in STATUSES}
        section_errors = [n for n, s in self.result["sections"].items() if s["status"] == "error"]
        all_ok = bool(rows) and counts["ok"] == len(rows) and not section_errors
        return dict(cases=len(rows), **counts, section_errors=section_errors, all_ok=all_ok)

    def write(self, finished: bool = False) -> None:
        self.result.update(
            warnings=self.warning_log.rows(), summary=self.summary(), finished=finished
        )
        (self.out_dir / "gpu_check.json").write_text(
            json.dumps(self.result, indent=1, default=str) + "\n"
        )
        (self.out_dir / "gpu_check.md").write_text(markdown(self.result))


STATUSES = ("ok", "failed", "error", "skipped")
TABLES = {
    "correctness": ["op", "impl", "dtype", "shape", "tuning", "tuning_used", "smem_bytes"]
    + ["max_abs_err", "tol", "status"],
    "timing": ["op", "shape", "impl", "tuning", "tuning_used", "time_us", "bandwidth_gbs"]
    + ["copy_bandwidth_gbs", "ratio_to_copy", "status"],
    "engine": ["impl", "model", "slots", "decode_tokens", "decode_tokens_per_s", "tokens_per_s"]
    + ["status"],
    "moe": ["impl", "experts", "shape", "max_abs_err", "tol", "tokens_per_s", "status"],
}
SHOWN = dict(
    correctness=("max_abs_err", "tuning_used"),
    timing=("time_us", "bandwidth_gbs", "ratio_to_copy", "tuning_used"),
    engine=("decode_tokens_per_s", "tokens_per_s"),
    train=("tokens_per_s", "mfu", "step_s"),
    moe=("max_abs_err", "tokens_per_s"),
)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def text_table(rows: list[dict], cols: list[str]) -> list[str]:
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    return [
        " | ".join(f"{x:>{w}}" for x, w in zip(row, widths, strict=True)) for row in [cols, *cells]
    ]


def markdown(result: dict) -> str:
    s = result.get("summary", {})
    lines = [
        "# GPU check",
        "",
        f"- command: `{result['command']}`",
        f"- jax {result['jax_version']}, backend {result['backend']}, device "
        f"{result['device_kind']}, interpret {result['interpret']}",
        f"- created {result['created_utc']}; finished: {result['finished']}",
        f"- cases: {s.get('cases', 0)}, ok {s.get('ok', 0)}, failed {s.get('failed', 0)}, "
        f"error {s.get('error', 0)}, skipped {s.get('skipped', 0)}",
    ]
    for name, sec in result["sections"].items():
        lines += ["", f"## {name} ({sec['status']})"]
        if sec.get("error"):
            lines += ["", f"Section error: `{sec['error'][:500]}`"]
        for table, cols in TABLES.items():
            rows = [r for r in sec["cases"] if r["table"] == table]
            if rows:
                lines += ["", f"### {table}", "", "| " + " | ".join(cols) + " |"]
                lines.append("|" + "---|" * len(cols))
                lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        bad = [r for r in sec["cases"] if r.get("error")]
        if bad:
            lines += ["", "### errors", ""]
            lines += [f"- `{r['case']}`: {r['error'][:500]}" for r in bad]
    if result.get("warnings"):
        lines += ["", "## warnings", ""]
        lines += [f"- {w['category']} x{w['count']}: {w['message']}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


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


# ----------------------------------------------------------------------------------------------
# Section: engine decode tokens/s
# ----------------------------------------------------------------------------------------------


def engine_section(rec: Recorder, plan: Plan) -> None:
    from dora_jax.config import ModelConfig, RolloutConfig
    from dora_jax.mesh import make_mesh
    from dora_jax.model import init_params
    from dora_jax.rollout import Engine, Request, request_key

    cfg = ModelConfig(**plan.engine_model, param_dtype="bfloat16", compute_dtype="bfloat16")
    r = plan.engine_rollout
    pages_per_seq = -(-(r["max_prompt_len"] + r["max_new_tokens"]) // r["page_size"])
    base = dict(r, num_pages=1 + r["max_slots"] * pages_per_seq, temperature=0.0, decode_steps=8)
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    params: dict[str, Any] = {}
    model = f"L{cfg.num_layers} D{cfg.hidden_size} N{cfg.num_heads} K{cfg.num_kv_heads}"
    model += f" H{cfg.resolved_head_dim} V{cfg.vocab_size} bf16"

    def one_round(engine, round_id: int) -> dict:
        rng = np.random.default_rng(round_id)
        reqs = [
            Request(
                (round_id, i),
                [int(t) for t in rng.integers(1, cfg.vocab_size, r["max_prompt_len"])],
                0,
                request_key(round_id, i),
                r["max_new_tokens"],
            )
            for i in range(r["max_slots"])
        ]
        totals = dict(sampled=0, decode_tokens=0, decode_s=0.0, prefill_s=0.0)
        t0 = time.perf_counter()
        engine.submit(reqs)
        while engine.num_requests:
            rep = engine.step()
            totals["sampled"] += rep.sampled_tokens
            totals["decode_tokens"] += rep.decode_tokens
            totals["decode_s"] += rep.decode_s
            totals["prefill_s"] += rep.prefill_s
        totals["wall_s"] = time.perf_counter() - t0
        return totals

    def run(impl: str) -> dict:
        if "params" not in params:
            params["params"] = init_params(cfg, jax.random.key(0))
        rcfg = RolloutConfig(**base, attention_impl=impl)
        engine = Engine(cfg, rcfg, mesh, eos_id=-1, interpret=plan.interpret)
        engine.load_params(params["params"], 0)
        one_round(engine, 0)  # compiles prefill and decode
        t = one_round(engine, 1)
        return dict(
            model=model,
            slots=r["max_slots"],
            decode_tokens=t["decode_tokens"],
            decode_s=t["decode_s"],
            prefill_s=t["prefill_s"],
            wall_s=t["wall_s"],
            decode_tokens_per_s=t["decode_tokens"] / t["decode_s"] if t["decode_s"] else None,
            tokens_per_s=t["sampled"] / t["wall_s"],
        )

    for impl in ("reference", "pallas"):
        rec.run_case(
            "engine", "engine", f"engine/decode/{impl}", lambda impl=impl: run(impl), impl=impl
        )


# Dense bf16 peak FLOP/s by device kind (vendor datasheets, without sparsity); MFU is left out
# for a device not listed.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_kind), None)


def train_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward, no recomputation): 6 x the
    parameters of the matmuls it touches (embeddings are a lookup, the tied output projection a
    matmul) plus causal attention, 6 x 2 x L x N x H x T / 2 (scores and values, half masked)."""
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f  # q, o; k, v; gate, up, down
    return 6 * (L * per_layer + d * v) + 6 * L * n * h * seq_len


def train_section(rec: Recorder, plan: Plan) -> None:
    """Train-step tokens/s and MFU at each of ``plan.train_lengths`` tokens per row: the GRPO
    step (bf16 compute, float32 master weights and Adam moments, blockwise attention, nested
    remat) on one device, ``plan.train_rows`` rows of one trajectory each."""
    from dora_jax.config import ModelConfig, TrainConfig
    from dora_jax.train import Trainer, Trajectory

    dev = jax.devices()[0]
    peak = peak_flops(dev.device_kind)

    def timed_steps(trainer, batch) -> tuple[float, dict]:
        """The median seconds of a train step on ``batch`` (after ``plan.warmup`` steps, the
        first of which compiles) and the last step's metrics."""
        for _ in range(plan.warmup):
            trainer.step(batch)
        jax.block_until_ready(trainer.state.params)
        times = []
        for _ in range(max(2, plan.repeats // 5)):
            t0 = time.perf_counter()
            metrics = trainer.step(batch)
            jax.block_until_ready(trainer.state.params)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), metrics

    def run(seq: int) -> dict:
        cfg = ModelConfig(**plan.train_model, param_dtype="bfloat16", compute_dtype="bfloat16",
                          remat="nested")  # fmt: skip
        tcfg = TrainConfig(lr=1e-6, fp32_master_weights=True, length_buckets=(seq,),
                           group_size=plan.train_rows)  # fmt: skip
        trainer = Trainer(cfg, tcfg)
        rng = np.random.default_rng(0)
        prompt, resp = seq // 8, seq - seq // 8
        trajs = [
            Trajectory(rng.integers(1, cfg.vocab_size, prompt).tolist(),
                       rng.integers(1, cfg.vocab_size, resp).tolist(),
                       (-rng.random(resp)).tolist(), float(i % 2), 0, 0)
            for i in range(plan.train_rows)
        ]  # fmt: skip
        batch = trainer.pack(trajs)
        step_s, metrics = timed_steps(trainer, batch)
        tokens = batch.num_rows * batch.seq_len
        achieved = train_flops_per_token(cfg, seq) * tokens / step_s
        loss = float(metrics["loss"])
        return dict(
            model=f"L{cfg.num_layers} D{cfg.hidden_size} V{cfg.vocab_size} bf16",
            rows=batch.num_rows,
            seq_len=batch.seq_len,
            step_s=step_s,
            tokens_per_s=tokens / step_s,
            model_tflops_per_s=achieved / 1e12,
            mfu=achieved / peak if peak else None,
            peak_tflops=peak / 1e12 if peak else None,
            loss=loss,
            ok=bool(np.isfinite(loss)),
        )

    for seq in plan.train_lengths:
        rec.run_case("train", "train", f"train/step/{seq}", lambda seq=seq: run(seq),
                     seq_len=seq)  # fmt: skip

    n, median, longest, buckets = plan.train_mix
    rng = np.random.default_rng(1)
    mix = []
    for _ in range(n):
        prompt = int(rng.integers(min(16, longest // 8), min(128, longest // 2)))
        resp = int(min(longest - prompt, max(1, rng.lognormal(np.log(median), 1.3))))
        mix.append((prompt, resp))

    def run_mix(packing: str, attention: str) -> dict:
        """The same long-tailed batch, padded (one trajectory per row) or packed by tokens;
        blockwise or cuDNN attention (cuDNN: one trajectory per row only)."""
        cfg = ModelConfig(**plan.train_model, param_dtype="bfloat16", compute_dtype="bfloat16",
                          remat="nested", attention=attention)  # fmt: skip
        tcfg = TrainConfig(lr=1e-6, fp32_master_weights=True, length_buckets=buckets,
                           group_size=n, packing=packing)  # fmt: skip
        trainer = Trainer(cfg, tcfg)
        trajs = [
            Trajectory(rng.integers(1, cfg.vocab_size, p).tolist(),
                       rng.integers(1, cfg.vocab_size, r).tolist(),
                       (-rng.random(r)).tolist(), float(i % 2), 0, 0)
            for i, (p, r) in enumerate(mix)
        ]  # fmt: skip
        batch = trainer.pack(trajs)
        step_s, metrics = timed_steps(trainer, batch)
        real = int(np.count_nonzero(np.asarray(batch.segment_ids)))
        loss = float(metrics["loss"])
        return dict(
            rows=batch.num_rows, seq_len=batch.seq_len, step_s=step_s,
            real_token_share=real / (batch.num_rows * batch.seq_len),
            real_tokens_per_s=real / step_s, loss=loss, ok=bool(np.isfinite(loss)),
        )  # fmt: skip

    lens = sorted(p + r for p, r in mix)
    found = {}
    variants = [("rows", "blockwise"), ("tokens", "blockwise")]
    if jax.default_backend() == "gpu":  # cuDNN's fused attention: GPUs only
        variants.insert(1, ("rows", "cudnn"))
    for packing, attention in variants:
        row = rec.run_case(
            "train", "train_mix", f"train/mix/{packing}/{attention}",
            lambda p=packing, a=attention: run_mix(p, a), packing=packing, attention=attention,
            trajectories=n, median_len=lens[n // 2], longest=lens[-1],
        )  # fmt: skip
        if row and not row.get("error"):
            found[(packing, attention)] = row["real_tokens_per_s"]
    packed = found.get(("tokens", "blockwise"))
    for key in (("rows", "blockwise"), ("rows", "cudnn")):
        if packed and key in found:
            rec.say(f"train mix: packed blockwise / padded {key[1]}: "
                    f"{packed / found[key]:.2f}x in real tokens/s")  # fmt: skip


def moe_section(rec: Recorder, plan: Plan) -> None:
    """The mixture-of-experts block's two dropless grouped paths (``ragged_dot``; the blocked
    scan CPUs use) on this backend: each against a per-expert loop (float32), and the forward
    tokens/s of each in bfloat16 at 8 and 64 experts: which one ``moe.default_impl`` should
    pick here."""
    for experts in (8, 64):
        _moe_cases(rec, plan, experts)


def _moe_cases(rec: Recorder, plan: Plan, E: int) -> None:
    from dora_jax.config import ModelConfig
    from dora_jax.model.moe import grouped_experts, moe_param_specs, route

    D, f, k, N = plan.moe_dims
    cfg = ModelConfig(family="qwen3_moe", hidden_size=D, num_layers=1, num_heads=4,
                      num_kv_heads=2, num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=f)  # fmt: skip
    specs = moe_param_specs(cfg)
    keys = jax.random.split(jax.random.key(E), len(specs) + 1)
    lp32 = {n: 0.05 * jax.random.normal(kk, sp.shape[1:], jnp.float32)
            for (n, sp), kk in zip(specs.items(), keys, strict=False)}  # fmt: skip
    x32 = jax.random.normal(keys[-1], (N, D), jnp.float32)

    def block(lp, x, impl):
        chosen, weights = route(lp["router"], x, cfg)
        return grouped_experts(lp, x, chosen, weights, E, impl=impl)

    ref = jax.jit(partial(block, impl="loop"))(lp32, x32)
    lp16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), lp32)
    x16 = x32.astype(jnp.bfloat16)
    label = f"N{N} D{D} f{f} k{k}"

    def check_and_time(impl: str) -> dict:
        fn = jax.jit(partial(block, impl=impl))
        got = fn(lp32, x32)
        err = max_err(got, ref)
        tol = TOL_TF32 if jax.default_backend() == "gpu" else TOL["float32"]
        seconds = median_seconds(lambda: fn(lp16, x16), plan)
        ok = bool(err <= tol and jnp.all(jnp.isfinite(got)))
        return dict(max_abs_err=err, tol=tol, ok=ok, tokens_per_s=N / seconds)

    for impl in ("ragged", "blocked"):
        rec.run_case("moe", "moe", f"moe/{impl}/E{E}/{label}", partial(check_and_time, impl),
                     impl=impl, experts=E, shape=label)  # fmt: skip


SECTIONS: dict[str, Callable[[Recorder, Plan], None]] = {
    "kernels": kernels_section,
    "engine": engine_section,
    "train": train_section,
    "moe": moe_section,
}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def environment() -> dict:
    """Versions and devices, printed before anything runs."""
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except Exception:
        jaxlib_version = None
    devices = jax.devices()
    return dict(
        python=platform.python_version(),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib_version,
        backend=jax.default_backend(),
        devices=[str(d) for d in devices],
        device_kind=str(devices[0].device_kind),
        compute_capability=getattr(devices[0], "compute_capability", None),
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.{json,md,log}")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes, Pallas in interpret mode, on any backend (checks the script only)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (median)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=480.0,
        help="cases that would start after this many seconds are recorded as skipped",
    )
    ap.add_argument(
        "--only", action="append", default=[], help="run only cases whose name contains this"
    )
    ap.add_argument(
        "--fail-case",
        action="append",
        default=[],
        help="cases whose name contains this raise before running (tests the error path)",
    )
    a = ap.parse_args(argv)
    unknown = [s for s in a.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; expected a subset of {list(SECTIONS)}")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    try:
        env = environment()
    except Exception as exc:  # e.g. a GPU plugin that fails to initialise
        print(f"gpu_check: no usable jax backend: {error_text(exc, 500)}", file=sys.stderr)
        return EXIT_NO_GPU
    print(
        f"gpu_check: python {env['python']}, jax {env['jax_version']} (jaxlib "
        f"{env['jaxlib_version']}), default backend {env['backend']}, devices {env['devices']}",
        flush=True,
    )
    if env["backend"] != "gpu" and not a.cpu_smoke:
        print(
            f"gpu_check: the default backend is {env['backend']!r}, not a GPU; nothing was run "
            "(pass --cpu-smoke for the CPU smoke run)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_NO_GPU
    plan = smoke_plan(a.repeats) if a.cpu_smoke else gpu_plan(a.repeats)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        created_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **env,
        interpret=plan.interpret,
        plan=dataclasses.asdict(plan),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning reaches WarningLog, none is an error
        rec = Recorder(
            out_dir,
            meta,
            only=a.only,
            fail_case=a.fail_case,
            deadline=t_start + a.max_seconds,
        )
        warnings.showwarning = rec.warning_log
        try:
            from dora_jax.kernels import shared_memory

            rec.result["shared_memory_limit_bytes"] = shared_memory.device_limit_bytes()
        except Exception as exc:  # recorded, the sections report their own
            rec.result["shared_memory_limit_bytes"] = error_text(exc)
        rec.write()
        for name in a.sections.split(","):
            rec.say(f"== section {name}")
            try:
                SECTIONS[name](rec, plan)
            except Exception as exc:  # a section's failure loses no other figure
                rec.end_section(name, exc)
            else:
                rec.end_section(name)
        rec.write(finished=True)
        s = rec.summary()
        rec.say(
            f"gpu_check: {s['cases']} cases: {s['ok']} ok, {s['failed']} failed, "
            f"{s['error']} error, {s['skipped']} skipped; section errors {s['section_errors']}; "
            f"{time.monotonic() - t_start:.0f} s; wrote {', '.join(FILES)} to {out_dir}"
        )
        rec.log.close()
    return EXIT_OK if s["all_ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
