"""``orchestrator.staleness_k: auto`` against fixed K, in the same runs:

    python benchmarks/bench_adaptive_k.py [--tasks default,tool] [--ks 0,1,2,3,4,auto]
        [--seeds 3] [--steps 100 | --steps default=200,tool=60] [--jobs 2]
        [--parts learning,throughput,stress] [--work DIR] [--note TEXT]

- **learning** (logical clock, so load and machine do not change a figure): every task x K x
  seed, ``dora`` for ``--steps`` train steps (the same consumed samples in every run: TBS x G a
  step), the held-out score every quarter of the run; per K the mean and its standard error over
  the seeds, and ``auto`` against the best fixed K paired by seed (the difference and its
  standard error); and, from the same runs, tokens per engine step (the logical clock's time,
  the trainer's step inline), ``auto`` against the fastest fixed K. ``--jobs`` runs at once
  (each its own process); ``--work`` an earlier run's work directory reads its finished runs back.
- **throughput** (the simulator's CPU preset, modeled seconds): the default task on
  ``configs/sim/cpu_default_task.yaml`` and the tool recipe through ``sim_agentic_cpu.predict``
  (conversations played ideally, ``synthesize``), each K; ``auto`` against the fastest fixed K.
- **stress** (logical clock): the default task with the learning rate 10x for 20 steps from the
  middle of the run (``train.lr_boost``), ``auto``: the K it chose each step and why, and the
  measured ESS per lag, around the stress.

Writes ``benchmarks/results/bench_adaptive_k.json`` (rewritten after every run, so a cut run
keeps what it did) and ``docs/adaptive_k.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_adaptive_k.json"
PLOT = ROOT / "docs" / "adaptive_k.png"
TASKS = {
    "default": ROOT / "configs" / "default.yaml",
    "tool": ROOT / "configs" / "recipes" / "tool-arithmetic-cpu.yaml",
}
COMMON = [
    "orchestrator.mode=dora",
    "orchestrator.clock=logical",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every_steps=0",
]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def one_run(task: str, k: str, seed: int, steps: int, work: Path, extra=()) -> dict:
    """One ``launch/train.py`` run; its held-out curve, K decisions and summary. The warm start
    (which depends on the task and seed, not on K) is copied from an earlier run's when there
    is one. A run whose directory already holds a finished run of as many steps (``--work``
    naming an earlier work directory) is read back, not run again."""
    run_dir = work / f"{task}_k{k}_s{seed}{'_' + extra[0].split('=')[0] if extra else ''}"
    t0 = time.perf_counter()
    done_before = run_dir / "summary.json"
    if not (done_before.is_file() and json.loads(done_before.read_text())["steps"] == steps):
        cached = work / "warm" / f"{task}_s{seed}"
        if cached.is_dir() and not (run_dir / "warm_start").is_dir():
            shutil.copytree(cached, run_dir / "warm_start")
        every = max(1, steps // 4)
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(TASKS[task])]
        cmd += [*COMMON, f"orchestrator.staleness_k={k}", f"seed={seed}", f"run_dir={run_dir}"]
        cmd += [f"train.total_steps={steps}", f"eval.every_steps={every}", *extra]
        done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            log = (done.stdout + done.stderr)[-3000:]
            raise SystemExit(f"{task} K={k} seed {seed}: failed\n{log}")
        if not cached.is_dir() and (run_dir / "warm_start").is_dir():
            shutil.copytree(run_dir / "warm_start", cached, dirs_exist_ok=True)
    # (keys as the JSON has them, so a run read back and a run just made look alike)
    evals = {str(r["step"]): r["eval/solved"] for r in _read_jsonl(run_dir / "eval.jsonl")}
    k_log = [r for d in _read_jsonl(run_dir / "records.jsonl") for r in d.get("k_log", [])]
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    lag_ess = [
        {k2.split("/")[1]: m[k2] for k2 in m if k2.startswith("lag/") and k2.endswith("/ess")}
        for m in metrics
    ]
    return {
        "task": task,
        "k": k,
        "seed": seed,
        "held_out": evals,
        "k_trace": [(r[1], r[2], r[3]) for r in k_log],  # (version, K from then on, reason)
        "lag_ess": lag_ess,
        "staleness_mean": summary["staleness_mean"],
        "trajectories": summary["trajectories"],
        # engine steps of the run (the logical clock's time: the trainer's step is inline, so
        # what a K buys shows as fewer ticks for the same samples)
        "ticks": summary["ticks"],
        "tokens_per_tick": summary["tokens_per_tick"],
        "seconds": time.perf_counter() - t0,
    }


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def steps_of(spec: str, tasks: list[str]) -> dict[str, int]:
    """``--steps``: one count for every task (``100``) or one each (``default=200,tool=60``)."""
    if "=" not in spec:
        return dict.fromkeys(tasks, int(spec))
    given = dict(x.split("=") for x in spec.split(","))
    if missing := [t for t in tasks if t not in given]:
        raise SystemExit(f"--steps {spec}: no count for task(s) {missing}")
    return {t: int(given[t]) for t in tasks}


def learning_summary(runs: list[dict], steps: dict[str, int]) -> dict:
    out = {}
    for task in sorted({r["task"] for r in runs}):
        mine = [r for r in runs if r["task"] == task]
        last = lambda r, n=str(steps[task]): r["held_out"].get(n)  # noqa: E731
        per_k, per_tick = {}, {}
        for k in dict.fromkeys(r["k"] for r in mine):
            vals = [last(r) for r in mine if r["k"] == k and last(r) is not None]
            if vals:
                m, se = _mean_se(vals)
                per_k[k] = {"mean": m, "se": se, "seeds": len(vals)}
            per_tick[k] = statistics.fmean(r["tokens_per_tick"] for r in mine if r["k"] == k)
        fixed = {k: v for k, v in per_k.items() if k != "auto"}
        res = {"final_held_out": per_k, "tokens_per_tick": per_tick}
        if "auto" in per_tick and len(per_tick) > 1:
            fastest = max((k for k in per_tick if k != "auto"), key=per_tick.get)
            res["tick_fastest_fixed_k"] = fastest
            res["tick_auto_over_fastest"] = per_tick["auto"] / per_tick[fastest]
        if "auto" in per_k and fixed:
            best = max(fixed, key=lambda k: fixed[k]["mean"])
            by_seed = {r["seed"]: last(r) for r in mine if r["k"] == "auto"}
            diffs = [
                by_seed[r["seed"]] - last(r)
                for r in mine
                if r["k"] == best and by_seed.get(r["seed"]) is not None and last(r) is not None
            ]
            if not diffs:
                out[task] = res
                continue
            d, se = _mean_se(diffs)
            res |= {
                "best_fixed_k": best,
                "auto_minus_best": d,
                "auto_minus_best_se": se,
                "within_noise": abs(d) <= 2 * se if se == se else None,
            }
        out[task] = res
    return out


def throughput(ks: list[str], tasks: list[str], work: Path) -> dict:
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate

    out: dict = {}
    if "default" in tasks:
        preset = ROOT / "configs" / "sim" / "cpu_default_task.yaml"
        per = {}
        for k in ks:
            over = [f"orchestration.staleness_k={k}", "run.modes=[dora]"]  # auto: dora's alone
            run = simulate(load_sim_config(preset, overrides=over), "dora")
            per[k] = {
                "tokens_per_s": run.metrics.tokens_per_s,
                "k_trace": [r[2] for r in run.runtime.records.k_log] if k == "auto" else None,
            }
        out["default"] = {"config": quiet.rel(preset), "per_k": per}
    if "tool" in tasks:
        from sim_agentic_cpu import predict, synthesize

        conv = synthesize(work / "conversations.jsonl", 64)
        per = {}
        for k in ks:
            p = predict(
                conv, 0.1, 1.0, modes=("dora",), recipe_overrides=[f"orchestrator.staleness_k={k}"]
            )
            per[k] = {"model_tokens_per_s": p["model_tokens_per_s"]["dora"]}
        out["tool"] = {"workload": "64 prompt groups played ideally (synthesize)", "per_k": per}
    for task, res in out.items():
        key = "tokens_per_s" if task == "default" else "model_tokens_per_s"
        fixed = {k: v[key] for k, v in res["per_k"].items() if k != "auto"}
        if "auto" in res["per_k"] and fixed:
            fastest = max(fixed, key=fixed.get)
            res["fastest_fixed_k"] = fastest
            res["auto_over_fastest"] = res["per_k"]["auto"][key] / fixed[fastest]
    return out


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out.get("learning", {}).get("runs", [])
    tasks = sorted({r["task"] for r in runs})
    stress = out.get("stress")
    n = len(tasks) + (1 if stress else 0)
    if n == 0:
        return
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=False):
        for k in dict.fromkeys(r["k"] for r in runs if r["task"] == task):
            mine = [r for r in runs if r["task"] == task and r["k"] == k]
            curves = [{int(s): v for s, v in r["held_out"].items()} for r in mine]
            xs = sorted({x for c in curves for x in c})
            ys = [statistics.fmean(c[x] for c in curves if x in c) for x in xs]
            ax.plot(xs, ys, marker="o", lw=2.5 if k == "auto" else 1, label=f"K={k}")
        ax.set(title=f"{task}: held-out (mean of seeds)", xlabel="train step (equal samples)")
        ax.legend(fontsize=7)
    if stress:
        ax = axes[0][-1]
        trace = stress["k_trace"]
        ax.step([v for v, _, _ in trace], [k for _, k, _ in trace], where="post", label="K (auto)")
        first, span, _ = stress["lr_boost"]
        ax.axvspan(first, first + span, color="red", alpha=0.15, label="lr x10")
        ess = stress["lag_ess"]
        ax2 = ax.twinx()
        worst = [min(e.values()) if e else None for e in ess]
        ax2.plot(range(1, len(worst) + 1), worst, color="gray", lw=0.8, label="lowest lag ESS")
        ax2.set_ylabel("ESS")
        ax.set(title="drift stress: K chosen", xlabel="version", ylabel="K")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="default,tool")
    p.add_argument("--ks", default="0,1,2,3,4,auto")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", default="100", help="N, or per task: default=200,tool=60")
    p.add_argument("--stress-steps", type=int, default=120)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--parts", default="learning,throughput,stress")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--work", type=Path, help="work directory (an earlier one: its runs read back)")
    p.add_argument("--note", help="kept in the JSON (say where runs read back were made)")
    a = p.parse_args()
    tasks, ks, parts = a.tasks.split(","), a.ks.split(","), a.parts.split(",")
    steps = steps_of(a.steps, tasks)
    load = os.getloadavg()  # (logical clock and modeled time: the load changes no figure)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_adaptive_k-"))
    out: dict = {"what": "staleness_k: auto against fixed K", "steps": steps}
    if a.note:
        out["note"] = a.note
    print(f"work directory {work}", flush=True)

    def save() -> None:
        out.update(quiet.provenance(load))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")

    if "throughput" in parts:
        out["throughput"] = throughput(ks, tasks, work)
        for task, res in out["throughput"].items():
            print(f"{task} throughput (modeled): {res['per_k']}", flush=True)
        save()
    if "stress" in parts:
        first = a.stress_steps // 2
        boost = [first, 20, 10.0]
        r = one_run(
            "default", "auto", 0, a.stress_steps, work, (f"train.lr_boost={json.dumps(boost)}",)
        )
        out["stress"] = {**r, "lr_boost": boost}
        print(f"stress: K trace {[k for _, k, _ in r['k_trace']]}", flush=True)
        save()
    if "learning" in parts:
        # first one K per task and seed (each computes the warm start the others then copy)
        first = [(t, ks[0], s) for t in tasks for s in range(a.seeds)]
        rest = [(t, k, s) for t in tasks for s in range(a.seeds) for k in ks[1:]]
        runs = out.setdefault("learning", {"runs": []})["runs"]
        with ThreadPoolExecutor(a.jobs) as pool:
            for jobs in (first, rest):
                for r in pool.map(lambda j: one_run(*j, steps[j[0]], work), jobs):
                    runs.append(r)
                    final = r["held_out"].get(str(steps[r["task"]]))
                    rate = f"{r['tokens_per_tick']:.1f} tokens/tick"
                    print(f"{r['task']} K={r['k']} seed {r['seed']}: held-out {final}, {rate}")
                    out["learning"]["summary"] = learning_summary(runs, steps)
                    save()
        print(json.dumps(out["learning"]["summary"], indent=1), flush=True)
    try:
        plot(out)
    except ImportError as e:  # (a machine without matplotlib: the JSON is what counts)
        print(f"no plot: {e}")
    save()
    print(f"wrote {quiet.rel(a.out)} and {quiet.rel(PLOT)}")


if __name__ == "__main__":
    main()
