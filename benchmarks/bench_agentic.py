"""Wall-clock throughput of multi-turn conversations: ``sync``, ``partial`` and ``dora`` (K=2) on
the real engines, with a tool whose latency is long-tailed, and the same workload in the
simulator.

    python benchmarks/bench_agentic.py [--steps 16] [--warmup 6] [--rounds 2]
        [--latency 0.1] [--sigma 1.0] [overrides ...]

The workload is the recipe ``configs/recipes/tool-arithmetic-cpu.yaml``: the built-in
arithmetic task with a calculator tool (``env: tool_arithmetic``), a policy warm-started to call
the tool in half its episodes; every tool call takes a lognormal time of median ``--latency``
seconds and shape ``--sigma`` (p99 / median = exp(2.326 sigma): 10.2 at 1.0). The arrangement
is ``bench_wallclock``'s: two processes on JAX's multi-controller runtime, each pinned to its
own core; process 0 holds the trainer, the control plane and the environment's worker
processes, process 1 the four rollout groups. Each mode runs ``--rounds`` times, alternating;
the medians are compared. Throughput is the model's tokens of the conversations consumed by
training per wall second (their tool answers left out), over the window after ``--warmup``
steps. Writes ``benchmarks/results/bench_agentic.json``: ``dora_over_sync_wall``,
``dora_over_partial_wall``, per mode the figures of each run (conversations, turns and tool
seconds per conversation, group idle shares, re-prefill), and the simulator's prediction for the
measured conversations (``benchmarks/sim_agentic_cpu.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402
from bench_wallclock import run_mode  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PLOTS = RESULTS / "plots"  # a timeline of each mode's first window
RECIPE = ROOT / "configs" / "recipes" / "tool-arithmetic-cpu.yaml"
MODES = ("sync", "partial", "dora")


def conversation_figures(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "conversations.jsonl").read_text().splitlines()]
    turns = sorted(r["turns"] for r in rows)
    secs = sorted(r["env_seconds"] for r in rows)
    return {
        "conversations": len(rows),
        "turns_mean": statistics.fmean(turns),
        "turns_p99_over_median": turns[int(0.99 * (len(turns) - 1))] / statistics.median(turns),
        "env_seconds_mean": statistics.fmean(secs),
        "model_tokens_mean": statistics.fmean(r["model_tokens"] for r in rows),
        "env_tokens_mean": statistics.fmean(r["env_tokens"] for r in rows),
        "solved": statistics.fmean(float(r["reward"] or 0.0) >= 1.0 for r in rows),
    }


def measure(a, work: Path) -> dict:
    extra = [
        f"config={RECIPE}",
        "eval.num_prompts=0",
        "logging.progress=false",
        "orchestrator.clock=wall",
        f"env.kwargs.latency_s={a.latency}",
        f"env.kwargs.latency_sigma={a.sigma}",
        f"env.workers={a.env_workers}",
        *a.overrides,
    ]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES:
            f = run_mode(mode, a.warmup, a.steps, work, extra)
            f |= conversation_figures(Path(f["run_dir"]))
            runs[mode].append(f)
            print(
                f"round {r + 1} {mode:>7}: {f['model_tokens_per_s']:.0f} model tokens/s "
                f"({f['trajectories_per_s']:.1f} conversations/s) over {f['seconds']:.1f} s; "
                f"turns {f['turns_mean']:.2f}, tool {f['env_seconds_mean']:.2f} s per "
                f"conversation; group idle {', '.join(f'{x:.2f}' for x in f['group_idle'])}; "
                f"trainer busy {f['train_busy_share']:.2f}",
                flush=True,
            )
    med = {m: statistics.median(f["model_tokens_per_s"] for f in fs) for m, fs in runs.items()}
    return {
        "dora_over_sync_wall": med["dora"] / med["sync"],
        "dora_over_partial_wall": med["dora"] / med["partial"],
        "model_tokens_per_s": med,
        "trajectories_per_s": {
            m: statistics.median(f["trajectories_per_s"] for f in fs) for m, fs in runs.items()
        },
        "train_busy_share": {
            m: statistics.median(f["train_busy_share"] for f in fs) for m, fs in runs.items()
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="measured train steps per run")
    p.add_argument("--warmup", type=int, default=6, help="train steps before the window")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--latency", type=float, default=0.1, help="median seconds of a tool call")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the latency")
    p.add_argument(
        "--env-workers",
        type=int,
        default=16,
        help="environment worker processes (one tool call at a time each)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "bench_agentic.json")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's prediction")
    p.add_argument("overrides", nargs="*", help="config overrides for every mode")
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)
    with tempfile.TemporaryDirectory(prefix="bench_agentic_") as tmp:
        res = measure(a, Path(tmp))
        PLOTS.mkdir(parents=True, exist_ok=True)
        for mode in ("dora", "sync", "partial"):  # a picture of each mode's first window
            window = Path(res["runs"][mode][0]["run_dir"]) / "timeline_window.png"
            if window.is_file():
                target = PLOTS / f"agentic_timeline_{mode}.png"
                target.write_bytes(window.read_bytes())
        sim = None
        if not a.no_sim:
            from sim_agentic_cpu import predict

            conv = Path(res["runs"]["dora"][0]["run_dir"]) / "conversations.jsonl"
            # the measured train step (median over the dora runs' windows) replaces the CPU
            # preset's, which was measured in one process on both cores
            step_s = statistics.median(f["train_step_s_median"] for f in res["runs"]["dora"])
            sim = predict(
                conv,
                a.latency,
                a.sigma,
                modes=MODES,
                env_workers=a.env_workers,
                train_step_s=step_s,
                recipe_overrides=a.overrides,
            )
    res = {
        "benchmark": "wall-clock throughput of multi-turn conversations with a slow tool: sync, "
        "partial and dora (K=2), real engines, tool_arithmetic recipe",
        "command": "python benchmarks/bench_agentic.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "arrangement": "2 processes (jax.distributed, gloo on loopback), each pinned to its own "
        "CPU core: process 0 = trainer (2x2 mesh) + control plane + environment workers, "
        "process 1 = 4 rollout groups; wall clock",
        "tool_latency": {
            "median_s": a.latency,
            "sigma": a.sigma,
            "p99_over_median": math.exp(2.326 * a.sigma),
        },
        "env_workers": a.env_workers,
        "units": {
            "model_tokens_per_s": "model tokens (tool answers left out) of the conversations "
            "consumed by training, per wall second, over the measured window",
            "trajectories_per_s": "conversations consumed per wall second",
            "group_idle": "share of the window a group did nothing (environment waits included)",
            "sim": "the simulator's CPU preset on the measured conversations: model tokens per "
            "modeled second",
        },
        **res,
        "sim": sim,
    }
    res.update({k: v for k, v in quiet.provenance(load0).items() if k != "command"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    line = (
        f"dora over sync (wall): {res['dora_over_sync_wall']:.2f}x, over partial "
        f"{res['dora_over_partial_wall']:.2f}x in model tokens/s"
    )
    if sim:
        line += f"; simulator: {sim['dora_over_sync']:.2f}x, {sim['dora_over_partial']:.2f}x"
    print(f"{line}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
