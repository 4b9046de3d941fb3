"""Sweeps of the simulator: staleness bound K, RBS/TBS, tail heaviness, cluster size.

    python launch/sim_sweeps.py [--config configs/sim/qwen32b_h800_64.yaml] [--sweeps k,rbs,tail,
        cluster] [--jobs 2] [--quick] [overrides ...]

Each sweep varies one setting of the base config (everything else fixed, same seed) and runs the
modes that setting matters to; it writes one plot per sweep (default ``docs/sim_sweep_<name>.png``:
tokens/s consumed by training per mode, and DORA's speedup over each baseline) and all figures to
``benchmarks/results/sim_sweeps.json``. ``--quick``: fewer points and steps (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.sim.config import load_sim_config  # noqa: E402
from dora_jax.sim.run import resolve, simulate  # noqa: E402

DIS, CO = "disaggregated", "colocated"
# name -> (label, values, quick values, override template, (mode, placement) runs)
SWEEPS = {
    "k": (
        "staleness bound K",
        [0, 1, 2, 3, 4],
        [1, 3],
        "orchestration.staleness_k={v}",
        [("dora", DIS), ("partial", DIS), ("partial", CO), ("sync", DIS)],
    ),
    "rbs": (
        "RBS / TBS",
        [1.0, 1.25, 1.5, 2.0, 3.0],
        [1.0, 2.0],
        "rbs={v}",
        [("dora", DIS), ("partial", DIS), ("partial", CO), ("oversample", DIS)],
    ),
    "tail": (
        "response p99 / median (median fixed, capped)",
        [2, 5, 10, 20, 40],
        [2, 20],
        "response.p99_ratio={v}",
        [
            ("dora", DIS),
            ("partial", DIS),
            ("partial", CO),
            ("one_step", DIS),
            ("oversample", DIS),
            ("sync", DIS),
            ("sync", CO),
        ],
    ),
    "cluster": (
        "GPUs (balanced trainer / rollout split)",
        [32, 64, 128, 256],
        [32, 64],
        "cluster.total_gpus={v}",
        [("dora", DIS), ("partial", DIS), ("partial", CO), ("sync", DIS), ("sync", CO)],
    ),
}


COLORS = {
    "dora/dis": "black",
    "partial/dis": "tab:red",
    "partial/co": "tab:orange",
    "sync/dis": "tab:blue",
    "sync/co": "tab:cyan",
    "one_step/dis": "tab:purple",
    "oversample/dis": "tab:green",
}


def _overrides(sweep: str, v: float, base: list[str], cfg_path: str) -> list[str]:
    if sweep == "rbs":
        tbs = load_sim_config(cfg_path, base).orchestration.train_batch_prompts
        return [*base, f"orchestration.rollout_batch_prompts={round(tbs * v)}"]
    # the workload and the cluster size change the balance of rollout and training: re-split
    extra = ["cluster.trainer_gpus=0"] if sweep in ("cluster", "tail") else []
    return [*base, SWEEPS[sweep][3].format(v=v), *extra]


def _job(args: tuple) -> dict:
    sweep, v, mode, placement, overrides, cfg_path = args
    # only this run's mode is checked (K = 0 is no config for one_step, say)
    only = [f"run.modes=[{mode}]", f"run.colocated=[{mode if placement == CO else ''}]"]
    cfg = resolve(load_sim_config(cfg_path, [*overrides, *only]))
    m = simulate(cfg, mode, placement).metrics.to_dict()
    m.update(sweep=sweep, value=v, trainer_gpus=cfg.cluster.trainer_gpus)
    return m


def plot(sweep: str, rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone

    label = SWEEPS[sweep][0]
    runs = sorted(
        {(r["mode"], r["placement"]) for r in rows}, key=lambda x: (x != ("dora", DIS), x)
    )
    fig = Figure(figsize=(11, 3.8))
    a, b = fig.subplots(1, 2)
    by = {(r["mode"], r["placement"], r["value"]): r for r in rows}
    xs = sorted({r["value"] for r in rows})
    for mode, pl in runs:
        ys = [by[(mode, pl, x)]["tokens_per_s"] if (mode, pl, x) in by else None for x in xs]
        tag = f"{mode}/{'co' if pl == CO else 'dis'}"
        a.plot(xs, ys, marker="o", lw=2.2 if mode == "dora" else 1.2, label=tag, color=COLORS[tag])
        if mode != "dora":
            sp = [
                by[("dora", DIS, x)]["tokens_per_s"] / by[(mode, pl, x)]["tokens_per_s"]
                if (mode, pl, x) in by and ("dora", DIS, x) in by
                else None
                for x in xs
            ]
            b.plot(xs, sp, marker="o", label=f"vs {tag}", color=COLORS[tag])
    for ax in (a, b):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        if sweep in ("tail", "cluster"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
    a.set_ylabel("tokens/s consumed by training (modeled)")
    b.set_ylabel("DORA throughput speedup")
    b.axhline(1.0, color="black", lw=0.8)
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.suptitle(f"sweep: {label}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "sim" / "qwen32b_h800_64.yaml"))
    p.add_argument("--sweeps", default=",".join(SWEEPS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--plots-dir", type=Path, default=ROOT / "docs")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "sim_sweeps.json")
    p.add_argument("--replot", action="store_true", help="only redraw the plots from --json")
    p.add_argument("--merge", action="store_true", help="keep --json rows of other sweeps")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.replot:
        rows = json.loads(args.json.read_text())["rows"]
        for s in sorted({r["sweep"] for r in rows}):
            plot(s, [r for r in rows if r["sweep"] == s], args.plots_dir / f"sim_sweep_{s}.png")
        return 0
    steps = (
        ["run.steps=6", "run.warmup_steps=2"]
        if args.quick
        else ["run.steps=16", "run.warmup_steps=4"]
    )
    base = [*steps, *args.overrides]
    names = [s for s in args.sweeps.split(",") if s]
    jobs = []
    for s in names:
        values = SWEEPS[s][2] if args.quick else SWEEPS[s][1]
        for v in values:
            for mode, pl in SWEEPS[s][4]:
                if s == "k" and mode == "sync" and v != values[0]:
                    continue  # K does not apply to sync: one run is its line
                jobs.append((s, v, mode, pl, _overrides(s, v, base, args.config), args.config))
    t0 = time.perf_counter()
    with Pool(max(1, args.jobs)) as pool:
        rows = pool.map(_job, jobs, chunksize=1)
    k_values = SWEEPS["k"][2] if args.quick else SWEEPS["k"][1]
    rows += [  # sync's K-independent run, drawn at every K
        dict(r, value=v)
        for r in [r for r in rows if r["sweep"] == "k" and r["mode"] == "sync"]
        for v in k_values[1:]
    ]
    print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s")
    for s in names:
        sub = [r for r in rows if r["sweep"] == s]
        plot(s, sub, args.plots_dir / f"sim_sweep_{s}.png")
        print(f"\n{s}: {SWEEPS[s][0]}")
        for r in sorted(sub, key=lambda r: (r["mode"], r["placement"], r["value"])):
            print(
                f"  {r['mode']:>10}/{'co' if r['placement'] == CO else 'dis':<3} {r['value']:>6}: "
                f"{r['tokens_per_s']:8.0f} tok/s  step {r['step_s']:7.1f} s  roll-only "
                f"{r['rollout_only_frac']:.2f}  bubble {r['bubble']:.3f}  stale "
                f"{r['staleness_mean']:.2f}"
            )
    cmd = "python launch/sim_sweeps.py " + " ".join(argv)
    commands = [cmd]
    if args.merge and args.json.is_file():
        old = json.loads(args.json.read_text())
        rows += [r for r in old["rows"] if r["sweep"] not in names]
        commands = [*old.get("commands", []), cmd]
    out = {
        "commands": commands,
        "config": str(Path(args.config).resolve().relative_to(ROOT)),
        "units": "as in benchmarks/results/sim_*.json (SimMetrics)",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json} and {len(names)} plots to {args.plots_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
