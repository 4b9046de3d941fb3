"""The real-model recipe's runs, side by side: held-out curve, wall time, sample completions.

    python benchmarks/smollm2_recipe_report.py --run dora=RUN_DIR --run sync=RUN_DIR \\
        --load-before 0.4,0.5,0.6 --command "python launch/train.py --config ..."

reads each run directory (``eval.jsonl``, ``eval_samples.jsonl``, ``metrics.jsonl``,
``summary.json``, ``config.yaml``) and writes ``benchmarks/results/smollm2_recipe.json`` (per run:
the held-out share solved (right and ended) at every evaluation with its binomial standard error,
the rise from the first evaluation to the last in standard errors of the difference, the run's
wall seconds, the median train step, real tokens per second, the mean reward of the first and
last five steps) and ``docs/smollm2_add_held_out.png`` (held-out share against consumed samples,
one line per run), and prints two held-out problems' responses before and after training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from quiet import commit, rel  # noqa: E402

from dora_jax.config import load_config  # noqa: E402
from dora_jax.curves import reward_curve_plot  # noqa: E402
from dora_jax.metrics import binomial_se, read_metrics  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def run_figures(run_dir: Path) -> dict:
    evals = read_metrics(run_dir / "eval.jsonl")
    samples = read_rows(run_dir / "eval_samples.jsonl")
    metrics = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    n = len({r["problem"] for r in samples if r["step"] == evals[0]["step"]})

    cfg = load_config(run_dir / "config.yaml")
    per_step = cfg.train.group_size * cfg.orchestrator.train_batch_prompts
    held = [
        {
            "step": e["step"],
            "samples": e["step"] * per_step,
            "solved": e["eval/solved"],
            "se": binomial_se(e["eval/solved"], n),
            "response_len": e["eval/response_len"],
        }
        for e in evals
    ]
    first, last = held[0], held[-1]
    rise = last["solved"] - first["solved"]
    se_diff = math.sqrt(first["se"] ** 2 + last["se"] ** 2)
    steps = [m["train_step_s"] for m in metrics]
    return {
        "held_out_problems": n,
        "held_out": held,
        "rise": rise,
        "rise_in_se_of_difference": rise / se_diff if se_diff else None,
        "rise_in_se_of_first": rise / first["se"] if first["se"] else None,
        "wall_s": summary["wall_s"],
        "steps": len(metrics),
        "train_step_s_median": statistics.median(steps),
        "real_tokens_per_s_median": statistics.median(m["real_tokens_per_s"] for m in metrics),
        "reward_first5": statistics.mean(m["reward"] for m in metrics[:5]),
        "reward_last5": statistics.mean(m["reward"] for m in metrics[-5:]),
        "staleness_mean": summary.get("staleness_mean"),
        "samples_per_s": len(metrics) * per_step / summary["wall_s"],
    }


def before_after(run_dir: Path, problems: int = 2) -> list[dict]:
    """The first ``problems`` held-out problems solved at the last evaluation but not at the
    first (else the first problems), with both responses."""
    rows = read_rows(run_dir / "eval_samples.jsonl")
    steps = sorted({r["step"] for r in rows})
    at = {s: {r["problem"]: r for r in rows if r["step"] == s and r["sample"] == 0} for s in steps}
    first, last = at[steps[0]], at[steps[-1]]
    turned = [p for p in sorted(first) if not first[p]["correct"] and last[p]["correct"]]
    chosen = (turned or sorted(first))[:problems]
    return [
        {
            "prompt": first[p]["prompt"],
            "answer": first[p]["answer"],
            "before": {
                "step": steps[0],
                "response": first[p]["response"],
                "correct": first[p]["correct"],
                "finish": first[p]["finish"],
            },
            "after": {
                "step": steps[-1],
                "response": last[p]["response"],
                "correct": last[p]["correct"],
                "finish": last[p]["finish"],
            },
        }
        for p in chosen
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR")
    p.add_argument("--load-before", default="", help="the 1/5/15-minute load averages at start")
    p.add_argument("--command", default="", help="the command that ran each run")
    p.add_argument("--note", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "smollm2_recipe.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "smollm2_add_held_out.png"))
    args = p.parse_args(argv)
    runs = dict(r.split("=", 1) for r in args.run)
    out = {
        "what": "the smollm2-add-cpu recipe: held-out share of sums right and ended, "
        "against consumed samples, per mode",
        "runs": {},
    }
    curves = {}
    for label, d in runs.items():
        fig = run_figures(Path(d))
        fig["before_after"] = before_after(Path(d))
        out["runs"][label] = fig
        curves[label] = [(h["samples"], h["solved"]) for h in fig["held_out"]]
        print(
            f"{label}: held-out {fig['held_out'][0]['solved']:.3f} -> "
            f"{fig['held_out'][-1]['solved']:.3f} (+{fig['rise']:.3f}, "
            f"{fig['rise_in_se_of_difference']:.1f} SE of the difference), "
            f"{fig['wall_s']:.0f} s, median train step {fig['train_step_s_median']:.1f} s"
        )
        for ba in fig["before_after"]:
            print(f"  {ba['prompt']!r} (answer {ba['answer']}):")
            print(f"    step {ba['before']['step']}: {ba['before']['response']!r}")
            print(f"    step {ba['after']['step']}: {ba['after']['response']!r}")
    reward_curve_plot(
        curves,
        args.plot,
        ylabel="held-out share right and ended",
        title="SmolLM2-135M-Instruct, additions over [1, 20] (200 held out)",
    )
    load = [float(x) for x in args.load_before.split(",")] if args.load_before else None

    out.update(
        {
            "command": args.command,
            "commit": commit(),
            "load_average_before": load,
            "load_average_after": list(os.getloadavg()),
            "cpus": os.cpu_count(),
            "note": args.note,
            "plot": rel(args.plot),
        }
    )
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {rel(args.out)} and {rel(args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
