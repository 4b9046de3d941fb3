"""Planning time of the pure planner at cluster scale: 128 groups, 10,000 requests.

    python benchmarks/bench_planner.py [--repeats 200] [--groups 128] [--requests 10000]

Builds one snapshot per scenario (outside the timing), then times ``plan(snapshot, policy)``
alone, ``repeats`` times, and prints and writes the median and p90 in milliseconds to
``benchmarks/results/bench_planner.json``.

Scenarios (the triggers the runtime plans on):

- ``new_version``: version 10 was just published; every group still holds 8 or 9 (3:1), 80% of
  the requests run on them (group loads uneven), the rest wait for version 10.
- ``period``: versions 8/9/10 each hold groups; the legacy ones are draining (few requests).
- ``kv_pressure``: one version on all groups, a quarter of them over the KV threshold.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.orchestrator.backend import GroupInfo  # noqa: E402
from dora_jax.orchestrator.planner import PlanPolicy, Snapshot, plan  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "bench_planner.json"


def _group(gid: int, version: int, n: int, slots: int, rid: int, rng: random.Random,
           kv_total: int, pages_hi: int = 96) -> tuple[GroupInfo, int]:  # fmt: skip
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--requests", type=int, default=10_000)
    args = p.parse_args(argv)
    policy = PlanPolicy(rollout_batch_prompts=128, kv_pressure_threshold=0.9)
    results = {}
    for name in ("new_version", "period", "kv_pressure"):
        snap = scenario(name, args.groups, args.requests)
        n_req = sum(g.num_requests for g in snap.groups) + sum(snap.pending.values())
        plan(snap, policy)  # warm up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = plan(snap, policy)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        med, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        results[name] = {
            "median_ms": round(med, 4),
            "p90_ms": round(p90, 4),
            "groups": len(snap.groups),
            "requests": n_req,
            "transfers": len(out.transfers),
            "migrated_requests": out.migrated_requests,
            "supplements": {f"v{v}": n for v, n in out.supplements},
        }
        print(
            f"{name:<12} groups={len(snap.groups)} requests={n_req}: median {med:.3f} ms, "
            f"p90 {p90:.3f} ms ({len(out.transfers)} transfers, {out.migrated_requests} "
            f"requests migrated)"
        )
    payload = {
        "benchmark": "planner.plan(snapshot, policy) wall time",
        "units": "milliseconds (time.perf_counter), per call",
        "command": " ".join(["python", "benchmarks/bench_planner.py", *argv]),
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "scenarios": results,
        "target": "< 1 ms for 128 groups and 10,000 requests",
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
