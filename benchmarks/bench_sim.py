"""Host time to simulate the paper's 128-GPU setup for 100 train steps of 8,192 requests each.

    python benchmarks/bench_sim.py [--config configs/sim/qwen32b_h800_128.yaml] [--steps 100]
        [--modes dora] [overrides ...]

Runs each mode once (the runtime, planner and simulated backend, no plots) and prints and
writes to ``benchmarks/results/bench_sim.json``: wall and CPU seconds, ticks, milliseconds per
tick, and where the time goes (backend ``step``, ``groups``, ``submit``/``migrate``/...: the
simulator; the rest: the control plane, i.e. the runtime, rollout manager, transfer queue,
records and planner), the mean planning time, and the modeled time simulated.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.sim.backend import SimBackend  # noqa: E402
from dora_jax.sim.config import load_sim_config  # noqa: E402
from dora_jax.sim.run import resolve, simulate  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_sim.json"
TIMED = ("step", "groups", "submit", "migrate", "interrupt", "set_version")


def _instrument(acc: Counter) -> None:
    for name in TIMED:
        f = getattr(SimBackend, name)

        def timed(self, *a, _f=f, _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(self, *a, **k)
            finally:
                acc[_n] += time.perf_counter() - t

        setattr(SimBackend, name, timed)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "sim" / "qwen32b_h800_128.yaml"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", default="dora")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = resolve(load_sim_config(args.config, [f"run.steps={args.steps}", *args.overrides]))
    acc: Counter = Counter()
    _instrument(acc)
    o = cfg.orchestration
    results = {}
    for mode in args.modes.split(","):
        acc.clear()
        w0, c0 = time.perf_counter(), time.process_time()
        run = simulate(cfg, mode)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        m, ticks = run.metrics, run.metrics.ticks
        backend_s = sum(acc.values())
        results[mode] = {
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "ticks": ticks,
            "ms_per_tick": round(wall / ticks * 1e3, 4),
            "backend_ms_per_tick": {k: round(v / ticks * 1e3, 4) for k, v in acc.items()},
            "control_plane_ms_per_tick": round((wall - backend_s) / ticks * 1e3, 4),
            "plan_ms_mean": round(m.plan_ms_mean, 4),
            "plans": len(run.result.records.plans),
            "modeled_s": round(ticks * cfg.run.tick_s, 1),
            "modeled_step_s": round(m.step_s, 1),
            "requests_dispatched": run.runtime.manager.dispatched_prompt_groups * o.group_size,
        }
        r = results[mode]
        print(
            f"{mode}: {args.steps} steps x {o.train_batch_prompts * o.group_size} requests on "
            f"{cfg.cluster.total_gpus} GPUs ({m.groups} rollout groups): {wall:.1f} s wall "
            f"({cpu:.1f} s CPU), {ticks} ticks, {r['ms_per_tick']:.3f} ms/tick (backend "
            f"{backend_s / ticks * 1e3:.3f}, control plane {r['control_plane_ms_per_tick']:.3f}); "
            f"planning {m.plan_ms_mean:.3f} ms mean over {r['plans']} plans; modeled "
            f"{r['modeled_s'] / 3600:.1f} h"
        )
    data = {
        "benchmark": "host time to simulate train steps of the paper's 128-GPU setup",
        "units": "seconds (wall: time.perf_counter, cpu: time.process_time) and milliseconds per "
        "tick; modeled_s: modeled seconds simulated; plan_ms_mean: wall ms per planner call",
        "command": "python benchmarks/bench_sim.py " + " ".join(argv),
        "config": str(Path(args.config).resolve().relative_to(ROOT)),
        "steps": args.steps,
        "requests_per_step": o.train_batch_prompts * o.group_size,
        "gpus": cfg.cluster.total_gpus,
        "tick_s": cfg.run.tick_s,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": results,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
