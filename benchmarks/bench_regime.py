"""The regime sweep: dora over sync as rollout takes a larger share of a synchronous step,
measured on the two-process arrangement and predicted by the simulator.

    python benchmarks/bench_regime.py [--values 1,2,3,5,8] [--knob data.median_steps]
        [--steps 30] [--warmup 8] [--rounds 2] [--keep DIR] [overrides ...]
    python benchmarks/bench_regime.py --repredict RESULT.json --calibration CONSTANTS.json

One knob is varied; by default the default task's ``data.median_steps`` (the median number of
steps of a problem, so the median response length), with ``rollout.max_new_tokens`` fixed: the
shorter the typical response against the cap, the more of a synchronous step might go to
waiting for the long tail (on 2 CPU cores the measured share barely moves: see docs/benchmarks.md).
At each value, ``sync`` and ``dora`` (K=2) run on ``bench_wallclock``'s arrangement (two
processes, each pinned to its own core: the trainer and the control plane on one, the four
rollout groups on the other), each with the default config otherwise. Per point:

- ``sync_rollout_share``: the share of sync's measured window in which the trainer waited (one
  minus its busy share): the rollout-only phase of a synchronous step;
- ``dora_over_sync_tokens``: response tokens consumed by training per wall second, dora over sync;
- ``predicted``: the simulator's CPU preset at the point (``benchmarks/sim_agentic_cpu.py``'s
  predictor: the rollout groups share one core), each mode on the responses its run consumed
  and with its trainer's measured busy seconds per step, the engine's constants measured first
  in a process pinned to one core, and what the two-process arrangement adds to them (a
  weight load's trip between the processes, the group host's work per engine call), measured
  by one ``sync`` run of the default config that is not a point of the sweep
  (``--calibration``); ``predicted_preset_constants``: the same with the preset's constants,
  measured in one process over both cores.

The window starts after ``--warmup`` steps, when every shape has compiled and dora's requests
in flight have had time to reach their steady mix. Compare the response tokens per consumed
trajectory of the two modes (in the runs' figures): at ``median_steps`` 3 and 5 dora's were
12% and about 30% fewer than sync's, with 4 warm-up steps and 20 measured as with 8 and 30, so
a tokens-per-second ratio there also measures how the two modes' policies drift in length.

Writes ``benchmarks/results/bench_regime.json`` and ``docs/regime_sweep.png`` (measured and
predicted dora / sync against sync's rollout share, with the paper's two clusters marked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402
from bench_wallclock import run_mode  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT = ROOT / "configs" / "default.yaml"
PLOT = ROOT / "docs" / "regime_sweep.png"
MODES = ("sync", "dora")
PRESET_KEY = "predicted_preset_constants"
# the published synchronous baseline's rollout-only share of a step and dora's end-to-end
# throughput over it (32B dense model, long-tailed math): 64 and 128 GPUs
PAPER = (
    {"gpus": 64, "sync_rollout_share": 0.65, "dora_over_sync": 1.65},
    {"gpus": 128, "sync_rollout_share": 0.73, "dora_over_sync": 2.12},
)


def point(a, value: str, work: Path) -> dict:
    """Sync and dora at one value of the knob: the measured figures and the prediction."""
    extra = [f"{a.knob}={value}", *a.overrides]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for mode in MODES:
            f = run_mode(mode, a.warmup, a.steps, work, extra)
            runs[mode].append(f)
            print(
                f"  {a.knob}={value} {mode:>4}: {f['response_tokens_per_s']:.0f} response "
                f"tokens/s over {f['seconds']:.1f} s, trainer busy "
                f"{f['train_busy_share']:.2f}, train step {f['train_step_s_median']:.2f} s, "
                f"group idle {', '.join(f'{x:.2f}' for x in f['group_idle'])}",
                flush=True,
            )
    tok = {m: statistics.median(f["response_tokens_per_s"] for f in fs) for m, fs in runs.items()}
    busy = statistics.median(f["train_busy_share"] for f in runs["sync"])
    res = {
        "value": value,
        "sync_rollout_share": 1.0 - busy,
        "dora_over_sync_tokens": tok["dora"] / tok["sync"],
        "response_tokens_per_s": tok,
        "overlap_dora": statistics.median(f["overlap"] for f in runs["dora"]),
        "train_step_s": {
            m: statistics.median(f["train_step_s_median"] for f in fs) for m, fs in runs.items()
        },
        "runs": runs,
    }
    if not a.no_sim:
        res["predicted"] = predicted(a, runs, extra, a.calibration)
        # the CPU preset's own constants, measured in one process over both cores
        res[PRESET_KEY] = predicted(a, runs, extra)
    return res


def predicted(
    a, runs: dict[str, list[dict]], extra: list[str], calibration: Path | None = None
) -> dict:
    """The simulator at the point's config, each mode on its own measured responses (the ones
    its first run consumed: the policies of the two modes drift apart as they train, and so do
    their lengths) and its own measured train step: the trainer's busy seconds per step over
    the window (its steps' spans: the jitted step and the host work around it, packing the
    batch, exporting and serving the new version; dora's run while the other core decodes and
    can take longer), the median over rounds. The simulator's trainer is busy that long per
    step; the median of the jitted step alone (``train_step_s_median``) is shorter than the
    mean span by 5-15% here, and throughput follows the mean."""
    from sim_agentic_cpu import predict

    step_s = {m: statistics.median(busy_per_step(f) for f in runs[m]) for m in MODES}
    sims = {}
    for m in MODES:
        sims[m] = predict(
            Path(runs[m][0]["run_dir"]) / "conversations.jsonl",
            0.0,
            0.0,
            modes=(m,),
            steps=a.sim_steps,
            recipe=DEFAULT,
            train_step_s=step_s[m],
            env_workers=0,
            recipe_overrides=extra,
            calibration=calibration,
        )
    rate = {m: sims[m]["model_tokens_per_s"][m] for m in MODES}
    measured = {m: statistics.median(f["response_tokens_per_s"] for f in runs[m]) for m in MODES}
    return {
        "dora_over_sync_tokens": rate["dora"] / rate["sync"],
        "error_per_mode": {m: rate[m] / measured[m] - 1 for m in MODES},
        "sync_rollout_share": sims["sync"]["modes"]["sync"]["trainer_waiting_frac"],
        "response_tokens_per_s": rate,
        "train_step_s": step_s,
        "modes": {
            m: {k: v for k, v in sims[m]["modes"][m].items() if isinstance(v, (int, float))}
            for m in MODES
        },
        "fit": sims["sync"]["workload"]["fit"],
    }


def busy_per_step(f: dict) -> float:
    """A run's trainer-busy seconds per train step over its measured window."""
    return f["train_busy_share"] * f["seconds"] / f["steps"]


def calibrate(out: Path) -> Path:
    """The simulator's constants (engine steps, weight loads, KV moves) measured in a process
    pinned to one core, as the rollout groups' process is (a tiny model's engine step is faster
    on one core than spread over two); ``benchmarks/calibrate_cpu.py --skip-runs``."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "calibrate_cpu.py"),
        "--skip-runs",
        "--out",
        str(out),
    ]
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1:
        cmd = ["taskset", "-c", str(max(os.sched_getaffinity(0))), *cmd]
    subprocess.run(cmd, check=True)
    return out


def calibrate_cross_process(path: Path, work: Path, warmup: int = 8, steps: int = 20) -> Path:
    """Add to the one-core constants at ``path`` what the two-process arrangement costs on top:
    one ``sync`` run on the default config (not a point of the sweep), and between its train
    steps (``wallclock_driver``'s ``between_steps_s``, means per gap):

    - ``weight_trip_s``: the wall time in which some group loaded weights (the loads of the
      four groups overlap: each waits on the pull from the other process, not on the core),
      less the load's own measured work (``weight_load_s``): a wait that holds no core;
    - ``engine_call_overhead_s``: the time in which some group prefilled or decoded, less the
      one-core constants times the engine calls made in it, per call: the group host's own
      work (commands, reports, the messaging threads) on the rollout core."""
    cal = json.loads(path.read_text())
    c = cal["constants"]
    f = run_mode("sync", warmup, steps, work, [])
    b = f["between_steps_s"]
    calls = b["prefill_steps"] + b["decode_steps"]
    engine = b["prefill_steps"] * c["prefill_step_s"] + b["decode_steps"] * c["decode_step_s"]
    c["engine_call_overhead_s"] = max(0.0, (b["rollout"] - engine) / calls) if calls else 0.0
    c["weight_trip_s"] = max(0.0, b["weight_load"] - c["weight_load_s"])
    cal["cross_process"] = {
        "how": "one sync run of the default config on bench_wallclock's two-process "
        f"arrangement ({warmup} warm-up + {steps} measured steps); between its train steps: "
        "weight_trip_s = weight-load wall time - weight_load_s; engine_call_overhead_s = "
        "(rollout wall time - prefill/decode calls x their one-core seconds) / calls",
        "between_steps_s": b,
        "seconds_per_step": f["seconds"] / f["steps"],
        "train_step_s_median": f["train_step_s_median"],
        "weight_load_s_median": f["weight_load_s_median"],
    }
    path.write_text(json.dumps(cal, indent=2) + "\n")
    print(
        f"cross-process calibration: weight trip {1e3 * c['weight_trip_s']:.1f} ms, engine call "
        f"overhead {1e3 * c['engine_call_overhead_s']:.2f} ms (one-core call "
        f"{1e3 * c['decode_step_s']:.2f} ms) from {calls:.0f} calls per gap",
        flush=True,
    )
    return path


def plot(series: list[tuple[str, list[dict]]], knob: str, out: Path) -> None:
    """Measured and predicted dora / sync against sync's rollout share, a line each per
    series (its label, its points), the paper's two clusters as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    colours = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b")
    for (label, points), colour in zip(series, colours, strict=False):
        x = [p["sync_rollout_share"] for p in points]
        y = [p["dora_over_sync_tokens"] for p in points]
        ax.plot(x, y, "o", color=colour, label=f"measured{label}")
        for p in points:
            ax.annotate(
                f"{p['value']}",
                (p["sync_rollout_share"], p["dora_over_sync_tokens"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        for key, style, name in (
            ("predicted", "s", "simulator, calibrated (one core, then two processes)"),
            (PRESET_KEY, "^", "simulator, preset constants"),
        ):
            pred = [p for p in points if p.get(key)]
            if pred:
                ax.plot(
                    [p[key]["sync_rollout_share"] for p in pred],
                    [p[key]["dora_over_sync_tokens"] for p in pred],
                    style,
                    color=colour,
                    alpha=0.6,
                    label=f"{name}{label}",
                )
    ax.scatter(
        [p["sync_rollout_share"] for p in PAPER],
        [p["dora_over_sync"] for p in PAPER],
        marker="*",
        s=160,
        color="#d62728",
        zorder=3,
        label="paper: 32B, 64 and 128 GPUs",
    )
    for p in PAPER:
        ax.annotate(
            f"{p['gpus']} GPUs",
            (p["sync_rollout_share"], p["dora_over_sync"]),
            textcoords="offset points",
            xytext=(6, -10),
            fontsize=8,
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("sync: share of the step the trainer waits on rollout")
    ax.set_ylabel("dora / sync (response tokens per second)")
    ax.set_title(f"The regime sweep on 2 CPU cores ({knob}, labels: its value)", fontsize=10)
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=1)
    fig.tight_layout()
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)


def _read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _label(res: dict) -> str:
    """A series' label: its overrides of the default config, if any."""
    if res.get("label"):
        return f" ({res['label']})"
    extra = [x for x in res.get("overrides", []) if "=" in x]
    return f" ({', '.join(extra)})" if extra else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--knob", default="data.median_steps", help="the config key varied")
    p.add_argument("--values", default="1,2,3,5,8", help="its values, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="measured train steps per run")
    p.add_argument("--warmup", type=int, default=8, help="train steps before the window")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode per point")
    p.add_argument("--sim-steps", type=int, default=60, help="the simulator's train steps")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's predictions")
    p.add_argument(
        "--calibration",
        type=Path,
        help="the simulator's constants (default: measured first, pinned to one core, into "
        "benchmarks/results/bench_regime_calibration.json)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "bench_regime.json")
    p.add_argument("--plot", type=Path, default=PLOT)
    p.add_argument("--label", default="", help="this series' name in the plot")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only draw the plot again from a result of this benchmark (with --with)",
    )
    p.add_argument(
        "--with",
        dest="also",
        type=Path,
        action="append",
        default=[],
        help="an earlier result of this benchmark (another config) to draw beside this one",
    )
    p.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="keep the runs (and the calibration run) under DIR, for --repredict",
    )
    p.add_argument(
        "--repredict",
        type=Path,
        metavar="JSON",
        help="predict the points of an earlier result again (its runs kept with --keep) with "
        "--calibration's constants; writes --out",
    )
    p.add_argument(
        "--one-core",
        action="store_true",
        help="calibrate the one-core constants only (no cross-process calibration run)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    if a.replot:
        res = json.loads(a.replot.read_text())
        series = [(_label(r), r["points"]) for r in (res, *map(_read, a.also))]
        plot(series, res["knob"], a.plot)
        print(f"wrote {a.plot}")
        return 0
    if a.repredict:
        return repredict(a)
    values = [v.strip() for v in a.values.split(",") if v.strip()]
    if len(values) < 2:
        p.error("--values: give at least two values")
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)
    points = []
    with tempfile.TemporaryDirectory(prefix="bench_regime_") as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if not a.no_sim and a.calibration is None:
            a.calibration = calibrate(RESULTS / "bench_regime_calibration.json")
            if not a.one_core:
                (root / "calibration").mkdir(exist_ok=True)
                calibrate_cross_process(a.calibration, root / "calibration")
        for i, value in enumerate(values, 1):
            print(f"point {i}/{len(values)}: {a.knob}={value}", flush=True)
            work = root / f"point-{i}"  # the point's runs share its warm start
            work.mkdir()
            points.append(point(a, value, work))
            print(_point_line(points[-1], i, len(values)), flush=True)
            (root / "points.json").write_text(json.dumps(points, default=str))  # so far
        write_result(a, points, load0, argv)
    return 0


def _point_line(q: dict, i: int, n: int) -> str:
    line = (
        f"point {i}/{n}: sync rollout share {q['sync_rollout_share']:.2f}, "
        f"dora/sync {q['dora_over_sync_tokens']:.2f}x"
    )
    for key, name in (("predicted", "predicted"), (PRESET_KEY, "preset constants")):
        if q.get(key):
            line += (
                f"; {name} {q[key]['sync_rollout_share']:.2f}, "
                f"{q[key]['dora_over_sync_tokens']:.2f}x"
            )
    return line


def repredict(a) -> int:
    """The predictions of an earlier result again, from its runs kept with ``--keep`` (their
    ``conversations.jsonl``) and the constants of ``--calibration``: the measurement stays,
    the model is asked again."""
    res = json.loads(a.repredict.read_text())
    if a.calibration is None:
        raise SystemExit("--repredict: give the constants with --calibration")
    a.knob, a.overrides = res["knob"], res.get("overrides", [])
    points = res["points"]
    for i, q in enumerate(points, 1):
        missing = [
            f["run_dir"]
            for fs in q["runs"].values()
            for f in fs
            if not (Path(f["run_dir"]) / "conversations.jsonl").exists()
        ]
        if missing:
            raise SystemExit(
                f"--repredict: the runs are gone ({missing[0]}); keep them with --keep"
            )
        extra = [f"{a.knob}={q['value']}", *a.overrides]
        q["predicted"] = predicted(a, q["runs"], extra, a.calibration)
        q[PRESET_KEY] = predicted(a, q["runs"], extra)
        print(_point_line(q, i, len(points)), flush=True)
    write_result(a, points, None, None, measured=res)  # the measurement's load figures kept
    return 0


def write_result(a, points, load0, argv, measured: dict | None = None) -> None:
    """Write the result's JSON and plot (``measured``: the earlier result re-predicted)."""

    def errors(key: str) -> list[float]:
        return [
            abs(q[key]["dora_over_sync_tokens"] / q["dora_over_sync_tokens"] - 1)
            for q in points
            if q.get(key)
        ]

    err, err_preset = errors("predicted"), errors(PRESET_KEY)
    command = "python benchmarks/bench_regime.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    res = {
        "benchmark": "the regime sweep: dora (K=2) over sync against sync's rollout share, "
        "default task, real engines, and the simulator's prediction",
        "command": measured["command"] if measured else command,
        "arrangement": "2 processes (jax.distributed, gloo on loopback), each pinned to its own "
        "CPU core: process 0 = trainer (2x2 mesh) + control plane, process 1 = 4 rollout "
        "groups; wall clock",
        "knob": a.knob,
        "overrides": a.overrides,
        "label": a.label or (measured or {}).get("label", ""),
        "units": {
            "sync_rollout_share": "share of sync's measured window in which the trainer waited",
            "dora_over_sync_tokens": "response tokens consumed by training per wall second, "
            "dora over sync (median over rounds)",
            "predicted": "the simulator's CPU preset with each mode's measured responses and "
            "trainer-busy seconds per step at the point, the constants measured pinned to one "
            "core and the "
            "two-process arrangement's weight trip and engine-call overhead (calibration): the "
            "same two figures in modeled seconds",
            PRESET_KEY: "the same with the preset's constants (calibrate_cpu.json, measured "
            "in one process over both cores)",
            "prediction_error_max": "the largest |predicted / measured - 1| of dora over sync",
        },
        "calibration": quiet.rel(a.calibration) if a.calibration else None,
        "paper": PAPER,
        "points": points,
        "prediction_error_max": max(err) if err else None,
        "prediction_error_max_preset_constants": max(err_preset) if err_preset else None,
    }
    if measured:
        res["repredicted"] = command
        res.update({k: v for k, v in measured.items() if k not in res and k != "repredicted"})
    else:
        res.update({k: v for k, v in quiet.provenance(load0).items() if k != "command"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    series = [(_label(r), r["points"]) for r in (res, *map(_read, a.also))]
    plot(series, a.knob, a.plot)
    shares = ", ".join(f"{q['sync_rollout_share']:.2f}" for q in points)
    ratios = ", ".join(f"{q['dora_over_sync_tokens']:.2f}" for q in points)
    print(
        f"{len(points)} points; sync rollout share {shares}; dora/sync {ratios}"
        + (f"; largest prediction error {max(err):.1%}" if err else "")
        + (f" ({max(err_preset):.1%} with the preset's constants)" if err_preset else "")
        + f"; wrote {a.out} and {a.plot}"
    )


if __name__ == "__main__":
    sys.exit(main())
