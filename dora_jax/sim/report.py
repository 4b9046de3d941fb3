"""The simulator's outputs: the comparison table (ours beside the paper's), JSON, timeline plots.

The paper's figures are read from ``paper_figures.yaml`` beside this module (each figure with
the section and figure of the paper it comes from).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from dora_jax.config.loading import to_dict
from dora_jax.sim.run import SimMetrics, SimRun, cost_model

PAPER_FIGURES = Path(__file__).resolve().with_name("paper_figures.yaml")


def _values(node: dict) -> tuple[dict, dict]:
    """``{name: value}`` and ``{name: source}`` of a mapping of ``{value, source}`` figures."""
    values = {k: v["value"] if isinstance(v, dict) else v for k, v in node.items()}
    sources = {k: v["source"] for k, v in node.items() if isinstance(v, dict) and "source" in v}
    return values, sources


def load_paper(key: str | None, path: Path = PAPER_FIGURES) -> tuple[dict | None, str]:
    """The paper's figures under the dotted ``key`` (e.g. ``dense_32b.gpus_64``), the overheads
    of that cluster size and the sources of both, and a note."""
    if key is None:
        return None, "no paper_key in the config: ours only"
    if not path.is_file():
        return None, f"paper figures file {path} is missing: ours only"
    full = yaml.safe_load(path.read_text())
    node = full
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None, f"{key!r} not found in {path}: ours only"
        node = node[part]
    figures, sources = _values(node)
    ov, ov_sources = _values(
        full.get(key.split(".")[0], {}).get("overheads_fraction_of_total_time") or {}
    )
    idx = {"gpus_64": 0, "gpus_128": 1}.get(key.split(".")[-1])
    extra = {k: v[idx] for k, v in ov.items() if idx is not None and isinstance(v, list)}
    sources.update({f"overheads.{k}": ov_sources[k] for k in extra if k in ov_sources})
    return {"figures": figures, "overheads": extra, "sources": sources}, f"paper: {path.name}"


def _label(m: SimMetrics) -> str:
    return f"{m.mode}/{'co' if m.placement == 'colocated' else 'dis'}"


def table(metrics: list[SimMetrics]) -> str:
    """One row per (mode, placement), figures in modeled seconds (see ``run.py``)."""
    head = (
        f"{'mode':<15}{'grp':>4}{'step s':>8}{'roll-only s':>12}{'frac':>6}{'train s':>8}"
        f"{'tok/s':>8}{'bubble':>7}{'plan%':>7}{'kvxfer%':>8}{'wgt%':>6}{'reprf%':>7}"
        f"{'stale':>6}{'max':>4}{'discard':>8}{'migr':>7}"
    )
    lines = [head, "-" * len(head)]
    for m in metrics:
        lines.append(
            f"{_label(m):<15}{m.groups:>4}{m.step_s:>8.1f}{m.rollout_only_s:>12.1f}"
            f"{m.rollout_only_frac:>6.2f}{m.train_s:>8.1f}{m.tokens_per_s:>8.0f}{m.bubble:>7.3f}"
            f"{100 * m.plan_frac:>7.3f}{100 * m.transfer_frac:>8.2f}{100 * m.weight_frac:>6.2f}"
            f"{100 * m.reprefill_frac:>7.2f}{m.staleness_mean:>6.2f}{m.staleness_max:>4}"
            f"{m.discarded:>8}{m.migrated:>7}"
        )
    return "\n".join(lines)


def speedups(metrics: list[SimMetrics]) -> dict[str, dict[str, float]]:
    """DORA against each baseline run: rollout-only time, step time and throughput ratios."""
    by = {_label(m): m for m in metrics}
    dora = by.get("dora/dis")
    if dora is None:
        return {}
    out = {}
    for name, m in by.items():
        if m is dora:
            continue
        out[name] = {
            "rollout_only": m.rollout_only_s / dora.rollout_only_s
            if dora.rollout_only_s
            else math.inf,
            "step_time": m.step_s / dora.step_s,
            "throughput": dora.tokens_per_s / m.tokens_per_s if m.tokens_per_s else math.inf,
        }
    return out


def _fmt(x: float | None, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    return "inf" if isinstance(x, float) and math.isinf(x) else format(x, spec)


def paper_comparison(metrics: list[SimMetrics], paper: dict | None) -> str:
    """DORA's speedups and fractions, ours beside the paper's (when given)."""
    by = {_label(m): m for m in metrics}
    sp = speedups(metrics)
    dora = by.get("dora/dis")
    if dora is None:
        return "(no dora run: no comparison)"
    p = (paper or {}).get("figures") or {}
    sync = [k for k in ("sync/dis", "sync/co") if k in sp]
    part = [k for k in ("partial/co", "partial/dis") if k in sp]
    rows = [
        (
            "rollout-only speedup vs sync",
            [sp[k]["rollout_only"] for k in sync],
            sync,
            p.get("rollout_only_speedup"),
        ),
        (
            "throughput speedup vs sync",
            [sp[k]["throughput"] for k in sync],
            sync,
            p.get("throughput_speedup_vs_sync"),
        ),
        (
            "step-time speedup vs sync",
            [sp[k]["step_time"] for k in sync],
            sync,
            p.get("step_time_speedup_vs_sync"),
        ),
        (
            "throughput speedup vs partial",
            [sp[k]["throughput"] for k in part],
            part,
            p.get("throughput_speedup_vs_partial"),
        ),
        (
            "step-time speedup vs partial",
            [sp[k]["step_time"] for k in part],
            part,
            p.get("step_speedup_vs_partial"),
        ),
    ]
    lines = [f"{'DORA vs baselines':<32}{'ours':<44}{'paper':>8}", "-" * 84]
    for name, vals, keys, pv in rows:
        ours = ", ".join(f"{_fmt(v)}x ({k})" for v, k in zip(vals, keys, strict=True)) or "-"
        lines.append(f"{name:<32}{ours:<44}{_fmt(pv):>8}")
    s_ro = [f"{by[k].rollout_only_frac:.2f} ({k})" for k in ("sync/dis", "sync/co") if k in by]
    lines.append(
        f"{'sync rollout-only fraction':<32}{', '.join(s_ro):<44}"
        f"{_fmt(p.get('sync_rollout_only_fraction')):>8}"
    )
    lines.append(
        f"{'dora rollout-only fraction':<32}{dora.rollout_only_frac:<44.2f}"
        f"{_fmt(p.get('dora_rollout_only_fraction')):>8}"
    )
    lines.append(
        f"{'dora tokens/s':<32}{dora.tokens_per_s:<44.0f}"
        f"{_fmt(p.get('dora_throughput_tokens_per_s'), '.0f'):>8}"
    )
    ov = (paper or {}).get("overheads") or {}
    lb, rt = ov.get("load_balancing"), ov.get("request_transfer")
    lines.append(
        f"{'dora plan + weight moves %':<32}"
        f"{100 * (dora.plan_frac + dora.weight_frac):<44.3f}{_fmt(lb and 100 * lb, '.3f'):>8}"
    )
    lines.append(
        f"{'dora request transfer %':<32}{100 * dora.transfer_frac:<44.3f}"
        f"{_fmt(rt and 100 * rt, '.3f'):>8}"
    )
    return "\n".join(lines)


def cost_summary(cfg) -> dict:
    """Key numbers of the cost model for this config (for the JSON and the header)."""
    cm = cost_model(cfg)
    n = np.array([1, 64, 256])
    return {
        "kv_capacity_tokens_per_group": cm.kv_capacity_tokens,
        "decode_step_ms": {int(k): float(cm.decode_step_s(k, k * 3000)) * 1e3 for k in n},
        "weight_transfer_s": cm.weight_transfer_s(),
        "kv_transfer_s_per_10k_tokens": cm.kv_transfer_s(10_000),
        "prefill_s_per_8k_tokens": float(cm.prefill_s(8192, 8192 * 8192 / 2)),
    }


def write_json(
    path: Path, cfg, runs: list[SimRun], workload: dict, paper: dict | None, note: str, command: str
) -> None:
    metrics = [r.metrics for r in runs]
    data = {
        "command": command,
        "units": "modeled seconds (step_s, rollout_only_s, train_s), response tokens consumed by "
        "training per modeled second (tokens_per_s), fractions of group-seconds (bubble, "
        "*_frac) except plan_frac (planner wall time / modeled span); wall_s: host seconds",
        "config": to_dict(cfg),
        "cost_model": cost_summary(cfg),
        "workload": workload,
        "runs": [m.to_dict() for m in metrics],
        "speedups_of_dora": speedups(metrics),
        "paper": paper,
        "paper_note": note,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")


def timeline_png(run: SimRun, path: Path, max_cols: int = 1600) -> None:
    """Groups x modeled time, coloured by the version each group holds (decode or prefill);
    white idle, black weight transfer, grey training (colocated). A top strip shows when the
    trainer runs; dashed lines mark the ends of train steps. Shows ``timeline_steps`` steps
    after the warm-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cfg, rec = run.cfg, run.result.records
    w, k = cfg.run.warmup_steps, cfg.run.timeline_steps
    t0 = rec.steps[w - 1].end if w else 0
    done = min(len(rec.steps), cfg.run.steps)  # the last record may be a step still running
    t1 = rec.steps[min(w + max(k, 1), done) - 1].end
    every = max(1, math.ceil((t1 - t0) / max_cols))
    ticks = range(t0, t1, every)
    G = rec.num_groups
    img = np.full((G + 2, len(ticks)), -1, dtype=np.int64)  # -1 idle
    frozen = np.zeros(len(rec.groups), bool)
    if run.placement == "colocated":
        for s in run.trainer.steps:
            frozen[s.tick : s.tick + s.ticks] = True
    for j, t in enumerate(ticks):
        for g in rec.groups[t]:
            if frozen[t]:
                img[g.group + 2, j] = -3
            elif g.activity == "transfer":
                img[g.group + 2, j] = -2
            elif g.activity in ("decode", "prefill"):
                img[g.group + 2, j] = g.version % 10
        img[0, j] = -4 if rec.cluster[t].training else -1
    palette = list(plt.get_cmap("tab10").colors)
    palette[7] = "#ffd92f"  # gold: tab10's grey would read as "training"
    cmap = ListedColormap(["#2d2d2d", "#b0b0b0", "black", "white", *palette])
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.28 * G))
    x0, x1 = t0 * cfg.run.tick_s / 60, t1 * cfg.run.tick_s / 60
    ax.imshow(
        img + 4,
        aspect="auto",
        cmap=cmap,
        vmin=0,
        vmax=13,
        interpolation="nearest",
        extent=(x0, x1, G + 1.5, -0.5),
    )
    for s in rec.steps:
        if t0 < s.end <= t1:
            ax.axvline(s.end * cfg.run.tick_s / 60, color="red", lw=0.6, ls="--")
    ax.set_yticks(
        [0] + list(range(2, G + 2)), ["trainer"] + [f"g{g}" for g in range(G)], fontsize=6
    )
    ax.set_xlabel("modeled time (minutes)")
    m = run.metrics
    ax.set_title(
        f"{cfg.name}: {m.mode} ({m.placement}), {m.groups} groups; colour = version mod "
        f"10, white idle, black weight transfer, grey training; red: step ends",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
