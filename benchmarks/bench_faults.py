"""What a rollout host's loss costs, measured and simulated:

    python benchmarks/bench_faults.py [--steps 60] [--rounds 2] [--sim-config CONFIG]

**Measured** (wall clock, this machine): the default task in four processes on loopback, the
trainer on process 0 and four rollout groups, one of them alone on process 3
(``mesh.rollout.devices=3:7``: groups on devices 3, 4, 5 and 6 of 2 per process). ``--rounds``
rounds (medians reported) of three runs of ``--steps`` train steps each, one at a time: without
a fault; with process 3 killed (SIGKILL) once half the steps are done, its group's requests
recovered on the others; and with only the three other groups from the start
(``mesh.rollout.devices=3:6``: what the cluster can do without the lost group). Each run's
throughput over its second half (trajectories per second from the end of step ``steps // 2`` to
the last; for the fault run, from the kill, the wait until process 0 sees the loss (its
lifeline to process 3 closing) included, and from the moment it does) against the ideal, 3/4 of
the run without the fault, and against the three-group run.

**Simulated** (``--sim-config``, 1,024 GPUs by default): ``dora`` without failures and with
rollout GPUs failing at a stress rate (``--stress-mtbf-hours`` per GPU), recovered in place;
from the two, the cost of one group failure in seconds of the whole cluster's throughput; then
at each ``--mtbf-hours`` (per GPU) the throughput of recovery in place (rollout failures at that
cost, the trainer's failures stop the job) against stop and resume (every failure stops the job:
``failures.job_restart_s`` and half of ``failures.checkpoint_every_s`` lost each time), in
response tokens per second (``dora_jax/sim/failures.py``).

Writes ``benchmarks/results/bench_faults.json`` with the command, commit and load averages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_faults.json"
LAYOUT = [
    "warm_start.steps=20",
    "eval.num_prompts=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every_steps=0",
    "orchestrator.clock=wall",
    "mesh.trainer.devices=0:2",
    "mesh.trainer.data=1",
    "mesh.trainer.model=2",
]
FOUR = ["mesh.rollout.devices=3:7", "mesh.rollout.groups=4"]
THREE = ["mesh.rollout.devices=3:6", "mesh.rollout.groups=3"]


def one_run(name: str, steps: int, groups: list[str], kill_at: int | None, work: Path) -> dict:
    """One 4-process run; ``kill_at``: kill process 3 once that many steps are in metrics.jsonl."""
    run_dir = work / name
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "4"]
    cmd += [*LAYOUT, *groups, f"run_dir={run_dir}", f"train.total_steps={steps}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed = None
    metrics = run_dir / "metrics.jsonl"
    while kill_at is not None and killed is None and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_at:
            os.kill(int((run_dir / "logs" / "process_3.pid").read_text()), signal.SIGKILL)
            killed = time.perf_counter() - t0
        time.sleep(0.1)
    out = proc.communicate(timeout=1800)[0].decode()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the run failed ({proc.returncode}):\n{out[-3000:]}")
    steps_rec, health = [], []
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        d = json.loads(line)
        steps_rec += d.get("steps", [])
        health += d.get("health", [])
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    return {
        "name": name,
        "steps": [(s[0], s[1], s[3]) for s in steps_rec],  # start, end, prompt groups
        "dead_at_s": next((h[0] for h in health if h[2] == "dead"), None),
        "killed_after_s": killed,
        "wall_s": time.perf_counter() - t0,
        "trajectories": summary["trajectories"],
        "group_failures": summary.get("group_failures", 0),
        "recovered": summary.get("recovered", {}),
    }


def after(run: dict, k: int, group_size: int) -> float:
    """Trajectories per second over the steps after the ``k``-th (its end to the last end)."""
    ends = [e for _, e, _ in run["steps"]]
    n = sum(pg for _, _, pg in run["steps"][k:]) * group_size
    return n / (ends[-1] - ends[k - 1])


def after_time(run: dict, t: float, group_size: int) -> float:
    """Trajectories per second over the steps that end after ``t`` (from ``t`` to the last end)."""
    later = [(e, pg) for _, e, pg in run["steps"] if e > t]
    return sum(pg for _, pg in later) * group_size / (later[-1][0] - t)


def measured(steps: int, work: Path, rounds: int) -> dict:
    """``rounds`` rounds of the three runs; each round's figures, and their medians."""
    out = [measured_round(steps, work / f"round{i}") for i in range(rounds)]
    keys = [k for k, v in out[0].items() if isinstance(v, float)]
    return {"rounds": out, "median": {k: statistics.median(r[k] for r in out) for k in keys}}


def measured_round(steps: int, work: Path) -> dict:
    from dora_jax.config import load_config
    from dora_jax.main import DEFAULT_CONFIG

    work.mkdir(parents=True, exist_ok=True)
    group_size = load_config(DEFAULT_CONFIG, []).train.group_size
    half = steps // 2
    base = one_run("no_fault", steps, FOUR, None, work)
    fault = one_run("fault", steps, FOUR, half, work)
    three = one_run("three_groups", steps, THREE, None, work)
    if fault["dead_at_s"] is None:
        raise SystemExit("the fault run never took process 3 for dead")
    ideal = 0.75 * after(base, half, group_size)
    t = {
        "no_fault": after(base, half, group_size),
        "three_groups": after(three, half, group_size),
        # from the kill (after step ``half``), the wait until the loss is seen included
        "fault": after(fault, half, group_size),
        # from the moment process 0 took process 3 for dead
        "fault_after_detection": after_time(fault, fault["dead_at_s"], group_size),
    }
    ends = [e for _, e, _ in fault["steps"]]
    return {
        "runs": [base, fault, three],
        "killed_after_step": half,
        "detection_wait_s": fault["dead_at_s"] - ends[half - 1],
        "trajectories_per_s_second_half": t,
        "fault_vs_ideal_3_4": t["fault"] / ideal,
        "fault_after_detection_vs_ideal_3_4": t["fault_after_detection"] / ideal,
        "fault_vs_three_groups": t["fault"] / t["three_groups"],
        "three_groups_vs_no_fault": t["three_groups"] / t["no_fault"],
    }


def simulated(path: str, stress_mtbf: float, mtbfs: list[float], seeds: int) -> dict:
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.failures import HOUR, stop_and_resume
    from dora_jax.sim.run import simulate

    base_cfg = load_sim_config(path)
    t0 = time.perf_counter()
    base = simulate(base_cfg, "dora").metrics
    stressed = []
    for seed in range(seeds):
        over = [f"failures.gpu_mtbf_hours={stress_mtbf}", f"failures.seed={seed}"]
        run = simulate(load_sim_config(path, overrides=over), "dora")
        stressed.append((run.metrics, run.backend.failures.failed, run))
    cfg = stressed[0][2].cfg
    c = cfg.cluster
    window_s = base.step_s * base.steps
    # the cost of one group failure: the throughput it takes, in seconds of the whole cluster's
    lost_share = [1 - m.tokens_per_s / base.tokens_per_s for m, _, _ in stressed]
    rate = [n / (m.step_s * m.steps) for m, n, _ in stressed]  # failures per modeled second
    cost_s = sum(ls / r for ls, r in zip(lost_share, rate, strict=True) if r) / len(stressed)
    rollout_gpus = c.total_gpus - c.trainer_gpus
    policies = []
    for mtbf in mtbfs:
        fc = dataclasses.replace(cfg.failures, gpu_mtbf_hours=mtbf)
        per_group = c.rollout_tp / (mtbf * HOUR)
        in_place = base.tokens_per_s * max(
            0.0, 1 - per_group * (rollout_gpus / c.rollout_tp) * cost_s
        )
        p = stop_and_resume(fc, c.total_gpus, c.trainer_gpus, base.tokens_per_s, in_place)
        policies.append(
            {
                "gpu_mtbf_hours": mtbf,
                **dataclasses.asdict(p),
                "recover_vs_stop_resume": p.recover_in_place / p.stop_and_resume,
            }
        )
    return {
        "config": quiet.rel(Path(path)),
        "gpus": c.total_gpus,
        "trainer_gpus": c.trainer_gpus,
        "rollout_groups": rollout_gpus // c.rollout_tp,
        "failures": dataclasses.asdict(cfg.failures),
        "window_modeled_s": window_s,
        "tokens_per_s_no_failures": base.tokens_per_s,
        "stress": [
            {
                "gpu_mtbf_hours": stress_mtbf,
                "seed": i,
                "group_failures": n,
                "tokens_per_s": m.tokens_per_s,
                "max_version_span": m.max_version_span,
            }
            for i, (m, n, _) in enumerate(stressed)
        ],
        "group_failure_cost_cluster_s": cost_s,
        "policies": policies,
        "sim_wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sim-config", default=str(ROOT / "configs" / "sim" / "qwen7b_h100_1024.yaml"))
    p.add_argument("--stress-mtbf-hours", type=float, default=20.0)
    p.add_argument("--mtbf-hours", default="50000,5000,500")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three measured runs")
    p.add_argument("--skip-measured", action="store_true")
    quiet.add_arguments(p)
    a = p.parse_args()
    load = quiet.wait_for_quiet(a.max_load, a.wait)
    work = Path(tempfile.mkdtemp(prefix="bench_faults-"))
    out: dict = {"what": "a rollout host's loss: measured on this machine, simulated at scale"}
    if not a.skip_measured:
        out["measured"] = measured(a.steps, work, a.rounds)
        for m in out["measured"]["rounds"]:
            t = m["trajectories_per_s_second_half"]
            print(
                f"after step {m['killed_after_step']}: no fault {t['no_fault']:.1f} "
                f"trajectories/s; one of four groups killed there {t['fault']:.1f} "
                f"({m['fault_vs_ideal_3_4']:.2f}x the ideal 3/4; seen dead "
                f"{m['detection_wait_s']:.1f} s later, and from then "
                f"{t['fault_after_detection']:.1f}: "
                f"{m['fault_after_detection_vs_ideal_3_4']:.2f}x); three groups from the start "
                f"{t['three_groups']:.1f} "
                f"({m['three_groups_vs_no_fault']:.2f}x no fault)",
                flush=True,
            )
        med = out["measured"]["median"]
        print(f"median of {a.rounds}: {med['fault_vs_ideal_3_4']:.2f}x the ideal 3/4", flush=True)
    mtbfs = [float(x) for x in a.mtbf_hours.split(",")]
    s = out["simulated"] = simulated(a.sim_config, a.stress_mtbf_hours, mtbfs, a.seeds)
    print(
        f"simulated {s['gpus']} GPUs: one group failure costs "
        f"{s['group_failure_cost_cluster_s']:.0f} s of the cluster's throughput",
        flush=True,
    )
    for x in s["policies"]:
        print(
            f"  GPU MTBF {x['gpu_mtbf_hours']:.0f} h ({x['job_failures_per_hour']:.2f} failures/h):"
            " "
            f"recovery in place {x['recover_in_place']:.0f} tok/s, stop and resume "
            f"{x['stop_and_resume']:.0f} tok/s ({x['recover_vs_stop_resume']:.3f}x)"
        )
    out["units"] = {
        "trajectories_per_s_second_half": "1/s",
        "detection_wait_s": "s",
        "tokens_per_s": "response tokens/s",
    }
    out.update(quiet.provenance(load))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {quiet.rel(RESULTS)}")


if __name__ == "__main__":
    main()
