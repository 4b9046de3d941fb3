"""Train-step memory of the real-model presets, by abstract compilation only (no allocation).

    python benchmarks/memory_plan.py [--no-baseline]

For the Qwen2.5-0.5B preset (one device; 256 rows of 5120 tokens in 8 microbatches: 32 x 5120
per microbatch) and the Qwen2.5-7B preset (trainer mesh data 1 x model 4; 256 rows of 9216
tokens in 32 microbatches: 8 x 9216), it lowers the trainer's jitted step from
``jax.ShapeDtypeStruct`` inputs, compiles it for the CPU (8 fake devices stand in for the mesh)
and records XLA's memory analysis per device: temporaries, arguments, outputs, aliased bytes.
With the baseline (default) it also compiles each preset's step as it was before this change
(dense attention, the old remat, no position chunks, the old microbatches). Then it prints the
whole memory plan of each preset as on 80 GiB GPUs (``mesh.device_memory_gib=80``), KV pages
sized from what is left.

Writes ``benchmarks/results/memory_plan.json`` (bytes, and GiB = 2**30 bytes). The figures are
XLA:CPU's: a GPU compile fuses and schedules differently, so treat them as estimates of the
same program.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)

import jax  # noqa: E402

from dora_jax.config import load_config  # noqa: E402
from dora_jax.mesh import build_meshes  # noqa: E402
from dora_jax.pipeline.memory_plan import plan_memory  # noqa: E402
from dora_jax.train.step import lower_train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "memory_plan.json"
GiB = 1 << 30

CASES = [
    # (name, preset, target GiB per device, baseline overrides: the preset before this change)
    (
        "qwen2.5-0.5b",
        "configs/qwen2.5-0.5b-1gpu.yaml",
        16,
        ["model.attention=dense", "model.remat=dots", "model.seq_chunk=0"],
    ),
    (
        "qwen2.5-7b",
        "configs/qwen2.5-7b-8gpu.yaml",
        40,
        ["model.attention=dense", "model.remat=full", "model.seq_chunk=0", "train.microbatches=16"],
    ),
]


def step_memory(cfg) -> dict:
    m, t, o = cfg.model, cfg.train, cfg.orchestrator
    samples = o.train_batch_prompts * t.group_size
    rows, seq = (t.pack_rows or samples), t.length_buckets[-1]
    mesh = build_meshes(cfg.mesh).trainer
    t0 = time.perf_counter()
    low = lower_train_step(m, t, mesh, num_samples=samples, rows=rows, seq_len=seq)
    ma = low.compile().memory_analysis()
    return {
        "mesh": dict(mesh.shape),
        "rows": rows,
        "seq_len": seq,
        "microbatches": t.microbatches,
        "rows_per_microbatch_per_device": rows // t.microbatches // mesh.shape["data"],
        "attention": m.attention,
        "remat": m.remat,
        "seq_chunk": m.seq_chunk,
        "temp_bytes": ma.temp_size_in_bytes,
        "argument_bytes": ma.argument_size_in_bytes,
        "output_bytes": ma.output_size_in_bytes,
        "alias_bytes": ma.alias_size_in_bytes,
        "temp_gib": round(ma.temp_size_in_bytes / GiB, 2),
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-baseline", action="store_true", help="skip the before-change compiles")
    args = p.parse_args(argv)
    out = {
        "benchmark": "train-step memory by abstract compilation (XLA memory analysis, CPU)",
        "units": {"*_bytes": "bytes per device", "*_gib": "GiB (2**30 bytes) per device"},
        "command": "python benchmarks/memory_plan.py"
        + (" --no-baseline" if args.no_baseline else ""),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cases": {},
    }
    for name, preset, target, baseline in CASES:
        cfg = load_config(ROOT / preset)
        case = {"preset": preset, "target_temp_gib": target, "train_step": step_memory(cfg)}
        ts = case["train_step"]
        case["meets_target"] = ts["temp_gib"] < target
        print(
            f"{name}: {ts['rows_per_microbatch_per_device']} x {ts['seq_len']} per "
            f"microbatch, mesh {ts['mesh']}: temporaries {ts['temp_gib']} GiB "
            f"(target < {target}) [{ts['compile_s']} s]",
            flush=True,
        )
        if not args.no_baseline:
            case["baseline_overrides"] = baseline
            case["baseline_train_step"] = step_memory(load_config(ROOT / preset, baseline))
            b = case["baseline_train_step"]
            print(f"  before: {b['temp_gib']} GiB ({', '.join(baseline)})", flush=True)
        plan = plan_memory(load_config(ROOT / preset, ["mesh.device_memory_gib=80"]))
        case["plan_on_80gib_devices"] = plan.to_dict()
        print(plan.table(), flush=True)
        out["cases"][name] = case
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
