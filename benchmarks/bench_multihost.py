"""Multi-process figures: wall-clock throughput of ``dora`` and ``sync`` on 2 processes pinned to
different cores, a cross-process KV migration against re-prefill, and a control round's cost.

    python benchmarks/bench_multihost.py [--steps 30] [--rounds 2] [--contexts 1024,2048,4096]
        [overrides for the throughput runs, e.g. data.median_steps=6 train.pack_rows=32]

- Throughput: the arrangement of ``bench_wallclock.py`` (process 0: trainer and control plane on
  one core; process 1: the rollout groups on the other), the default task, dora (K=2) and sync;
  ``dora_over_sync_wall`` is the ratio of trajectories per wall second.
- Migration: a request with C tokens of context on a group of process 0 moves with its KV pages
  to a group of process 1 (pack, pull through the transfer servers, unpack), against prefilling
  those C tokens on that group (what a re-prefill costs); median of 3 after a warm-up, on the
  default model with the context limits raised.
- Control round: process 0's own time per round (planning, bookkeeping, messages; the wait for
  reports excluded), mean and 99th percentile, per mode.

Writes ``benchmarks/results/bench_multihost.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402
from bench_wallclock import DRIVER, RESULTS, measure  # noqa: E402


def migration(contexts: list[int], work: Path) -> list[dict]:
    from dora_jax.distributed.launcher import launch_local

    longest = max(contexts)
    run_dir = work / "migration"
    out = run_dir / "figures.json"
    pages = -(-(longest + 16) // 16) * 2 + 8
    args = [
        "migration",
        str(out),
        ",".join(map(str, contexts)),
        f"rollout.max_prompt_len={longest}",
        "rollout.max_new_tokens=8",
        f"rollout.num_pages={pages}",
        "rollout.prefill_chunk=256",
        "mesh.trainer.devices=0:2",
        "mesh.trainer.data=1",
        "mesh.trainer.model=2",
        "mesh.rollout.devices=2:8",
        "mesh.rollout.groups=6",
        f"run_dir={run_dir}",
    ]
    code = launch_local(2, args, run_dir, devices_per_process=4, pin_cores=True, entry=DRIVER)
    if code:
        logs = "".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log")))
        raise SystemExit(f"migration run failed (exit {code}):\n{logs}")
    return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--contexts", default="1024,2048,4096")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_multihost.json")
    p.add_argument("overrides", nargs="*", help="config overrides for the throughput runs")
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)
    contexts = [int(c) for c in a.contexts.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_multihost_") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        rows = migration(contexts, work)
        for r in rows:
            print(
                f"context {r['context']:>5}: cross-process migration {r['migrate_s'] * 1e3:.1f} ms"
                f", re-prefill {r['prefill_s'] * 1e3:.1f} ms: {r['ratio']:.1%}",
                flush=True,
            )
        thr = measure(a.steps, a.warmup, a.rounds, a.overrides, work)
    res = {
        "benchmark": "multi-process (jax.distributed, 2 CPU processes on loopback)",
        "command": "python benchmarks/bench_multihost.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "arrangement": "process 0 = trainer (2x2 mesh) + control plane, process 1 = 4 rollout "
        "groups; each process pinned to its own CPU core",
        "throughput_overrides": a.overrides,
        "dora_over_sync_wall": thr["dora_over_sync_wall"],
        "trajectories_per_s": thr["trajectories_per_s"],
        "dora_over_sync_tokens": thr["dora_over_sync_tokens"],
        "response_tokens_per_s": thr["response_tokens_per_s"],
        "overlap_dora": thr["overlap_dora"],
        "group_idle_dora": thr["group_idle_dora"],
        "group_idle_sync": thr["group_idle_sync"],
        "control_round_ms": {"mean": thr["round_ms_mean"], "p99": thr["round_ms_p99"]},
        "migration_vs_reprefill": rows,
        "units": {
            "migrate_s": "seconds to move one request's KV to the other process",
            "prefill_s": "seconds to prefill the same context there",
            "ratio": "migrate_s / prefill_s",
            "response_tokens_per_s": "response tokens of the consumed trajectories per wall second",
            "control_round_ms": "process 0's own milliseconds per control round",
        },
        "seconds": time.monotonic() - t0,
    }
    res.update({k: v for k, v in quiet.provenance(load0).items() if k != "command"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"dora over sync (wall, 2 processes): {res['dora_over_sync_wall']:.2f}x trajectories/s, "
        f"{res['dora_over_sync_tokens']:.2f}x response tokens/s; control "
        f"round {thr['round_ms_mean']['dora']:.2f} ms (p99 {thr['round_ms_p99']['dora']:.2f}); "
        f"wrote {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
