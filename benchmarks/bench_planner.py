"""Planning time of the pure planner at cluster scale, and how often a simulated run plans.

    python benchmarks/bench_planner.py [--repeats 100] [--sim-steps 12] [--no-sim]

Builds one snapshot per scenario and scale (outside the timing), then times
``plan(snapshot, policy)`` alone, ``repeats`` times: wall time (``perf_counter``) and CPU time
of this process (``process_time``; on a machine shared with other jobs the wall time also counts
the time the process waited for a core). Two scales: 128 groups / 10,000 requests (target: under
1 ms) and 256 groups / 100,000 requests (1,024 GPUs at TP 4; target: under 5 ms).

Scenarios (the triggers the runtime plans on):

- ``new_version``: version 10 was just published; every group still holds 8 or 9 (3:1), 80% of
  the requests run on them (group loads uneven), the rest wait for version 10.
- ``period``: versions 8/9/10 each hold groups; the legacy ones are draining (few requests).
- ``kv_pressure``: one version on all groups, a quarter of them over the KV threshold.

Then (unless ``--no-sim``) it simulates ``dora`` on the 128-GPU paper config for ``--sim-steps``
train steps with trigger hysteresis on and off and reports the plans per trigger, how many of
them moved anything, and the mean planning time. Everything goes to
``benchmarks/results/bench_planner.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.orchestrator.backend import GroupInfo  # noqa: E402
from dora_jax.orchestrator.planner import PlanPolicy, Snapshot, plan  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "bench_planner.json"


def _group(
    gid: int,
    version: int,
    n: int,
    slots: int,
    rid: int,
    rng: random.Random,
    kv_total: int,
    pages_hi: int = 96,
) -> tuple[GroupInfo, int]:
    ids = tuple(range(rid, rid + n))
    pages = tuple(rng.randint(2, pages_hi) for _ in ids)
    info = GroupInfo(gid, version, 0, slots, slots - n, sum(pages), kv_total, ids, pages)
    return info, rid + n


def scenario(name: str, groups: int, requests: int, seed: int = 0) -> Snapshot:
    rng = random.Random(seed)
    slots = -(-int(requests * 1.0) // groups) + 8  # a little headroom per group
    kv_total = slots * 64
    latest, pending, infos, rid = 10, {}, [], 0
    if name == "new_version":
        running = int(requests * 0.8)
        weights = [rng.random() ** 2 for _ in range(groups)]
        scale = running / sum(weights)
        counts = [min(slots, int(w * scale)) for w in weights]
        for g in range(groups):
            info, rid = _group(g, 9 if g % 4 else 8, counts[g], slots, rid, rng, kv_total)
            infos.append(info)
        pending = {latest: requests - rid}
    elif name == "period":
        per_version = {8: 0.05, 9: 0.25, 10: 0.70}
        split = {8: groups // 4, 9: groups // 4, 10: groups - groups // 2}
        g = 0
        for v, share in per_version.items():
            n = int(requests * share * 0.9)
            for i in range(split[v]):
                k = n // split[v] + (1 if i < n % split[v] else 0)
                info, rid = _group(g, v, min(slots, k), slots, rid, rng, kv_total)
                infos.append(info)
                g += 1
        pending = {latest: requests - rid}
    elif name == "kv_pressure":
        for g in range(groups):
            n = requests // groups + (1 if g < requests % groups else 0)
            hi = 120 if g % 4 == 0 else 40
            info, rid = _group(g, latest, min(slots, n), slots, rid, rng, kv_total, hi)
            infos.append(info)
    else:
        raise ValueError(name)
    room = {8: 0, 9: 16, 10: 64}
    return Snapshot(0, latest, 8, tuple(infos), pending, 96, room, 16, name)


SCALES = ((128, 10_000, 1.0), (256, 100_000, 5.0))  # groups, requests, target ms


def time_plan(snap: Snapshot, policy: PlanPolicy, repeats: int) -> dict:
    plan(snap, policy)  # warm up
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = plan(snap, policy)
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    wall.sort()
    cpu.sort()
    return {
        "median_ms": round(statistics.median(wall), 4),
        "p90_ms": round(wall[int(0.9 * (len(wall) - 1))], 4),
        "cpu_median_ms": round(statistics.median(cpu), 4),
        "cpu_p90_ms": round(cpu[int(0.9 * (len(cpu) - 1))], 4),
        "groups": len(snap.groups),
        "requests": sum(g.num_requests for g in snap.groups) + sum(snap.pending.values()),
        "transfers": len(out.transfers),
        "migrated_requests": out.migrated_requests,
        "supplements": {f"v{v}": n for v, n in out.supplements},
    }


def sim_plans(steps: int) -> dict:
    """Plans per trigger of ``dora`` on the 128-GPU paper config, hysteresis on and off."""
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate

    path = ROOT / "configs" / "sim" / "qwen32b_h800_128.yaml"
    out = {"config": str(path.relative_to(ROOT)), "steps": steps}
    for on in (True, False):
        over = [f"run.steps={steps}", "run.warmup_steps=2", f"orchestration.plan_hysteresis={on}"]
        run = simulate(load_sim_config(path, over), "dora")
        s = run.result.records.summary(steps)
        out["hysteresis_on" if on else "hysteresis_off"] = {
            "ticks": s.ticks,
            "plans": s.plans,
            "plans_by_trigger": s.plans_by_trigger,
            "plans_moving": s.plans_moving,
            "plan_ms_mean": round(s.plan_ms_mean, 4),
            "tokens_per_s": round(run.metrics.tokens_per_s, 1),
        }
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--sim-steps", type=int, default=12)
    p.add_argument("--no-sim", action="store_true")
    args = p.parse_args(argv)
    policy = PlanPolicy(rollout_batch_prompts=128, kv_pressure_threshold=0.9)
    results: dict[str, dict] = {}
    for groups, requests, target in SCALES:
        key = f"{groups}_groups_{requests}_requests"
        results[key] = {"target_ms": target}
        for name in ("new_version", "period", "kv_pressure"):
            r = time_plan(scenario(name, groups, requests), policy, args.repeats)
            results[key][name] = r
            print(
                f"{name:<12} groups={groups} requests={r['requests']}: median {r['median_ms']:.3f}"
                f" ms (CPU {r['cpu_median_ms']:.3f}), p90 {r['p90_ms']:.3f} ms (CPU "
                f"{r['cpu_p90_ms']:.3f}); {r['transfers']} transfers, {r['migrated_requests']} "
                f"requests migrated [target < {target:g} ms]"
            )
    payload = {
        "benchmark": "planner.plan(snapshot, policy) time; plans per trigger in a simulated run",
        "units": "milliseconds per call: wall (perf_counter) and CPU of this process "
        "(process_time)",
        "command": " ".join(["python", "benchmarks/bench_planner.py", *argv]),
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "scenarios": results,
    }
    if not args.no_sim:
        payload["simulated_run"] = sim = sim_plans(args.sim_steps)
        for k in ("hysteresis_on", "hysteresis_off"):
            r = sim[k]
            print(
                f"simulated dora, {sim['config']}, {args.sim_steps} steps, {k.replace('_', ' ')}: "
                f"{r['plans']} plans in {r['ticks']} ticks {r['plans_by_trigger']}, "
                f"{r['plans_moving']} moved something, mean {r['plan_ms_mean']:.3f} ms, "
                f"{r['tokens_per_s']:.0f} tokens/s"
            )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
