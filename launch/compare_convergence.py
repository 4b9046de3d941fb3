"""Convergence side by side: `sync`, `dora` K=1 and `dora` K=3 on the default task, same
seed, same warm start; mean training reward and held-out solved share (the experiment's
evaluator: the same problems and sampling keys for every variant) against consumed samples,
plotted and tabulated. With ``--seeds N`` every variant runs with N seeds (the config's seed,
seed + 1, ...; each seed has its own warm start, model init, prompts and held-out problems,
shared by the variants), and the plots show each seed's curve and the mean over seeds with a
band of one standard error.

    python launch/compare_convergence.py [--steps N] [--seeds N] [--out DIR] [key=value ...]

Writes ``OUT/reward_vs_samples.png``, ``OUT/held_out_vs_samples.png``, ``OUT/convergence.json``
(with the command that made it) and one run directory per variant and seed (each with its own
summary and timeline).
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
from dora_jax.curves import seed_band_plot  # noqa: E402
from dora_jax.metrics import binomial_se  # noqa: E402
from dora_jax.pipeline.experiment import build, run  # noqa: E402

VARIANTS = {
    "sync": ["orchestrator.mode=sync", "orchestrator.staleness_k=0"],
    "dora K=1": ["orchestrator.mode=dora", "orchestrator.staleness_k=1"],
    "dora K=3": ["orchestrator.mode=dora", "orchestrator.staleness_k=3"],
}


def run_variant(name: str, extra: list[str], seed: int, args) -> tuple[dict, list, list]:
    """One variant with one seed: its table row, reward curve and held-out curve."""
    slug = name.replace(" ", "_").replace("=", "") + f"_seed{seed}"
    cfg = load_config(
        "configs/default.yaml",
        [*args.overrides, *extra, f"seed={seed}", f"run_dir={args.out / slug}"],
    )
    exp = build(cfg, args.out / slug, warm_start_dir=args.out / f"warm_start_seed{seed}")
    points: list[tuple[int, float]] = []
    ev = exp.evaluator
    held_out = [(0, exp.evaluate(0).solved)] if ev else []
    seen = 0

    def on_step(log):
        nonlocal seen
        seen += len(log.rewards)
        points.append((seen, float(np.mean(log.rewards))))
        if ev and (log.version % exp.cfg.eval.every_steps == 0 or log.version == args.steps):
            held_out.append((seen, exp.evaluate(log.version).solved))

    result = run(exp, args.steps, on_step)
    r = np.array([p[1] for p in points])
    w = args.window
    n_eval = len(ev.prompts) if ev else 0
    row = {
        "seed": seed,
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
    print(
        f"{name:9s} seed {seed}: reward {row['first_window_reward']:.3f} -> "
        f"{row['last_window_reward']:.3f} (+- {row['reward_sem_last_window']:.3f}), {seen} "
        f"samples, {result.summary.ticks} ticks, {exp.wall_s:.0f} s"
        + (f"; held-out solved {held_out[0][1]:.3f} -> {held_out[-1][1]:.3f}" if held_out else ""),
        flush=True,
    )
    return row, points, held_out


def smooth(points: list[tuple[int, float]], w: int) -> list[tuple[int, float]]:
    """Trailing mean over ``w`` steps (fewer at the start)."""
    ys = np.array([y for _, y in points])
    c = np.concatenate([[0.0], np.cumsum(ys)])
    n = np.minimum(np.arange(1, len(ys) + 1), w)
    means = (c[1:] - c[np.arange(1, len(ys) + 1) - n]) / n
    return [(x, float(m)) for (x, _), m in zip(points, means, strict=True)]


def spread(values: list[float]) -> dict:
    """Mean over seeds and its standard error (None with one seed)."""
    v = np.array(values, float)
    se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
    return {"mean": float(v.mean()), "se": se, "per_seed": [float(x) for x in v]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per variant")
    ap.add_argument("--out", type=Path, default=Path("runs/convergence"))
    ap.add_argument("--window", type=int, default=10, help="steps per smoothing window")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    base_seed = load_config("configs/default.yaml", args.overrides).seed
    seeds = [base_seed + i for i in range(args.seeds)]
    rows: dict[str, list[dict]] = {}
    curves: dict[str, dict[int, list]] = {}
    eval_curves: dict[str, dict[int, list]] = {}
    for seed in seeds:  # seed-major: each warm start is built once and used by every variant
        for name, extra in VARIANTS.items():
            row, points, held_out = run_variant(name, extra, seed, args)
            rows.setdefault(name, []).append(row)
            curves.setdefault(name, {})[seed] = points
            if held_out:
                eval_curves.setdefault(name, {})[seed] = held_out
    table = {}
    for name, rs in rows.items():
        table[name] = {
            "per_seed": rs,
            "held_out_solved_end": spread([r["held_out_solved"][-1] for r in rs])
            if rs[0]["held_out_solved"]
            else None,
            "held_out_solved_start": spread([r["held_out_solved"][0] for r in rs])
            if rs[0]["held_out_solved"]
            else None,
            "last_window_reward": spread([r["last_window_reward"] for r in rs]),
            "ticks": spread([r["ticks"] for r in rs]),
        }
        t = table[name]
        end = t["held_out_solved_end"]
        print(
            f"{name:9s} over {len(rs)} seed(s): last-window reward "
            f"{t['last_window_reward']['mean']:.3f}"
            + (f", held-out solved at the end {end['mean']:.3f}" if end else "")
            + (f" (+- {end['se']:.3f} over seeds)" if end and end["se"] is not None else "")
            + f", {t['ticks']['mean']:.0f} ticks",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    w = args.window
    seed_band_plot(
        {k: [smooth(c, w) for c in v.values()] for k, v in curves.items()},
        args.out / "reward_vs_samples.png",
        ylabel=f"training reward (mean of the last {w} steps)",
    )
    if eval_curves:
        seed_band_plot(
            {k: list(v.values()) for k, v in eval_curves.items()},
            args.out / "held_out_vs_samples.png",
            ylabel="held-out solved share",
        )
    out = {
        "command": "python launch/compare_convergence.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "seeds": seeds,
        "variants": table,
        "curves": {k: {str(s): c for s, c in v.items()} for k, v in curves.items()},
        "held_out_curves": {k: {str(s): c for s, c in v.items()} for k, v in eval_curves.items()},
    }
    (args.out / "convergence.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out / 'reward_vs_samples.png'} and {args.out / 'convergence.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
