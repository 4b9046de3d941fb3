"""Host-side overhead of one engine step: what the Python around the jitted decode costs.

    python benchmarks/bench_engine_overhead.py [--steps 300]

Runs one rollout group (the default config's engine: 8 slots, 4 decode steps per call) full of
long requests, times every ``Engine.step`` and, inside it, the jitted decode call until its
tokens are on the host; the rest is host work (building the step's inputs, reading the tokens,
bookkeeping). The worker thread's own work per step on the wall clock (the status snapshot and the
report) is timed too. Writes ``benchmarks/results/bench_engine_overhead.json``. On an accelerator
the jitted part is what changes (a decode step of a real model takes 10-30 ms on a GPU); the host
part is the same Python, so its share there is host_ms / (host_ms + 10..30 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/bench_engine_overhead.json"
    )
    a = p.parse_args(argv)

    import jax
    import numpy as np

    import dora_jax.rollout.engine as eng
    from dora_jax.config import load_config
    from dora_jax.execution.group import GroupWorker, Place
    from dora_jax.mesh import make_mesh
    from dora_jax.model import init_params
    from dora_jax.rollout import Engine, Request, request_key

    cfg = load_config(ROOT / "configs" / "default.yaml", [])
    engine = Engine(cfg.model, cfg.rollout, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1)
    engine.load_params(init_params(cfg.model, jax.random.key(0)), 0)
    worker = GroupWorker(0, engine, time.perf_counter, Place())
    jitted: list[float] = []
    decode = eng._decode_jit

    def timed_decode(*args, **kw):
        t0 = time.perf_counter()
        out = decode(*args, **kw)
        jax.block_until_ready(out[1:3])
        jitted.append(time.perf_counter() - t0)
        return out

    eng._decode_jit = timed_decode
    rid = 0
    steps, snaps = [], []
    try:
        while len(steps) < a.steps:
            free = engine.load().free_slots - engine.load().pending
            for _ in range(max(free, 0)):
                rid += 1
                engine.submit([Request(rid, [5, 6, 7, 8], 0, request_key(0, rid), 160)])
            n_before = len(jitted)
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            worker._status()
            snap = time.perf_counter() - t1
            if len(jitted) > n_before and rid > 16:  # decode steps only, after warm-up
                steps.append((dt, jitted[-1]))
                snaps.append(snap)
    finally:
        eng._decode_jit = decode
    total = [s for s, _ in steps]
    device = [j for _, j in steps]
    host = [s - j for s, j in steps]
    med = {
        k: 1e3 * statistics.median(v)
        for k, v in (
            ("step_ms", total),
            ("jitted_ms", device),
            ("host_ms", host),
            ("worker_ms", snaps),
        )
    }
    per_step = med["host_ms"] + med["worker_ms"]
    res = {
        "benchmark": "host-side overhead per engine step (default config engine, CPU)",
        "command": "python benchmarks/bench_engine_overhead.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "steps": len(steps),
        "median": med,
        "host_share_here": per_step / med["step_ms"],
        "host_share_on_gpu": {f"{d} ms decode": per_step / (per_step + d) for d in (10, 20, 30)},
        "units": "milliseconds per engine step (one call: 8 slots x 4 decode steps)",
        "p90_host_ms": 1e3 * float(np.percentile(host, 90)),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"engine step {med['step_ms']:.2f} ms: jitted decode {med['jitted_ms']:.2f} ms, host "
        f"{med['host_ms']:.2f} ms, worker {med['worker_ms']:.3f} ms; host share here "
        f"{res['host_share_here']:.0%}, on a GPU with 10/20/30 ms decodes: "
        + " / ".join(f"{v:.0%}" for v in res["host_share_on_gpu"].values())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
