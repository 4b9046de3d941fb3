"""Wall-clock throughput of ``sync`` and ``dora`` (K=2) on the default task, on the real engines.

    python benchmarks/bench_wallclock.py [--steps 30] [--warmup 4] [--rounds 2]

The arrangement that lets rollout and training overlap physically on a 2-core machine: two
processes on JAX's multi-controller runtime, each pinned to its own core (``taskset``): process
0 holds the trainer (devices 0-3, the 2x2 trainer mesh) and the control plane, process 1 the four
rollout groups (devices 4-7). (In one process, one XLA computation already uses both cores, so
threads could not show it.) Both modes run the same config on the wall clock; each mode runs
``--rounds`` times, alternating, and the ratio of the medians is reported. Writes
``benchmarks/results/bench_wallclock.json``:

- ``dora_over_sync_wall``: trajectories consumed per wall second, dora over sync, over the
  measured window (after ``--warmup`` steps, when everything is compiled);
- ``dora_over_sync_tokens``: the same for the consumed trajectories' response tokens (dora's
  window favours prompt groups without a long tail, which finish first);
- ``overlap_dora``: the share of the trainer's busy time during which some group was decoding;
- ``group_idle_{dora,sync}``: each rollout group's idle share of the window.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

DRIVER = ROOT / "benchmarks" / "wallclock_driver.py"
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = RESULTS / "plots"  # a timeline of each mode's first window
BASE = [
    "eval.num_prompts=0",
    "logging.progress=false",
    "orchestrator.clock=wall",
    "orchestrator.staleness_k=2",
]


def run_mode(mode: str, warmup: int, steps: int, work: Path, extra: list[str]) -> dict:
    """One 2-process run of ``mode``; returns its figures."""
    from dora_jax.distributed.launcher import launch_local

    run_dir = work / f"{mode}-{time.monotonic_ns()}"
    out = run_dir / "figures.json"
    args = [
        "throughput",
        str(out),
        str(warmup),
        str(steps),
        *BASE,
        *extra,
        f"orchestrator.mode={mode}",
        f"run_dir={run_dir}",
    ]
    code = launch_local(2, args, run_dir, devices_per_process=4, pin_cores=True, entry=DRIVER)
    if code:
        logs = "".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log")))
        raise SystemExit(f"{mode} run failed (exit {code}):\n{logs}")
    figures = json.loads(out.read_text())
    figures["run_dir"] = str(run_dir)
    return figures


def measure(steps: int, warmup: int, rounds: int, extra: list[str], work: Path) -> dict:
    runs: dict[str, list[dict]] = {"sync": [], "dora": []}
    for r in range(rounds):
        for mode in ("sync", "dora"):
            f = run_mode(mode, warmup, steps, work, extra)
            runs[mode].append(f)
            print(
                f"round {r + 1} {mode:>4}: {f['trajectories_per_s']:.1f} traj/s "
                f"({f['response_tokens_per_s']:.0f} response tokens/s) over "
                f"{f['seconds']:.1f} s, overlap {f['overlap']:.2f}, group idle "
                f"{', '.join(f'{x:.2f}' for x in f['group_idle'])}; train step median "
                f"{f.get('train_step_s_median', 0):.2f} s, {f.get('compiling_steps', 0)} "
                f"compiling ({f.get('compiling_steps_s', 0):.1f} s), "
                f"{f.get('fallback_steps', 0)} in a bigger shape while theirs compiled",
                flush=True,
            )
    med = {m: statistics.median(f["trajectories_per_s"] for f in fs) for m, fs in runs.items()}
    tok = {m: statistics.median(f["response_tokens_per_s"] for f in fs) for m, fs in runs.items()}
    best = {
        m: min(fs, key=lambda f, m=m: abs(f["trajectories_per_s"] - med[m]))
        for m, fs in runs.items()
    }
    return {
        "dora_over_sync_wall": med["dora"] / med["sync"],
        "trajectories_per_s": med,
        "dora_over_sync_tokens": tok["dora"] / tok["sync"],
        "response_tokens_per_s": tok,
        "overlap_dora": statistics.median(f["overlap"] for f in runs["dora"]),
        "overlap_sync": statistics.median(f["overlap"] for f in runs["sync"]),
        "group_idle_dora": best["dora"]["group_idle"],
        "group_idle_sync": best["sync"]["group_idle"],
        "train_busy_share": {m: best[m]["train_busy_share"] for m in runs},
        "round_ms_mean": {m: best[m]["round_ms_mean"] for m in runs},
        "round_ms_p99": {m: best[m]["round_ms_p99"] for m in runs},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="measured train steps per run")
    p.add_argument("--warmup", type=int, default=4, help="train steps before the window")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_wallclock.json")
    p.add_argument("overrides", nargs="*", help="config overrides for both modes")
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)
    with tempfile.TemporaryDirectory(prefix="bench_wallclock_") as tmp:
        res = measure(a.steps, a.warmup, a.rounds, a.overrides, Path(tmp))
        stem = a.out.stem.removeprefix("bench_wallclock").strip("_") or "default"
        PLOTS.mkdir(parents=True, exist_ok=True)
        for mode in ("dora", "sync"):  # a picture of each mode's first window, for the docs
            window = Path(res["runs"][mode][0]["run_dir"]) / "timeline_window.png"
            if window.is_file():
                (PLOTS / f"execution_timeline_{stem}_{mode}.png").write_bytes(window.read_bytes())
    res = {
        "benchmark": "wall-clock throughput, sync vs dora (K=2), default task, real engines",
        "command": "python benchmarks/bench_wallclock.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "arrangement": "2 processes (jax.distributed, gloo on loopback), each pinned to its own "
        "CPU core: process 0 = trainer (2x2 mesh) + control plane, process 1 = "
        "4 rollout groups; wall clock",
        "units": {
            "trajectories_per_s": "trajectories consumed by training per wall second",
            "response_tokens_per_s": "their response tokens per wall second",
            "overlap": "share of trainer-busy seconds with a group decoding",
            "group_idle": "share of the window a group did nothing",
            "round_ms": "ms of process 0's own time per control round",
        },
        **res,
    }
    res.update({k: v for k, v in quiet.provenance(load0).items() if k != "command"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"dora over sync (wall): {res['dora_over_sync_wall']:.2f}x trajectories/s, "
        f"{res['dora_over_sync_tokens']:.2f}x response tokens/s; overlap (dora) "
        f"{res['overlap_dora']:.2f}; group idle dora "
        f"{', '.join(f'{x:.2f}' for x in res['group_idle_dora'])} / sync "
        f"{', '.join(f'{x:.2f}' for x in res['group_idle_sync'])}; wrote {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
