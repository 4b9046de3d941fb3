"""Convergence side by side: `sync`, `dora` K=1 and `dora` K=3 on the default task, same
seed, same warm start; mean training reward and held-out solved share (the experiment's
evaluator: the same problems and sampling keys for every variant) against consumed samples,
plotted and tabulated.

    python launch/compare_convergence.py [--steps N] [--out runs/convergence] [key=value ...]

Writes ``OUT/reward_vs_samples.png``, ``OUT/held_out_vs_samples.png``, ``OUT/convergence.json``
and one run directory per variant (each with its own summary and timeline).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from dora_jax.config import load_config  # noqa: E402
from dora_jax.pipeline.evaluation import binomial_se  # noqa: E402
from dora_jax.pipeline.experiment import build, run  # noqa: E402
from dora_jax.report import reward_curve_plot  # noqa: E402

VARIANTS = {
    "sync": ["orchestrator.mode=sync", "orchestrator.staleness_k=0"],
    "dora K=1": ["orchestrator.mode=dora", "orchestrator.staleness_k=1"],
    "dora K=3": ["orchestrator.mode=dora", "orchestrator.staleness_k=3"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=Path("runs/convergence"))
    ap.add_argument("--window", type=int, default=10, help="steps per smoothing window")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    curves, eval_curves, table = {}, {}, {}
    for name, extra in VARIANTS.items():
        slug = name.replace(" ", "_").replace("=", "")
        cfg = load_config(
            "configs/default.yaml", [*args.overrides, *extra, f"run_dir={args.out / slug}"]
        )
        exp = build(cfg, args.out / slug, warm_start_dir=args.out / "warm_start")
        points: list[tuple[int, float]] = []
        ev = exp.evaluator
        held_out = [(0, exp.evaluate(0).solved)] if ev else []
        seen = 0

        def on_step(log, points=points, held_out=held_out, exp=exp):
            nonlocal seen
            seen += len(log.rewards)
            points.append((seen, float(np.mean(log.rewards))))
            if exp.evaluator and (
                log.version % exp.cfg.eval.every_steps == 0 or log.version == args.steps
            ):
                held_out.append((seen, exp.evaluate(log.version).solved))

        result = run(exp, args.steps, on_step)
        r = np.array([p[1] for p in points])
        w = args.window
        curves[name] = points
        if held_out:
            eval_curves[f"{name} (held-out solved)"] = held_out
        n_eval = len(ev.prompts) if ev else 0
        table[name] = {
            "held_out_solved": [x for _, x in held_out],
            "held_out_solved_se_end": (binomial_se(held_out[-1][1], n_eval) if ev else None),
            "held_out_problems": n_eval,
            "first_window_reward": float(r[:w].mean()),
            "last_window_reward": float(r[-w:].mean()),
            "reward_sem_last_window": float(r[-w:].std(ddof=1) / np.sqrt(w)),
            "samples": seen,
            "ticks": result.summary.ticks,
            "wall_s": exp.wall_s,
            "staleness_mean": result.summary.staleness_mean,
        }
        t = table[name]
        print(
            f"{name:9s} reward {t['first_window_reward']:.3f} -> {t['last_window_reward']:.3f} "
            f"(+- {t['reward_sem_last_window']:.3f}), {seen} samples, "
            f"{result.summary.ticks} ticks, {exp.wall_s:.0f} s"
            + (
                f"; held-out solved {held_out[0][1]:.3f} -> {held_out[-1][1]:.3f} "
                f"(+- {t['held_out_solved_se_end']:.3f})"
                if held_out
                else ""
            ),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    reward_curve_plot(curves, args.out / "reward_vs_samples.png", xlabel="consumed samples")
    if eval_curves:
        reward_curve_plot(
            eval_curves,
            args.out / "held_out_vs_samples.png",
            xlabel="consumed samples",
            ylabel="held-out solved share",
        )
    out = {
        "command": "python launch/compare_convergence.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "variants": table,
        "curves": {k: v for k, v in curves.items()},
        "held_out_curves": eval_curves,
    }
    (args.out / "convergence.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out / 'reward_vs_samples.png'} and {args.out / 'convergence.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
