"""Multi-turn (agentic) conversations at paper scale in the simulator: sync, partial and dora.

    python benchmarks/bench_sim_agentic.py [--config configs/sim/qwen32b_h800_64_agentic.yaml]
        [--plots-dir DIR] [--no-plots] [overrides ...]

Runs every (mode, placement) of the config on the same conversations (turns, model and
observation tokens, tool latencies: a pure function of the seed and the request) and prints:
the workload, the table of ``launch/simulate.py``, the step decomposition, the conversation
figures (model tokens per second, turns and environment seconds per trajectory, requests
waiting on their environment and the KV they hold, group time idle while they wait,
re-prefilled tokens, version span), and dora's throughput over each baseline. Writes
``benchmarks/results/sim_agentic.json`` and one timeline PNG per run (environment waits in
gold; default ``runs/sim/<name>/``). Throughput here is model tokens of the consumed
trajectories per modeled second (``tokens_per_s`` counts their observation tokens too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

from dora_jax.config.loading import to_dict  # noqa: E402
from dora_jax.config.schema import ConfigError  # noqa: E402
from dora_jax.sim import report  # noqa: E402
from dora_jax.sim.config import load_sim_config  # noqa: E402
from dora_jax.sim.conversations import Conversations, conversation_stats  # noqa: E402
from dora_jax.sim.run import resolve, simulate  # noqa: E402
from dora_jax.sim.workload import ResponseLengths  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sim_agentic.json"
CONFIG = ROOT / "configs" / "sim" / "qwen32b_h800_64_agentic.yaml"


def ratios(metrics) -> dict[str, dict[str, float]]:
    """dora (disaggregated) over each baseline: model tokens/s and all tokens/s."""
    by = {report._label(m): m for m in metrics}
    dora = by.get("dora/dis")
    if dora is None:
        return {}
    out = {}
    for name, m in by.items():
        if m is dora:
            continue
        out[f"dora_over_{name.replace('/', '_')}"] = {
            "model_tokens_per_s": dora.conversations.model_tokens_per_s
            / m.conversations.model_tokens_per_s,
            "tokens_per_s": dora.tokens_per_s / m.tokens_per_s,
            "step_time": m.step_s / dora.step_s,
        }
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--json", type=Path, default=OUT)
    p.add_argument("--plots-dir", type=Path)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10")
    quiet.add_arguments(p)
    args = p.parse_args(argv)
    load0 = quiet.wait_for_quiet(args.max_load, args.wait)
    try:
        cfg = resolve(load_sim_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.turns is None:
        print(f"config error: {args.config} has no turns section", file=sys.stderr)
        return 2
    c, o = cfg.cluster, cfg.orchestration
    conv = Conversations(cfg.turns, ResponseLengths(cfg.response, o.group_size, cfg.run.seed))
    stats = conversation_stats(conv, o.train_batch_prompts)
    t, lat = stats["turns"], cfg.turns.latency
    print(
        f"{cfg.name}: {cfg.model} on {c.total_gpus} x {c.hardware}; disaggregated "
        f"{c.trainer_gpus} train + {c.total_gpus - c.trainer_gpus} rollout (TP{c.rollout_tp}); "
        f"TBS {o.train_batch_prompts} x G {o.group_size}, RBS {o.rollout_batch_prompts}, "
        f"K {o.staleness_k}; turns median {t['median']:.0f} p99 {t['p99']:.0f} mean "
        f"{t['mean']:.1f}; response tokens median {stats['response_tokens']['median']:.0f} "
        f"p99 {stats['response_tokens']['p99']:.0f}; tools median {lat.median_s} s "
        f"p99/median {lat.p99_ratio}, environment s per trajectory median "
        f"{stats['env_s']['median']:.1f} p99 {stats['env_s']['p99']:.1f}; steps "
        f"{cfg.run.warmup_steps + 1}..{cfg.run.steps}"
    )
    runs = []
    for mode, placement in cfg.variants():
        t0 = time.perf_counter()
        runs.append(simulate(cfg, mode, placement))
        print(f"  ran {mode}/{placement}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    metrics = [r.metrics for r in runs]
    print()
    print(report.table(metrics))
    print()
    print("step time by what the GPUs did (seconds per step, share of the step):")
    print(report.decomposition(metrics))
    print()
    print("conversations (per consumed trajectory; waiting: requests waiting on their tools):")
    print(report.conversation_table(metrics))
    sp = ratios(metrics)
    print()
    for k, v in sp.items():
        print(
            f"{k:<28} model tokens/s {v['model_tokens_per_s']:.2f}x   tokens/s "
            f"{v['tokens_per_s']:.2f}x   step time {v['step_time']:.2f}x"
        )
    data = {
        "command": " ".join(["python benchmarks/bench_sim_agentic.py", *argv]),
        "units": "modeled seconds; model_tokens_per_s: model tokens of consumed trajectories per "
        "modeled second (the agentic throughput); tokens_per_s counts observation tokens too; "
        "*_frac: fractions of group-seconds; waiting_*: requests waiting on their environment "
        "(and the KV tokens they hold) over the span's ticks, cluster-wide; wall_s: host seconds",
        "config": to_dict(cfg),
        "workload": stats,
        "runs": [m.to_dict() for m in metrics],
        "dora_over": sp,
    }
    data.update({k: v for k, v in quiet.provenance(load0).items() if k != "command"})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"\nwrote {args.json}")
    if not args.no_plots:
        plots = args.plots_dir or ROOT / "runs" / "sim" / cfg.name
        for r in runs:
            tag = "co" if r.placement == "colocated" else "dis"
            report.timeline_png(r, plots / f"sim_timeline_{cfg.name}_{r.mode}_{tag}.png")
        print(f"wrote timelines to {plots}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
