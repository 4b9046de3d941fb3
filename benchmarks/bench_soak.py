"""Soak: does a long run's host memory or checkpoint size grow with its age?

    python benchmarks/bench_soak.py [--steps 1000] [--every 50] [--label current]

Runs the train command in this process on the embedded default config (the tiny Qwen2 policy,
the built-in task, the logical clock) for ``--steps`` train steps with a checkpoint every
``--every`` steps, saved synchronously so each save's seconds are its own. At every checkpoint it
records the step, the process's resident memory (``VmRSS`` after a garbage collection) and its
live heap, the bytes
of the checkpoint directory just written and the save's seconds. To keep 1,000 steps within
minutes on 2 CPU cores the warm start is shortened (``--warm-steps``) and the held-out
evaluation is off; the model, batch sizes, mode and clock are the default run's.

Writes ``benchmarks/results/bench_soak.json`` under ``--label`` (other labels already in the
file are kept, so the figures of the code before a change stay beside those after it):

- ``points``: ``[{step, rss_mib, checkpoint_bytes, save_s}, ...]``;
- ``steps``; ``rss_growth``, ``heap_growth`` and ``checkpoint_growth``: ``(last - at step 100)
  / at step 100`` (heap: what the C allocator has handed out and not taken back, glibc's
  ``mallinfo2``; RSS also counts the freed memory the allocator keeps);
- ``save_s_first_half`` / ``save_s_second_half``: median save seconds of the checkpoints after
  step 100, in the first and the second half of the run (flat: the two agree within noise);
- the command, the commit, the load average before and after.

Run it alone (not beside the test suite or another benchmark).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_soak.json"


def rss_mib() -> float:
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def heap_mib() -> float:
    """Bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``: in-use
    chunks plus mmapped blocks), in MiB: the live native and Python memory, without the freed
    memory the allocator keeps (which RSS counts)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
    except (OSError, AttributeError):
        return float("nan")
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def growth(points: list[dict], key: str, from_step: int = 100) -> float:
    base = next((p for p in points if p["step"] >= from_step), None)
    if base is None or not base[key]:
        return float("nan")
    return (points[-1][key] - base[key]) / base[key]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warm-steps", type=int, default=300)
    ap.add_argument("--label", default="current")
    ap.add_argument(
        "--max-load",
        type=float,
        default=1.5,
        help="refuse to start while the 1-minute load average is above this",
    )
    args = ap.parse_args()
    load0 = os.getloadavg()
    if load0[0] > args.max_load:
        raise SystemExit(
            f"load average {load0[0]:.2f} > {args.max_load}: run it on a quiet "
            "machine (or raise --max-load)"
        )

    from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas

    fake_cpu_devices(8)
    limit_malloc_arenas()
    from dora_jax import checkpoint
    from dora_jax import main as train_main
    from dora_jax.config import load_config

    points: list[dict] = []
    original = checkpoint.RunCheckpointer.save

    def timed_save(self, exp):
        t0 = time.perf_counter()
        key = original(self, exp)
        self.wait()
        dt = time.perf_counter() - t0
        step = exp.runtime.steps_done
        if points and points[-1]["step"] == step:  # the end of the run saves the same step
            return key
        points.append(
            {
                "step": step,
                "rss_mib": rss_mib(),
                "heap_mib": heap_mib(),
                "checkpoint_bytes": dir_bytes(self.directory / str(key)),
                "save_s": dt,
            }
        )
        print(
            f"soak: step {step}: rss {points[-1]['rss_mib']:.0f} MiB, checkpoint "
            f"{points[-1]['checkpoint_bytes'] / 2**20:.2f} MiB, save {dt:.2f} s",
            flush=True,
        )
        return key

    checkpoint.RunCheckpointer.save = timed_save
    work = Path(tempfile.mkdtemp(prefix="bench_soak-"))
    overrides = [
        f"run_dir={work / 'run'}",
        f"train.total_steps={args.steps}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.async_save=false",
        "checkpoint.keep=2",
        f"warm_start.steps={args.warm_steps}",
        "eval.num_prompts=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.every_steps=100",
    ]
    cfg = load_config(train_main.DEFAULT_CONFIG, overrides)
    t0 = time.perf_counter()
    code = train_main.train(cfg)
    seconds = time.perf_counter() - t0
    if code:
        raise SystemExit(f"the run failed (exit {code})")
    later = [p["save_s"] for p in points if p["step"] > 100]
    half = len(later) // 2
    figures = {
        "steps": points[-1]["step"] if points else 0,
        "rss_growth": growth(points, "rss_mib"),
        "heap_growth": growth(points, "heap_mib"),
        "checkpoint_growth": growth(points, "checkpoint_bytes"),
        "save_s_first_half": statistics.median(later[:half]) if half else float("nan"),
        "save_s_second_half": statistics.median(later[half:]) if later[half:] else float("nan"),
        "run_s": seconds,
        "points": points,
        "units": {
            "rss_mib": "MiB",
            "heap_mib": "MiB",
            "checkpoint_bytes": "bytes",
            "save_s": "s",
            "run_s": "s",
        },
        "command": "python benchmarks/bench_soak.py " + " ".join(sys.argv[1:]),
        "overrides": overrides,
        "commit": quiet.commit(),
        "load_average_before": load0[0],
        "load_average_after": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d"),
    }
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data[args.label] = figures
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "points"}, indent=1))
    print(f"wrote {RESULTS} [{args.label}]")


if __name__ == "__main__":
    main()
