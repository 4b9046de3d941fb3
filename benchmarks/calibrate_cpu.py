"""Calibrate the simulator's CPU preset on this machine and check it against real runs.

    python benchmarks/calibrate_cpu.py [--steps 80] [--repeats 40] [--skip-runs]

Three phases, on the default task (``configs/default.yaml``: the tiny Qwen2-architecture policy,
4 rollout groups of one fake CPU device, trainer on a 2x2 submesh), written to
``benchmarks/results/calibrate_cpu.json``:

1. **Constants**, measured on the real engine and trainer in this process: the time of one engine
   step that decodes (one device call of ``rollout.decode_steps`` tokens per request; shapes are
   batch-invariant, so it is timed at 1, 4 and 8 active requests and short and long contexts to
   show that it barely moves), of one that prefills (one prefill chunk), of a train step (pack,
   jitted GRPO step, export of the new params: what the pipeline's trainer does), of loading a
   version's params into a group, and of moving requests with their KV between two groups.
2. **Measured runs**: ``python launch/train.py`` in ``sync`` and ``dora`` with
   ``orchestrator.clock=wall`` (every group and the trainer on worker threads of one process),
   ``--steps`` train steps, no held-out evaluation; their ``summary.json`` gives the wall-clock
   throughput (response tokens consumed by training per second) and the measured workload
   (every consumed response's length, the prompts' lengths).
3. **Prediction**: the simulator with the CPU preset (``configs/sim/cpu_default_task.yaml``:
   these constants, the default task's cluster and orchestration, each run's own measured
   response and prompt lengths) runs the same mode. The preset treats the machine as the one
   shared resource it is: on 2 cores one XLA computation already uses both, so the groups' and
   the trainer's work does not overlap in wall time. The predicted wall time is therefore the
   sum of all the work the simulation schedules (every group's prefill, decode, weight loads and
   KV moves, and every train step) and the predicted throughput is the tokens consumed over it.

The prediction and the measurement are printed side by side with the residual of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)

OUT = ROOT / "benchmarks" / "results" / "calibrate_cpu.json"
PRESET = ROOT / "configs" / "sim" / "cpu_default_task.yaml"
NO_EOS = -1  # calibration requests run to their length


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 4)


def measure_constants(repeats: int) -> dict:
    """Phase 1 (see the module doc): seconds per engine decode step, prefill step, train step,
    weight load and KV move, medians of ``repeats``."""
    import jax
    import numpy as np

    from dora_jax.config import load_config
    from dora_jax.mesh import build_meshes
    from dora_jax.model import init_params
    from dora_jax.rollout import Engine, Request, request_key
    from dora_jax.train import Trainer, Trajectory

    cfg = load_config(ROOT / "configs" / "default.yaml", [])
    rc = cfg.rollout
    meshes = build_meshes(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    e0 = Engine(cfg.model, rc, meshes.groups[0], NO_EOS)
    e1 = Engine(cfg.model, rc, meshes.groups[1], NO_EOS)
    e0.load_params(params, 0)
    e1.load_params(params, 0)
    rid = [0]

    def requests(n: int, prompt: int, new: int) -> list:
        out = []
        for _ in range(n):
            rid[0] += 1
            toks = [3 + (rid[0] + j) % 20 for j in range(prompt)]
            out.append(Request(rid[0], toks, 0, request_key(cfg.seed, rid[0]), new))
        return out

    def drain(e: Engine) -> None:
        while e.has_work:
            e.step()

    # decode: n active requests, timed at short and long contexts
    decode: dict[str, float] = {}
    samples_all: list[float] = []
    for n in (1, 4, 8):
        e0.submit(requests(n, 8, rc.max_new_tokens))
        e0.step()  # prefill (and the first token)
        e0.step()  # warm
        short, long_ = [], []
        while e0.has_work:
            t0 = time.perf_counter()
            rep = e0.step()
            dt = time.perf_counter() - t0
            if rep.prefill_tokens:
                continue
            ctx = max((r.total_tokens for r in e0.slots if r is not None), default=0)
            (short if ctx < rc.max_new_tokens / 2 else long_).append(dt)
        decode[f"n{n}_short_ms"] = _median_ms(short)
        decode[f"n{n}_long_ms"] = _median_ms(long_)
        samples_all += short + long_
    decode_s = statistics.median(samples_all)

    # prefill: one step that admits n fresh requests (one chunk each)
    prefill = []
    for i in range(repeats):
        e0.submit(requests(1 + i % rc.max_slots, 8 + i % 8, 1))
        t0 = time.perf_counter()
        e0.step()
        prefill.append(time.perf_counter() - t0)
        drain(e0)

    # KV move: n requests with ~half their tokens cached, e0 -> e1 (pack, copy, unpack)
    moves = []
    for i in range(repeats):
        batch = requests(1 + i % 4, 8, rc.max_new_tokens)
        e0.submit(batch)
        for _ in range(1 + rc.max_new_tokens // (2 * max(1, rc.decode_steps))):
            e0.step()
        mine = {r.id for r in batch}
        ids = [r.id for r in e0.slots if r is not None and r.id in mine]
        if not ids:
            continue
        t0 = time.perf_counter()
        e1.import_requests(e0.export_requests(ids))
        jax.block_until_ready(e1.cache)
        moves.append(time.perf_counter() - t0)
        drain(e0)
        drain(e1)

    # weight load into a group, and the train step (pack, GRPO step, export)
    trainer = Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params)
    loads = []
    for i in range(max(5, repeats // 4)):
        exported = trainer.export_params()
        t0 = time.perf_counter()
        e1.load_params(exported, i + 1)
        jax.block_until_ready(e1.params)
        loads.append(time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    G, tbs = cfg.train.group_size, cfg.orchestrator.train_batch_prompts

    def batch_of(step: int) -> list:
        trajs = []
        for g in range(tbs):
            for _ in range(G):
                n = int(rng.integers(4, 40))
                trajs.append(
                    Trajectory(
                        prompt_tokens=rng.integers(3, 40, 8).astype(np.int32),
                        response_tokens=rng.integers(3, 40, n).astype(np.int32),
                        behavior_logprobs=np.full(n, -1.0, np.float32),
                        reward=float(rng.integers(0, 2)),
                        version=trainer.version,
                        group_id=step * tbs + g,
                    )
                )
        return trajs

    train = []
    for i in range(max(6, repeats // 4)):
        trajs = batch_of(i)
        t0 = time.perf_counter()
        packed = trainer.pack(trajs, num_groups=tbs)
        trainer.step(packed)
        jax.block_until_ready(trainer.export_params())
        if i:  # the first step compiles
            train.append(time.perf_counter() - t0)
    return {
        "decode_step_s": decode_s,
        "decode_detail_ms": decode,
        "decode_steps_per_call": rc.decode_steps,
        "prefill_step_s": statistics.median(prefill),
        "prefill_chunk_tokens": rc.prefill_chunk,
        "kv_move_s": statistics.median(moves),
        "weight_load_s": statistics.median(loads),
        "train_step_s": statistics.median(train),
        "max_slots": rc.max_slots,
        "kv_capacity_tokens": (rc.num_pages - 1) * rc.page_size,
        "samples": {
            "decode": len(samples_all),
            "prefill": len(prefill),
            "kv_move": len(moves),
            "weight_load": len(loads),
            "train": len(train),
        },
    }


def run_real(mode: str, steps: int, workdir: Path, warm_from: Path | None) -> dict:
    """Phase 2 for one mode: ``launch/train.py`` on the wall clock; its summary and workload."""
    run_dir = workdir / mode
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if warm_from is not None and (warm_from / "warm_start").is_dir():
        shutil.copytree(warm_from / "warm_start", run_dir / "warm_start")  # the cached warm start
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        "--mode",
        mode,
        "orchestrator.clock=wall",
        f"train.total_steps={steps}",
        "eval.num_prompts=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"run_dir={run_dir}",
    ]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    extra = summary["extra"]
    s = summary["summary"]
    return {
        "command": " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
        "process_wall_s": wall,
        "load_average_before": load0,
        "load_average_after": os.getloadavg()[0],
        "seconds": s["seconds"],
        "steps": s["steps"],
        "tokens": s["tokens"],
        "tokens_per_s": s["tokens_per_s"],
        "traj_per_s": s["traj_per_s"],
        "bubble": s["bubble"],
        "weight_transfers": s["weight_transfers"],
        "migrated": s["migrated"],
        "overheads": summary["overheads"],
        "response_lens": extra["consumed_response_lens"],
        "prompt_lens": extra["consumed_prompt_lens"],
        "run_dir": quiet.rel(run_dir),
    }


def predict(mode: str, constants_path: Path, run: dict, workdir: Path, steps: int) -> dict:
    """Phase 3 for one mode: the simulator with the CPU preset on the run's own workload."""
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate
    from dora_jax.sim.workload import Z99

    lens = OUT.with_name(f"calibrate_cpu_{mode}_response_lens.txt")  # the preset's workload
    lens.write_text(
        f"# response lengths consumed by the measured {mode} run (benchmarks/calibrate_cpu.py)\n"
        + "\n".join(str(x) for x in run["response_lens"])
        + "\n"
    )
    plens = sorted(run["prompt_lens"])
    med = statistics.median(plens)
    p99 = plens[min(len(plens) - 1, int(0.99 * len(plens)))]
    overrides = [
        f"calibration={quiet.rel(constants_path)}",
        f"response.path={lens.relative_to(ROOT)}",
        f"prompt.median={med}",
        f"prompt.p99_ratio={max(1.0, p99 / med)}",
        f"run.steps={steps}",
        f"run.warmup_steps={min(5, steps - 1)}",
        f"run.modes=[{mode}]",
        "run.colocated=[]",
    ]
    cfg = load_sim_config(PRESET, overrides)
    r = simulate(cfg, mode)
    m = r.metrics
    # the shared machine: the wall time is the sum of all the work, not its parallel span
    rec, be = r.result.records, r.backend
    w, n = cfg.run.warmup_steps, min(cfg.run.steps, len(rec.steps))
    t0, t1 = rec.steps[w - 1].end if w else 0, rec.steps[n - 1].end
    from dora_jax.sim.backend import CATEGORIES

    secs = dict(zip(CATEGORIES, map(float, sum(be.seconds[t0:t1])), strict=True))
    busy = sum(v for k, v in secs.items() if k not in ("idle", "train"))
    v_lo, v_hi = rec.steps[w].version - 1, rec.steps[n - 1].version
    train = sum(s.seconds for s in r.trainer.steps if v_lo < s.version <= v_hi)
    tokens = m.tokens_per_s * m.step_s * m.steps
    work = {k: v for k, v in secs.items() if k not in ("idle", "train") and v}
    return {
        "overrides": overrides,
        "tokens_per_s": tokens / (busy + train),
        "wall_s_per_step": (busy + train) / m.steps,
        "work_s_per_step": {**{k: v / m.steps for k, v in work.items()}, "train": train / m.steps},
        "engine_steps_per_step": {
            "decode": secs["decode"] / m.steps / _decode_step(constants_path),
        },
        "parallel_tokens_per_s": m.tokens_per_s,  # as if every group had its own machine
        "bubble": m.bubble,
        "staleness_mean": m.staleness_mean,
        "z99": Z99,
    }


def _decode_step(constants_path: Path) -> float:
    c = json.loads(constants_path.read_text())["constants"]
    return c["decode_step_s"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80, help="train steps of each measured run")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--skip-runs", action="store_true", help="constants only (no real runs)")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "calibrate_cpu")
    p.add_argument("--out", type=Path, default=OUT, help="where the constants and figures go")
    p.add_argument(
        "--recompare",
        action="store_true",
        help="only recompute the comparison of the stored measurements and predictions",
    )
    args = p.parse_args(argv)
    if args.recompare:
        payload = json.loads(args.out.read_text())
        payload["comparison"] = compare(payload)
        args.out.write_text(json.dumps(payload, indent=2, default=float) + "\n")
        print(json.dumps(payload["comparison"], indent=2))
        return 0
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    constants = measure_constants(args.repeats)
    payload = {
        "benchmark": "CPU preset of the simulator: constants measured on the real engine and "
        "trainer, predicted against measured wall-clock throughput of the default task",
        "command": " ".join(["python", "benchmarks/calibrate_cpu.py", *argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}",
        "load_average_during_constants": [load0, os.getloadavg()[0]],
        "units": "seconds per engine step / train step / move; tokens: response tokens consumed "
        "by training per second of wall time",
        "constants": constants,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    c = constants
    print(
        f"constants ({time.perf_counter() - t0:.0f} s): decode step {1e3 * c['decode_step_s']:.2f}"
        f" ms ({c['decode_steps_per_call']} tokens per request), prefill step "
        f"{1e3 * c['prefill_step_s']:.2f} ms, train step {c['train_step_s']:.3f} s, weight load "
        f"{1e3 * c['weight_load_s']:.2f} ms, KV move {1e3 * c['kv_move_s']:.2f} ms; decode by "
        f"active requests and context (ms): {c['decode_detail_ms']}"
    )
    if args.skip_runs:
        print(f"wrote {args.out}")
        return 0
    runs, preds, warm = {}, {}, None
    for mode in ("dora", "sync"):
        runs[mode] = run_real(mode, args.steps, args.workdir, warm)
        warm = ROOT / runs[mode]["run_dir"]
        preds[mode] = predict(mode, args.out, runs[mode], args.workdir, args.steps)
        r, q = runs[mode], preds[mode]
        print(
            f"{mode}: measured {r['tokens_per_s']:.1f} tokens/s over {r['seconds']:.1f} s "
            f"({r['steps']} steps), predicted {q['tokens_per_s']:.1f} "
            f"({100 * (q['tokens_per_s'] / r['tokens_per_s'] - 1):+.1f}%); load average "
            f"{r['load_average_before']:.1f} -> {r['load_average_after']:.1f}"
        )
    payload["runs"] = {
        m: {k: v for k, v in runs[m].items() if not k.endswith("_lens")} for m in runs
    }
    payload["workload"] = {
        m: {
            "responses": len(runs[m]["response_lens"]),
            "response_mean": statistics.mean(runs[m]["response_lens"]),
            "response_median": statistics.median(runs[m]["response_lens"]),
            "response_max": max(runs[m]["response_lens"]),
            "prompt_median": statistics.median(runs[m]["prompt_lens"]),
        }
        for m in runs
    }
    payload["predicted"] = preds
    payload["comparison"] = compare(payload)
    c = payload["comparison"]["dora_over_sync"]
    print(f"dora / sync: measured {c['measured']:.2f}x, predicted {c['predicted']:.2f}x")
    args.out.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(f"wrote {args.out}")
    return (
        0
        if all(math.isfinite(v["error"]) for k, v in payload["comparison"].items() if "error" in v)
        else 1
    )


def compare(payload: dict) -> dict:
    """Predicted against measured: tokens/s (the headline), and trajectories/s and seconds per
    train step, which do not depend on how the simulator's draws of the measured response
    lengths happen to average."""
    runs, preds, out = payload["runs"], payload["predicted"], {}
    for m in runs:
        r, q = runs[m], preds[m]
        traj_step = r["tokens"] / r["steps"] / payload["workload"][m]["response_mean"]
        step_m, step_p = r["seconds"] / r["steps"], q["wall_s_per_step"]
        out[m] = {
            "measured_tokens_per_s": r["tokens_per_s"],
            "predicted_tokens_per_s": q["tokens_per_s"],
            "error": q["tokens_per_s"] / r["tokens_per_s"] - 1,
            "measured_s_per_step": step_m,
            "predicted_s_per_step": step_p,
            "measured_traj_per_s": traj_step / step_m,
            "predicted_traj_per_s": traj_step / step_p,
            "traj_error": step_m / step_p - 1,
        }
    out["dora_over_sync"] = {
        "measured": runs["dora"]["tokens_per_s"] / runs["sync"]["tokens_per_s"],
        "predicted": preds["dora"]["tokens_per_s"] / preds["sync"]["tokens_per_s"],
    }
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
