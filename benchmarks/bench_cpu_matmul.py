"""float32 and bfloat16 matmuls at SmolLM2-135M's shapes on this CPU: jax (each XLA CPU option
that may route a dot to another library) against torch, side by side.

    python benchmarks/bench_cpu_matmul.py [--reps 5] [--max-load L] [--wait S]

Shapes: the decode step's ``B x 576 @ 576 x 1536`` and its LM head ``B x 576 @ 576 x 49152`` at
the recipe's batch (B = 32), and the train step's ``512 x 576 @ 576 x 1536``, ``512 x 1536 @
1536 x 576`` and LM-head chunk ``512 x 576 @ 576 x 4096``. Each jax variant runs in its own
process (``XLA_FLAGS`` is read once, at start): the default, YNNPACK's individual dots off,
oneDNN's custom calls, oneDNN's dot fusions, XNNPACK's dot fusions. jax's bfloat16 is timed twice:
with a bfloat16 result, and with bfloat16 operands into a float32 result (the form the model's
products take on a CPU host, :mod:`dora_jax.model.dense`). torch uses
``torch.set_num_threads(os.cpu_count())``. Best of ``--reps`` calls after a warm-up, in GFLOP/s;
a bfloat16 case slower than a time budget is measured once and marked so. The CPU's flags
(``avx512_bf16``, ``amx_bf16``, ``amx_tile``) say whether it has bfloat16 matrix units at all.
Writes
``benchmarks/results/bench_cpu_matmul.json`` with the command, commit and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

from dora_jax.platform import cpu_flags as read_cpu_flags  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_cpu_matmul.json"
SHAPES = {
    "decode_mlp": (32, 576, 1536),
    "decode_lm_head": (32, 576, 49152),
    "train_mlp_up": (512, 576, 1536),
    "train_mlp_down": (512, 1536, 576),
    "train_lm_head_chunk": (512, 576, 4096),
}
JAX_VARIANTS = {
    "default": "",
    "ynn_dots_off": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "onednn_dot_fusion": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "xnn_dot_fusion": "--xla_cpu_experimental_xnn_fusion_type=dot",
}
# jax dtypes: (operands, result). "bfloat16_f32_result": bfloat16 operands multiplied into a
# float32 result (preferred_element_type), the form XLA's CPU dot libraries map onto the
# processor's bfloat16 dot-product instructions; torch's bfloat16 matmul accumulates in float32
# and rounds its result, so it is compared with the best of the two jax bfloat16 rows.
JAX_DTYPES = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "bfloat16_f32_result": ("bfloat16", "float32"),
}
SLOW_BUDGET_S = 2.0  # a call slower than this is timed once


def _time(f, reps: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    f()  # warm-up (compiles)
    if time.perf_counter() - t0 > SLOW_BUDGET_S:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0, 1
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best, reps


def measure(lib: str, reps: int) -> dict:
    """GFLOP/s per dtype and shape in this process."""
    out: dict = {}
    if lib == "jax":
        import jax
        import jax.numpy as jnp

        for name, (dt, result) in JAX_DTYPES.items():
            for shape_name, (m, k, n) in SHAPES.items():
                a, b = jnp.ones((m, k), dt), jnp.ones((k, n), dt)
                f = jax.jit(lambda x, y, r=result: jnp.matmul(x, y, preferred_element_type=r))
                s, calls = _time(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), reps)
                out.setdefault(name, {})[shape_name] = {
                    "gflops": 2 * m * k * n / s / 1e9,
                    "calls": calls,
                }
        out["jax"] = jax.__version__
    else:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        for name, dt in dtypes.items():
            for shape_name, (m, k, n) in SHAPES.items():
                a, b = torch.ones((m, k), dtype=dt), torch.ones((k, n), dtype=dt)
                s, calls = _time(lambda a=a, b=b: a @ b, reps)
                out.setdefault(name, {})[shape_name] = {
                    "gflops": 2 * m * k * n / s / 1e9,
                    "calls": calls,
                }
        out["torch"] = torch.__version__
    return out


def cpu_flags() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
    return [f for f in read_cpu_flags() if f in wanted]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=OUT)
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.child, a.reps)))
        return 0
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)
    runs = {}
    cmd = [sys.executable, __file__, "--reps", str(a.reps), "--child"]
    for name, flags in JAX_VARIANTS.items():
        env = {**os.environ, "XLA_FLAGS": flags}
        res = subprocess.run([*cmd, "jax"], env=env, capture_output=True, text=True, check=True)
        runs[f"jax_{name}"] = {"xla_flags": flags, **json.loads(res.stdout.splitlines()[-1])}
        print(f"jax {name}: done", flush=True)
    res = subprocess.run([*cmd, "torch"], capture_output=True, text=True, check=True)
    runs["torch"] = json.loads(res.stdout.splitlines()[-1])
    best_jax = {
        dt: {s: max(runs[f"jax_{v}"][dt][s]["gflops"] for v in JAX_VARIANTS) for s in SHAPES}
        for dt in JAX_DTYPES
    }
    best_jax["bfloat16"] = {
        s: max(best_jax["bfloat16"][s], best_jax["bfloat16_f32_result"][s]) for s in SHAPES
    }
    ratios = {
        f"{dt} jax best / torch": {
            s: best_jax[dt][s] / runs["torch"][dt][s]["gflops"] for s in SHAPES
        }
        for dt in ("float32", "bfloat16")
    }
    ratios["jax bfloat16 with a float32 result / float32 (best each)"] = {
        s: best_jax["bfloat16_f32_result"][s] / best_jax["float32"][s] for s in SHAPES
    }
    ratios["jax bfloat16 / float32 (best each)"] = {
        s: best_jax["bfloat16"][s] / best_jax["float32"][s] for s in SHAPES
    }
    ratios["torch bfloat16 / float32"] = {
        s: runs["torch"]["bfloat16"][s]["gflops"] / runs["torch"]["float32"][s]["gflops"]
        for s in SHAPES
    }
    out = {
        **quiet.provenance(load0),
        "cpu_flags": cpu_flags(),
        "shapes": {k: list(v) for k, v in SHAPES.items()},
        "units": "GFLOP/s (2 m k n over the best call's seconds); calls: timed calls (1: a "
        f"bfloat16 case slower than {SLOW_BUDGET_S} s a call, timed once)",
        "runs": runs,
        "ratios": ratios,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    for k, v in ratios.items():
        print(k + ": " + ", ".join(f"{s} {x:.2f}" for s, x in v.items()))
    print(f"cpu flags: {' '.join(out['cpu_flags'])}; wrote {quiet.rel(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
