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
moe      The mixture-of-experts block's grouped paths against a per-expert loop, and their
         tokens/s at 8 and 64 experts.
grpo     A few GRPO steps of the real SmolLM2-135M-Instruct end to end (the smollm2-add-cpu
         recipe on one device): rollout and train tokens/s, the held-out score before and after.
         Skipped, with the reason, where its weights are not here (--grpo-model-dir, --grpo-gguf).

Every case runs in its own try: a case that raises is recorded with its error text and the run
goes on. Results are written after every case, so a crash or a kill loses only the case in
flight. Files written to DIR: ``gpu_check.json`` (everything, with units), ``gpu_check.md`` (the
tables) and ``gpu_check.log`` (what was printed); the grpo section adds its run's
``gpu_check_grpo_metrics.jsonl`` and ``gpu_check_grpo_eval.jsonl``.

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
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "launch"):  # also runs without PYTHONPATH=. and loaded from a file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_check_grpo import grpo_section  # noqa: E402
from gpu_check_kernels import (  # noqa: E402
    TOL,
    TOL_TF32,
    kernels_section,
    max_err,
    median_seconds,
)
from gpu_check_plan import (  # noqa: E402, F401  (the tests use these through gpu_check)
    Plan,
    fitted,
    gpu_plan,
    kernel_variants,
    smoke_plan,
)
from gpu_check_report import Recorder, WarningLog, error_text  # noqa: E402, F401

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.log")


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


def random_trajectories(vocab: int, seq: int, rows: int) -> list:
    """``rows`` trajectories of ``seq`` random tokens (1/8 prompt, 7/8 response), rewards
    alternating 0 and 1: the train section's batch (seeded, the same every run)."""
    from dora_jax.train import Trajectory

    rng = np.random.default_rng(0)
    prompt, resp = seq // 8, seq - seq // 8
    return [
        Trajectory(
            rng.integers(1, vocab, prompt).tolist(),
            rng.integers(1, vocab, resp).tolist(),
            (-rng.random(resp)).tolist(),
            float(i % 2),
            0,
            0,
        )
        for i in range(rows)
    ]


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
        cfg = ModelConfig(
            **plan.train_model, param_dtype="bfloat16", compute_dtype="bfloat16", remat="nested"
        )
        tcfg = TrainConfig(
            lr=1e-6, fp32_master_weights=True, length_buckets=(seq,), group_size=plan.train_rows
        )
        trainer = Trainer(cfg, tcfg)
        batch = trainer.pack(random_trajectories(cfg.vocab_size, seq, plan.train_rows))
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
        rec.run_case("train", "train", f"train/step/{seq}", lambda seq=seq: run(seq), seq_len=seq)

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
        cfg = ModelConfig(
            **plan.train_model,
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            remat="nested",
            attention=attention,
        )
        tcfg = TrainConfig(
            lr=1e-6, fp32_master_weights=True, length_buckets=buckets, group_size=n, packing=packing
        )
        trainer = Trainer(cfg, tcfg)
        trajs = [
            Trajectory(
                rng.integers(1, cfg.vocab_size, p).tolist(),
                rng.integers(1, cfg.vocab_size, r).tolist(),
                (-rng.random(r)).tolist(),
                float(i % 2),
                0,
                0,
            )
            for i, (p, r) in enumerate(mix)
        ]
        batch = trainer.pack(trajs)
        step_s, metrics = timed_steps(trainer, batch)
        real = int(np.count_nonzero(np.asarray(batch.segment_ids)))
        loss = float(metrics["loss"])
        return dict(
            rows=batch.num_rows,
            seq_len=batch.seq_len,
            step_s=step_s,
            real_token_share=real / (batch.num_rows * batch.seq_len),
            real_tokens_per_s=real / step_s,
            loss=loss,
            ok=bool(np.isfinite(loss)),
        )

    lens = sorted(p + r for p, r in mix)
    found = {}
    variants = [("rows", "blockwise"), ("tokens", "blockwise")]
    if jax.default_backend() == "gpu":  # cuDNN's fused attention: GPUs only
        variants.insert(1, ("rows", "cudnn"))
    for packing, attention in variants:
        row = rec.run_case(
            "train",
            "train_mix",
            f"train/mix/{packing}/{attention}",
            lambda p=packing, a=attention: run_mix(p, a),
            packing=packing,
            attention=attention,
            trajectories=n,
            median_len=lens[n // 2],
            longest=lens[-1],
        )
        if row and not row.get("error"):
            found[(packing, attention)] = row["real_tokens_per_s"]
    packed = found.get(("tokens", "blockwise"))
    for key in (("rows", "blockwise"), ("rows", "cudnn")):
        if packed and key in found:
            rec.say(
                f"train mix: packed blockwise / padded {key[1]}: "
                f"{packed / found[key]:.2f}x in real tokens/s"
            )


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
    cfg = ModelConfig(
        family="qwen3_moe",
        hidden_size=D,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=f,
    )
    specs = moe_param_specs(cfg)
    keys = jax.random.split(jax.random.key(E), len(specs) + 1)
    lp32 = {
        n: 0.05 * jax.random.normal(kk, sp.shape[1:], jnp.float32)
        for (n, sp), kk in zip(specs.items(), keys, strict=False)
    }
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
        rec.run_case(
            "moe",
            "moe",
            f"moe/{impl}/E{E}/{label}",
            partial(check_and_time, impl),
            impl=impl,
            experts=E,
            shape=label,
        )


SECTIONS: dict[str, Callable[[Recorder, Plan], None]] = {
    "kernels": kernels_section,
    "engine": engine_section,
    "train": train_section,
    "moe": moe_section,
    "grpo": grpo_section,
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
        load_average_before=[round(x, 2) for x in os.getloadavg()],
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
    ap.add_argument(
        "--grpo-model-dir",
        default=None,
        help="grpo: the prepared SmolLM2-135M-Instruct directory (default: the plan's, "
        "models/smollm2-135m-instruct)",
    )
    ap.add_argument(
        "--grpo-gguf",
        default=None,
        help="grpo: the GGUF to convert when that directory is not there (default: the plan's, "
        ".gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf)",
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
    for field, value in (("grpo_model_dir", a.grpo_model_dir), ("grpo_gguf", a.grpo_gguf)):
        if value is not None:
            plan = dataclasses.replace(plan, **{field: value})
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
