"""What host copies of the rollout groups' requests cost (``rollout.backup_every_steps``, the KV a
failed group's requests continue from), measured side by side in one process:

    python benchmarks/bench_backups.py [--steps 60] [--every 1,8]

runs the default task (``configs/default.yaml``, logical clock) for ``--steps`` train steps
without copies, with a copy every N engine steps for each N of ``--every``, and without copies
again (the two runs without bracket the others: their difference is the noise), after a short
run that compiles everything. For each run: its wall seconds, the seconds spent taking copies
(every ``Snapshot`` timed where the backend asks for it), how many copies and the bytes of KV they
held. Writes ``benchmarks/results/bench_backups.json`` with the command, commit and load averages.
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

RESULTS = ROOT / "benchmarks" / "results" / "bench_backups.json"


def one_run(steps: int, every: int, work: Path) -> dict:
    from dora_jax.config import load_config
    from dora_jax.execution import recovery
    from dora_jax.main import DEFAULT_CONFIG
    from dora_jax.pipeline.experiment import build, run

    taken = {"s": 0.0, "copies": 0, "kv_bytes": 0}
    original = recovery.GroupRecovery.take_backups

    def timed(self):
        before = dict(self._backups)
        t0 = time.perf_counter()
        original(self)
        taken["s"] += time.perf_counter() - t0
        for g, snap in self._backups.items():
            if before.get(g) is not snap:
                taken["copies"] += 1
                taken["kv_bytes"] += int(snap.running.kv.nbytes) if snap.running.requests else 0

    recovery.GroupRecovery.take_backups = timed
    try:
        cfg = load_config(
            DEFAULT_CONFIG,
            [
                f"run_dir={work / f'run-{every}-{time.monotonic_ns()}'}",
                f"rollout.backup_every_steps={every}",
                "eval.num_prompts=0",
                "logging.progress=false",
                "logging.tensorboard=false",
                "checkpoint.every_steps=0",
                "warm_start.steps=0",
            ],
        )
        exp = build(cfg, Path(cfg.run_dir))
        try:
            t0 = time.perf_counter()
            run(exp, steps)
            wall = time.perf_counter() - t0
        finally:
            exp.close()
    finally:
        recovery.GroupRecovery.take_backups = original
    return {
        "backup_every_steps": every,
        "steps": steps,
        "wall_s": wall,
        "copy_s": taken["s"],
        "copy_share": taken["s"] / wall if wall else 0.0,
        "copies": taken["copies"],
        "kv_mib_copied": taken["kv_bytes"] / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", default="1,8", help="comma-separated N of the runs with copies")
    quiet.add_arguments(p)
    a = p.parse_args()
    load = quiet.wait_for_quiet(a.max_load, a.wait)
    from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas

    fake_cpu_devices(8)
    limit_malloc_arenas()
    work = Path(tempfile.mkdtemp(prefix="bench_backups-"))
    one_run(5, 0, work)  # compiles what every run uses
    plan = [0, *(int(x) for x in a.every.split(",")), 0]
    runs = []
    for every in plan:
        r = one_run(a.steps, every, work)
        runs.append(r)
        print(
            f"backup_every_steps={every}: {r['wall_s']:.1f} s, copies {r['copies']} taking "
            f"{r['copy_s']:.2f} s ({r['copy_share']:.1%} of the run), "
            f"{r['kv_mib_copied']:.1f} MiB of KV",
            flush=True,
        )
    base = [r["wall_s"] for r in runs if r["backup_every_steps"] == 0]
    ref = sum(base) / len(base)
    for r in runs:
        r["wall_vs_no_copies"] = r["wall_s"] / ref
    out = {
        "what": "host copies of the rollout groups' requests: run time with and without them",
        "runs": runs,
        "no_copies_spread": (max(base) - min(base)) / ref,
        "units": {"wall_s": "s", "copy_s": "s", "kv_mib_copied": "MiB"},
        **quiet.provenance(load),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for r in runs:
        print(
            f"every {r['backup_every_steps']}: {r['wall_vs_no_copies']:.3f}x the runs without "
            f"copies (their spread {out['no_copies_spread']:.1%})"
        )
    print(f"wrote {quiet.rel(RESULTS)}")


if __name__ == "__main__":
    main()
