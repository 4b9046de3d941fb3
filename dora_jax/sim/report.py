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
from dora_jax.report import plot_timeline
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
        f"{'tok/s':>8}{'bubble':>7}{'plan%':>7}{'wxfer%':>7}{'migr%':>7}{'reprf%':>7}"
        f"{'stale':>6}{'max':>4}{'discard':>8}{'migr':>7}{'plans':>6}"
    )
    lines = [head, "-" * len(head)]
    for m in metrics:
        lines.append(
            f"{_label(m):<15}{m.groups:>4}{m.step_s:>8.1f}{m.rollout_only_s:>12.1f}"
            f"{m.rollout_only_frac:>6.2f}{m.train_s:>8.1f}{m.tokens_per_s:>8.0f}{m.bubble:>7.3f}"
            f"{100 * m.plan_frac:>7.3f}{100 * m.weight_transfer_frac:>7.2f}"
            f"{100 * m.migration_frac:>7.2f}{100 * m.reprefill_frac:>7.2f}"
            f"{m.staleness_mean:>6.2f}{m.staleness_max:>4}{m.discarded:>8}{m.migrated:>7}"
            f"{m.plans:>6}"
        )
    return "\n".join(lines)


def conversation_table(metrics: list[SimMetrics]) -> str:
    """One row per run with conversations: model tokens per second, turns and environment
    seconds per trajectory, requests waiting on their environment and the KV they hold, the
    share of group time idle while they wait, re-prefilled tokens, version span."""
    head = (
        f"{'mode':<15}{'model tok/s':>12}{'turns':>7}{'p99':>6}{'env s':>7}{'p99':>7}"
        f"{'waiting':>9}{'max':>7}{'wait KV Mtok':>13}{'max':>7}{'KV%':>6}{'envidle':>8}"
        f"{'reprefill':>11}{'span':>5}"
    )
    lines = [head, "-" * len(head)]
    for m in metrics:
        c = m.conversations
        if c is None:
            continue
        lines.append(
            f"{_label(m):<15}{c.model_tokens_per_s:>12.0f}{c.turns_mean:>7.2f}{c.turns_p99:>6.0f}"
            f"{c.env_s_mean:>7.1f}{c.env_s_p99:>7.1f}{c.waiting_mean:>9.1f}{c.waiting_max:>7}"
            f"{c.waiting_kv_tokens_mean / 1e6:>13.2f}{c.waiting_kv_tokens_max / 1e6:>7.2f}"
            f"{100 * c.waiting_kv_frac_mean:>6.1f}{c.env_wait_frac:>8.3f}"
            f"{c.reprefill_tokens:>11}{m.max_version_span:>5}"
        )
    return "\n".join(lines)


DECOMPOSITION = (
    ("gpu_rollout_full_s", "full batch"),
    ("gpu_rollout_tail_s", "tail"),
    ("gpu_reprefill_s", "re-prefill"),
    ("gpu_train_s", "train"),
    ("gpu_moves_s", "moves"),
    ("gpu_idle_s", "idle"),
)


def decomposition(metrics: list[SimMetrics]) -> str:
    """Each mode's step time split by what its GPUs did (GPU-seconds per step over the cluster's
    GPUs; the parts add up to the step): rollout while requests wait for a slot (full batch),
    rollout while nothing waits (the tail), re-prefill, training, weight and KV moves, idle."""
    head = f"{'mode':<15}{'step s':>8}" + "".join(f"{name:>12}" for _, name in DECOMPOSITION)
    lines = [head, "-" * len(head)]
    for m in metrics:
        parts = [getattr(m, k) for k, _ in DECOMPOSITION]
        cells = "".join(f"{x:>7.1f} {100 * x / m.step_s:>3.0f}%" for x in parts)
        lines.append(f"{_label(m):<15}{m.step_s:>8.1f}{cells}")
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


# The placement of the baseline each paper figure compares DORA to. The paper (sec. 4.1) runs
# "partial rollout in the colocated model placement"; it names no placement for synchronous
# training, and presents DORA disaggregated: we read its sync as sharing DORA's split.
_ROWS = (
    ("throughput", "sync", "throughput", "throughput_speedup_vs_sync"),
    ("step time", "sync", "step_time", "step_time_speedup_vs_sync"),
    ("rollout-only time", "sync", "rollout_only", "rollout_only_speedup"),
    ("throughput", "partial", "throughput", "throughput_speedup_vs_partial"),
    ("step time", "partial", "step_time", "step_speedup_vs_partial"),
)
PAPER_PLACEMENT = {"sync": "dis", "partial": "co"}


def paper_comparison(metrics: list[SimMetrics], paper: dict | None) -> str:
    """DORA's speedups over each baseline in both placements, colocated ``sync`` (what veRL
    users run) first, beside the paper's figure and the placement of the paper's baseline."""
    by = {_label(m): m for m in metrics}
    sp = speedups(metrics)
    dora = by.get("dora/dis")
    if dora is None:
        return "(no dora run: no comparison)"
    p = (paper or {}).get("figures") or {}
    head = (
        f"{'DORA (disaggregated) vs':<34}{'colocated':>10}{'disaggr.':>10}{'paper':>8}"
        "  (the paper's baseline)"
    )
    lines = [head, "-" * 84]
    for name, base, key, pkey in _ROWS:
        cells = [sp.get(f"{base}/{pl}", {}).get(key) for pl in ("co", "dis")]
        pv = p.get(pkey)
        where = "disaggregated, as DORA" if PAPER_PLACEMENT[base] == "dis" else "colocated"
        note = f"  ({base} {where})" if pv is not None else ""
        lines.append(
            f"{name + ' vs ' + base:<34}"
            + "".join(f"{(_fmt(c) + 'x') if c is not None else '-':>10}" for c in cells)
            + f"{_fmt(pv):>8}{note}"
        )
    s_ro = [f"{by[k].rollout_only_frac:.2f} ({k})" for k in ("sync/co", "sync/dis") if k in by]
    ov = (paper or {}).get("overheads") or {}
    lb, rt = ov.get("load_balancing"), ov.get("request_transfer")
    moves = 100 * (dora.plan_frac + dora.weight_transfer_frac)
    for name, ours, theirs, spec in (  # our figure (formatted unless a str), the paper's
        ("sync rollout-only fraction", ", ".join(s_ro), p.get("sync_rollout_only_fraction"), ".2f"),
        (
            "dora rollout-only fraction",
            dora.rollout_only_frac,
            p.get("dora_rollout_only_fraction"),
            ".2f",
        ),
        ("dora tokens/s", dora.tokens_per_s, p.get("dora_throughput_tokens_per_s"), ".0f"),
        ("dora plan + weight moves %", moves, lb and 100 * lb, ".3f"),
        ("dora request transfer %", 100 * dora.migration_frac, rt and 100 * rt, ".3f"),
    ):
        ours = ours if isinstance(ours, str) else format(ours, spec)
        lines.append(f"{name:<34}{ours:<28}{_fmt(theirs, spec):>6}")
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


# dora with one planner feature switched off at a time (overrides of the sim config)
ABLATIONS = (
    ("planner v2", []),
    ("- consolidation", ["orchestration.planner.consolidate=false"]),
    ("- KV-aware moves", ["orchestration.planner.kv_aware=false"]),
    ("- spread of the gate", ["orchestration.planner.spread=false"]),
    ("- trigger hysteresis", ["orchestration.plan_hysteresis=false"]),
    ("- idle trigger", ["orchestration.plan_on_idle=false"]),
    ("legacy fill at oldest+1 (v1)", ["orchestration.planner.legacy_fill_margin=1"]),
    ("- legacy fill", ["orchestration.legacy_fill=false"]),
    (
        "every v2 feature off",
        [
            "orchestration.planner.consolidate=false",
            "orchestration.planner.kv_aware=false",
            "orchestration.planner.spread=false",
            "orchestration.plan_hysteresis=false",
            "orchestration.planner.legacy_fill_margin=1",
        ],
    ),
)


def ablation(cfg, baselines: list[SimMetrics]) -> list[dict]:
    """Run ``dora`` once per row of :data:`ABLATIONS` (the rest of ``cfg`` unchanged) and give
    its figures and its throughput over each baseline run in ``baselines``."""
    from dora_jax.config.loading import apply_overrides, from_dict
    from dora_jax.sim.run import simulate

    base = {_label(m): m.tokens_per_s for m in baselines if m.mode != "dora"}
    rows = []
    for name, overrides in ABLATIONS:
        c = from_dict(type(cfg), apply_overrides(to_dict(cfg), overrides, type(cfg)))
        m = simulate(c, "dora").metrics
        rows.append(
            {
                "variant": name,
                "overrides": overrides,
                "tokens_per_s": m.tokens_per_s,
                "bubble": m.bubble,
                "rollout_only_frac": m.rollout_only_frac,
                "staleness_mean": m.staleness_mean,
                "plans": m.plans,
                "migrated": m.migrated,
                "weight_transfers": m.weight_transfers,
                "vs": {k: m.tokens_per_s / v for k, v in base.items() if v},
            }
        )
    return rows


def ablation_table(rows: list[dict]) -> str:
    """The ablation rows: dora's throughput without each feature, and over each baseline."""
    keys = [k for k in ("sync/co", "sync/dis", "partial/co", "partial/dis") if k in rows[0]["vs"]]
    head = (
        f"{'dora planner':<30}{'tok/s':>8}{'vs v2':>7}{'bubble':>7}{'ro':>6}{'stale':>6}"
        f"{'plans':>6}{'migr':>7}{'wxfer':>6}" + "".join(f"{'/' + k:>13}" for k in keys)
    )
    lines = [head, "-" * len(head)]
    full = rows[0]["tokens_per_s"]
    for r in rows:
        lines.append(
            f"{r['variant']:<30}{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / full:>7.3f}"
            f"{r['bubble']:>7.3f}{r['rollout_only_frac']:>6.2f}{r['staleness_mean']:>6.2f}"
            f"{r['plans']:>6}{r['migrated']:>7}{r['weight_transfers']:>6}"
            + "".join(f"{r['vs'][k]:>12.2f}x" for k in keys)
        )
    return "\n".join(lines)


def write_json(
    path: Path,
    cfg,
    runs: list[SimRun],
    workload: dict,
    paper: dict | None,
    note: str,
    command: str,
    ablation: list[dict] | None = None,
) -> None:
    metrics = [r.metrics for r in runs]
    data = {
        "command": command,
        "units": "modeled seconds (step_s, rollout_only_s, train_s, gpu_*_s: GPU-seconds per "
        "step over the cluster's GPUs, adding up to step_s), response tokens consumed by "
        "training per modeled second (tokens_per_s), fractions of group-seconds (bubble, "
        "*_frac) except plan_frac (planner wall time / modeled span); wall_s: host seconds",
        "config": to_dict(cfg),
        "cost_model": cost_summary(cfg),
        "workload": workload,
        "runs": [m.to_dict() for m in metrics],
        "speedups_of_dora": speedups(metrics),
        "paper": paper,
        "paper_note": note,
        "paper_baseline_placement": {
            base: "disaggregated (as DORA)" if pl == "dis" else "colocated"
            for base, pl in PAPER_PLACEMENT.items()
        },
        "ablation": ablation,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")


def timeline_png(run: SimRun, path: Path) -> Path:
    """Groups x modeled time over ``timeline_steps`` train steps after the warm-up, drawn by
    :func:`dora_jax.report.plot_timeline` (the real runs' timeline; groups whose devices a
    colocated trainer holds are light, holding requests), x in modeled seconds; with
    conversations, each group's share of a tick spent waiting on their environments in gold."""
    cfg, rec = run.cfg, run.result.records
    w, k = cfg.run.warmup_steps, cfg.run.timeline_steps
    t0 = rec.steps[w - 1].end if w else 0
    done = min(len(rec.steps), cfg.run.steps)  # the last record may be a step still running
    t1 = rec.steps[min(w + max(k, 1), done) - 1].end
    m = run.metrics
    title = f"{cfg.name}: {m.mode} ({m.placement}), {m.groups} groups, modeled time"
    secs = [cfg.run.tick_s] * len(rec.groups)
    waits = None
    if run.backend.conversations is not None:
        waits = np.asarray(run.backend.waiting.env_wait_s[: len(rec.groups)]) / cfg.run.tick_s
        title += ", conversations"
    return plot_timeline(rec, path, title=title, tick_seconds=secs, span=(t0, t1), waits=waits)
