"""How many bytes of host state one train step adds, before and after the history files, for a
preset (default: the Qwen2.5-7B one), computed from the code's own record types.

    python benchmarks/host_state_estimate.py [--config configs/qwen2.5-7b-8gpu.yaml]
        [--response-mean 2048] [--prompt-mean 256] [--occupancy 0.5]

It builds one step's worth of the records a run used to keep for ever, at the preset's shapes
(TBS x G trajectories with ``--response-mean`` sampled tokens and logprobs each, their step log,
their consumed records, and the wall clock's spans: one per engine step of each group, an engine
step sampling ``max_slots x decode_steps x --occupancy`` tokens), and measures

- their Python size in memory (a deep ``sys.getsizeof``: objects, containers, ints and floats);
- the bytes they added to every checkpoint (the checkpoint codec's JSON of the same objects);
- what the history files get instead (``consumed.jsonl`` lines and a ``records.jsonl`` flush).

Writes ``benchmarks/results/host_state_estimate.json``. The figures are per train step; a run
of ``n`` steps held ``n`` times as much, and wrote it into every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "host_state_estimate.json"


def deep_size(obj, seen=None) -> int:
    """Bytes of ``obj`` and everything it references (each object once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set | frozenset):
        size += sum(deep_size(x, seen) for x in obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        size += sum(deep_size(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen2.5-7b-8gpu.yaml"))
    ap.add_argument("--response-mean", type=int, default=2048)
    ap.add_argument("--prompt-mean", type=int, default=256)
    ap.add_argument("--occupancy", type=float, default=0.5)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]

    from dora_jax import state_codec
    from dora_jax.config import load_config
    from dora_jax.execution.payloads import Completion, PromptPayload
    from dora_jax.orchestrator.backend import GroupTick
    from dora_jax.orchestrator.records import ClusterTick, Records
    from dora_jax.orchestrator.transfer_queue import ConsumedRecord
    from dora_jax.pipeline.grpo import StepLog

    cfg = load_config(Path(args.config), ["model.hf_path=null"])
    o, r, m = cfg.orchestrator, cfg.rollout, cfg.model
    n = o.train_batch_prompts * cfg.train.group_size
    rng = random.Random(0)
    vocab = m.vocab_size

    def completion(rid: int) -> Completion:
        prompt = PromptPayload(
            rid // 8, tuple(rng.randrange(vocab) for _ in range(args.prompt_mean)), "42"
        )
        toks = tuple(rng.randrange(vocab) for _ in range(args.response_mean))
        lps = tuple(-rng.random() * 3 for _ in range(args.response_mean))
        return Completion(prompt, toks, lps, "stop", args.prompt_mean, 0)

    consumed = [(rid, 7, completion(rid)) for rid in range(n)]
    metrics = {
        k: 0.5
        for k in (
            "loss",
            "kl",
            "entropy",
            "grad_norm",
            "clip_frac",
            "lr",
            "response_len_mean",
            "num_tokens",
            "staleness_mean",
            "skipped",
        )
    }
    step_log = StepLog(8, metrics, [1.0] * n, list(range(n)), {})
    records = [
        ConsumedRecord(
            rid, rid // 8, 7, 8, 1, args.response_mean, 1, 1000.0 + rid, args.prompt_mean
        )
        for rid in range(n)
    ]
    groups = cfg.mesh.rollout.groups
    tokens_per_engine_step = max(1.0, r.max_slots * r.decode_steps * args.occupancy)
    spans_n = int(n * args.response_mean / tokens_per_engine_step)
    spans = [
        GroupTick(
            i % groups,
            7,
            "decode",
            r.max_slots // 2,
            int(tokens_per_engine_step),
            0,
            0,
            0.05,
            1000.0 + i * 0.01,
            1000.05 + i * 0.01,
        )
        for i in range(spans_n)
    ]
    rounds = [
        ClusterTick(i, 10, 64, 3, True, 8, 3, 1000.0 + i * 0.04) for i in range(spans_n // groups)
    ]

    mem_consumed = deep_size(consumed)
    mem_log = deep_size(step_log)
    mem_records = deep_size(records) + deep_size(spans) + deep_size(rounds)
    ck_consumed = len(state_codec.dumps(consumed)[0])
    ck_log = len(
        state_codec.dumps(
            [
                (
                    step_log.version,
                    step_log.metrics,
                    step_log.rewards,
                    step_log.trajectories,
                    step_log.reward_metrics,
                )
            ]
        )[0]
    )
    ck_records = len(state_codec.dumps({"consumed": records, "spans": spans, "cluster": rounds})[0])
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # one flush of the real history files
        rec = Records("dora", groups, r.max_slots, clock="wall")
        rec.attach(d)
        rec.spans.extend(spans)
        rec.cluster.extend(rounds)
        rec.consumed.extend(records)
        rec.flush()
        offsets = rec.history_offsets
    before_mem = mem_consumed + mem_log + mem_records
    before_ck = ck_consumed + ck_log + ck_records
    out = {
        "preset": quiet.rel(args.config),
        "trajectories_per_step": n,
        "response_tokens_mean": args.response_mean,
        "prompt_tokens_mean": args.prompt_mean,
        "spans_per_step": spans_n,
        "control_rounds_per_step": len(rounds),
        "before": {
            "memory_bytes_per_step": before_mem,
            "memory_parts": {
                "GRPOTrainer.consumed": mem_consumed,
                "GRPOTrainer.log": mem_log,
                "Records (consumed, spans, rounds)": mem_records,
            },
            "checkpoint_bytes_per_step": before_ck,
            "checkpoint_parts": {
                "grpo_consumed": ck_consumed,
                "grpo_log": ck_log,
                "records": ck_records,
            },
        },
        "after": {
            "memory_bytes_per_step": 0,
            "checkpoint_bytes_per_step": 0,
            "history_file_bytes_per_step": {
                "records.jsonl": offsets[0],
                "consumed.jsonl": offsets[1],
            },
        },
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before": load0,
        "load_average_after": os.getloadavg()[0],
        "command": "python benchmarks/host_state_estimate.py " + " ".join(sys.argv[1:]),
    }
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    mib = 2**20
    print(
        f"{quiet.rel(args.config)}: {n} trajectories per step, {args.response_mean} response "
        "tokens each"
    )
    print(
        f"before: +{before_mem / mib:.1f} MiB of host memory and +{before_ck / mib:.1f} MiB in "
        f"every checkpoint, per train step ({mem_consumed / mib:.1f} MiB of it the consumed "
        "completions)"
    )
    print(
        f"after: +0 in memory and in checkpoints; the history files grow by "
        f"{sum(offsets) / 1024:.0f} KiB per step"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
