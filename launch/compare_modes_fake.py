"""The five rollout modes side by side on the fake backend, one long-tailed workload.

    python launch/compare_modes_fake.py [--steps 16] [--seed 0] [--k 2] [--timeline]

Every mode runs the same prompts and response lengths (a function of the seed and request id)
for the same number of train steps; throughput is trajectories (and their tokens) consumed by
training per tick, until the last of those steps ends. No jax, no devices: logical time only.

An illustration of the modes' mechanics (versions, staleness, re-prefill, discards, migrations),
not a speed measurement: the throughput ranking follows the costs chosen below (prefill rate,
weight-transfer and migration ticks). The simulator (``launch/simulate.py``) compares the modes'
throughput on a cost model of real hardware.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.config.schema import OrchestratorConfig  # noqa: E402
from dora_jax.orchestrator import MODES, FakeBackendConfig, run_fake  # noqa: E402

# A long-context (agentic, multi-turn) workload: contexts of 2-8k tokens at admission, responses
# with median 256 tokens and p99 12x the median (capped at 4096); 8 groups of 8 slots; G = 8.
WORKLOAD = dict(
    num_groups=8,
    max_slots=8,
    max_prompt_len=8192,
    max_new_tokens=4096,
    length_median=256.0,
    length_p99_ratio=12.0,
    prefill_tokens_per_tick=512,
    weight_transfer_ticks=50,
    migrate_ticks=1,
)
PROMPT_LEN = (2048, 8192)
GROUP_SIZE = 8


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="train steps per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=2, help="staleness bound K (partial, dora)")
    p.add_argument("--tbs", type=int, default=16, help="train batch, prompt groups")
    p.add_argument("--rbs", type=int, default=32, help="rollout batch, prompt groups")
    p.add_argument("--train-ticks", type=int, default=50, help="ticks per train step")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--timeline", action="store_true", help="print dora's first 8000 ticks")
    args = p.parse_args(argv)

    backend = FakeBackendConfig(seed=args.seed, **WORKLOAD)
    print(
        f"fake backend: {backend.num_groups} groups x {backend.max_slots} slots, G={GROUP_SIZE}, "
        f"TBS={args.tbs}, RBS={args.rbs}, K={args.k}, response median "
        f"{backend.length_median:.0f} p99/median {backend.length_p99_ratio:.0f}, prompts "
        f"{PROMPT_LEN[0]}-{PROMPT_LEN[1]}, prefill {backend.prefill_tokens_per_tick} tok/tick, "
        f"weight transfer {backend.weight_transfer_ticks} ticks, train step {args.train_ticks} "
        f"ticks, {args.steps} steps"
    )
    head = (
        f"{'mode':<11}{'ticks':>7}{'traj/tick':>10}{'tok/tick':>9}{'vs sync':>8}{'bubble':>7}"
        f"{'util':>6}{'stale':>6}{'max':>4}{'reprefill':>10}{'discard':>8}{'migr':>6}"
        f"{'wxfer':>6}{'plans':>6}{'plan ms':>8}{'wall s':>7}"
    )
    print(head)
    print("-" * len(head))
    base = None
    results = {}
    for mode in args.modes.split(","):
        cfg = OrchestratorConfig(
            mode=mode,
            staleness_k=args.k,
            train_batch_prompts=args.tbs,
            rollout_batch_prompts=args.rbs,
            plan_period_ticks=16,
        )
        t0 = time.perf_counter()
        run = run_fake(
            cfg,
            GROUP_SIZE,
            backend,
            num_steps=args.steps,
            step_ticks=args.train_ticks,
            prompt_len=PROMPT_LEN,
        )
        s = run.result.summary
        results[mode] = run
        base = s.traj_per_tick if mode == "sync" else base
        rel = f"{s.traj_per_tick / base:.2f}x" if base else "-"
        print(
            f"{mode:<11}{s.ticks:>7}{s.traj_per_tick:>10.4f}{s.tokens_per_tick:>9.1f}{rel:>8}"
            f"{s.bubble:>7.3f}{s.utilisation:>6.2f}{s.staleness_mean:>6.2f}{s.staleness_max:>4}"
            f"{s.reprefill_tokens:>10}{s.discarded:>8}{s.migrated:>6}{s.weight_transfers:>6}"
            f"{s.plans:>6}{s.plan_ms_mean:>8.3f}{time.perf_counter() - t0:>7.1f}"
        )
    print(
        "traj/tick: trajectories consumed by training per tick; bubble: idle group-ticks; "
        "util: sampled tokens / slot-ticks;\nstale: mean staleness of consumed trajectories "
        "(max: its maximum); reprefill: tokens prefilled again (partial);\ndiscard: requests "
        "aborted (oversample); migr: requests migrated with their KV; wxfer: weight transfers; "
        "plan ms: mean planning time."
    )
    if args.timeline and "dora" in results:
        print(
            "\ndora timeline (one char per 100 ticks: version digit decoding, ^ prefill, "
            "~ weight transfer, . idle):"
        )
        for line in results["dora"].result.records.timeline(every=100, end=8000):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
