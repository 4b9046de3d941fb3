"""Simulate the five rollout modes on one modeled cluster and workload; compare with the paper.

    python launch/simulate.py --config configs/sim/qwen32b_h800_64.yaml [key.path=value ...]
        [--json PATH] [--plots-dir DIR] [--plot-modes dora,sync] [--no-plots] [--ablation]

Runs every (mode, placement) of the config on the same workload and seed and prints: one table
in modeled seconds; each mode's step time split by what its GPUs did (rollout at full batch,
rollout in the tail, re-prefill, training, moves, idle); DORA's speedups over every baseline in
both placements (colocated sync, what veRL users run, first) beside the paper's figures (from
dora_jax/sim/paper_figures.yaml) and the placement of the paper's baseline. ``--ablation`` also
runs dora with each planner feature switched off. Writes JSON (default
benchmarks/results/sim_<name>.json) and one timeline PNG per run (default runs/sim/<name>/). No
jax: the control plane drives simulated groups (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.config.schema import ConfigError  # noqa: E402
from dora_jax.sim import report  # noqa: E402
from dora_jax.sim.config import load_sim_config  # noqa: E402
from dora_jax.sim.run import resolve, simulate  # noqa: E402
from dora_jax.sim.workload import ResponseLengths, workload_stats  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a YAML file under configs/sim/")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10")
    p.add_argument("--json", type=Path, help="output JSON (default benchmarks/results/sim_<name>)")
    p.add_argument("--plots-dir", type=Path, help="timeline PNGs (default runs/sim/<name>)")
    p.add_argument("--plot-modes", default="", help="comma list of modes to plot (default all)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--ablation", action="store_true", help="dora without each planner feature")
    args = p.parse_args(argv)
    try:
        cfg = resolve(load_sim_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    c, o = cfg.cluster, cfg.orchestration
    stats = workload_stats(
        ResponseLengths(cfg.response, o.group_size, cfg.run.seed), o.train_batch_prompts
    )
    print(
        f"{cfg.name}: {cfg.model} on {c.total_gpus} x {c.hardware}; disaggregated: "
        f"{c.trainer_gpus} train + {c.total_gpus - c.trainer_gpus} rollout (TP{c.rollout_tp}); "
        f"TBS {o.train_batch_prompts} x G {o.group_size}, RBS {o.rollout_batch_prompts}, "
        f"K {o.staleness_k}; responses median {stats['median']:.0f} p99 {stats['p99']:.0f} "
        f"(x{stats['p99_over_median']:.1f}) cap {cfg.response.max_tokens}; tick "
        f"{cfg.run.tick_s}s; steps {cfg.run.warmup_steps + 1}..{cfg.run.steps}"
    )
    runs = []
    for mode, placement in cfg.variants():
        t0 = time.perf_counter()
        runs.append(simulate(cfg, mode, placement))
        print(f"  ran {mode}/{placement}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    paper, note = report.load_paper(cfg.paper_key)
    metrics = [r.metrics for r in runs]
    print()
    print(report.table(metrics))
    print()
    print("step time by what the GPUs did (seconds per step, share of the step):")
    print(report.decomposition(metrics))
    print()
    print(note)
    print(report.paper_comparison(metrics, paper))
    ablation = None
    if args.ablation:
        ablation = report.ablation(cfg, metrics)
        print()
        print(report.ablation_table(ablation))
    out = args.json or ROOT / "benchmarks" / "results" / f"sim_{cfg.name}.json"
    cmd = "python launch/simulate.py " + " ".join(argv)
    report.write_json(out, cfg, runs, stats, paper, note, cmd, ablation=ablation)
    print(f"\nwrote {out}")
    if not args.no_plots:
        plots = args.plots_dir or ROOT / "runs" / "sim" / cfg.name
        keep = set(filter(None, args.plot_modes.split(",")))
        for r in runs:
            if not keep or r.mode in keep:
                tag = "co" if r.placement == "colocated" else "dis"
                report.timeline_png(r, plots / f"sim_timeline_{cfg.name}_{r.mode}_{tag}.png")
        print(f"wrote timelines to {plots}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
