"""Rollout benchmark, measured side by side in one run on this machine's CPU.

(a) Generated tokens/s of our engine (continuous batching over paged KV) vs Hugging Face
    ``transformers`` ``generate`` (static batches padded to the longest request) on the same tiny
    Qwen2 weights, the same prompts and the same long-tailed response lengths (p99/median >= 10).
    Greedy decoding without EOS, so both produce exactly the requested number of tokens.
(b) KV migration (pack -> copy to another device -> unpack) vs re-prefill of the same context on
    the destination, for contexts of 1k, 2k and 4k tokens.

Rounds alternate the contenders; ratios are of medians. Writes
``benchmarks/results/bench_rollout.json`` with units and the command.

    python launch/bench_rollout.py [--quick]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dora_jax.config import ModelConfig, RolloutConfig  # noqa: E402
from dora_jax.mesh import make_mesh  # noqa: E402
from dora_jax.model import init_params  # noqa: E402
from dora_jax.model.hf_checkpoint import load_hf_params, save_hf_checkpoint  # noqa: E402
from dora_jax.rollout import Engine, Request, request_key  # noqa: E402

MODEL = ModelConfig(
    family="qwen2",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
)


def long_tail_lengths(n: int, rng: np.random.Generator, median: int, cap: int) -> np.ndarray:
    """Lognormal response lengths at evenly spaced quantiles (so the sample has the intended
    shape even when small), sigma 1.2 (p99/median ~ 16), capped, in random order."""
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    lengths = np.clip(np.round(median * np.exp(1.2 * np.asarray(z))), 1, cap).astype(int)
    return rng.permutation(lengths)


def bench_engine(params, prompts, lengths, slots: int) -> float:
    rcfg = RolloutConfig(
        max_slots=slots,
        page_size=16,
        num_pages=1 + slots * 20,
        max_prompt_len=64,
        max_new_tokens=int(max(lengths)),
        prefill_chunk=64,
        temperature=0.0,
        batch_invariant=False,
        decode_steps=8,
    )
    engine = Engine(MODEL, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1, interpret=False)
    engine.load_params(params, 0)
    reqs = [
        Request(i, list(p), 0, request_key(0, i), int(n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    t0 = time.perf_counter()
    engine.submit(reqs)
    done = 0
    while engine.num_requests:
        done += sum(len(f.tokens) for f in engine.step().finished)
    elapsed = time.perf_counter() - t0
    assert done == int(sum(lengths))
    return done / elapsed


def bench_hf(model, prompts, lengths, batch: int) -> float:
    import torch

    t0 = time.perf_counter()
    produced = 0
    for s in range(0, len(prompts), batch):
        ps, ns = prompts[s : s + batch], lengths[s : s + batch]
        width = max(len(p) for p in ps)
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=int(max(ns)),
                min_new_tokens=int(max(ns)),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        produced += int(sum(ns))  # useful tokens: each request's own length
    return produced / (time.perf_counter() - t0)


def bench_migration(params, context: int, repeats: int) -> dict:
    rcfg = RolloutConfig(
        max_slots=1,
        page_size=16,
        num_pages=2 + context // 16 + 2,
        max_prompt_len=context,
        max_new_tokens=4,
        prefill_chunk=512,
        temperature=0.0,
    )
    src = Engine(MODEL, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1, interpret=False)
    dst = Engine(MODEL, rcfg, make_mesh(jax.devices()[1:2], 1, 1), eos_id=-1, interpret=False)
    for e in (src, dst):
        e.load_params(params, 0)
    prompt = list(np.random.default_rng(context).integers(3, MODEL.vocab_size, context))
    migrate_s, prefill_s = [], []
    for rep in range(repeats + 1):  # the first round compiles
        req = Request(rep, prompt, 0, request_key(1, rep), 4)
        src.submit([req])
        src.step()  # prefill + first token
        t0 = time.perf_counter()
        exported = src.export_requests([req.id])
        dst.import_requests(exported)
        jax.block_until_ready(dst.cache.k)
        t_mig = time.perf_counter() - t0
        dst.interrupt([req.id])
        # Re-prefill the same context on the destination (what partial rollout would pay).
        again = Request(("re", rep), prompt, 0, request_key(1, rep), 4)
        t0 = time.perf_counter()
        dst.prefill([again])
        jax.block_until_ready(dst.cache.k)
        t_pre = time.perf_counter() - t0
        dst.interrupt([again.id])
        if rep:
            migrate_s.append(t_mig)
            prefill_s.append(t_pre)
    m, p = statistics.median(migrate_s), statistics.median(prefill_s)
    return {
        "context_tokens": context,
        "migrate_ms_median": 1e3 * m,
        "reprefill_ms_median": 1e3 * p,
        "migrate_over_reprefill": m / p,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    ap.add_argument("--out", default="benchmarks/results/bench_rollout.json")
    args = ap.parse_args()
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    n_req, rounds, slots = (32, 2, 16) if args.quick else (64, 3, 16)
    prompts = [
        list(rng.integers(3, MODEL.vocab_size, int(rng.integers(16, 65)))) for _ in range(n_req)
    ]
    lengths = long_tail_lengths(n_req, rng, median=10, cap=256)
    p50, p99 = np.percentile(lengths, 50), np.percentile(lengths, 99)
    print(
        f"workload: {n_req} requests, response tokens median {p50:.0f}, p99 {p99:.0f} "
        f"(p99/median {p99 / p50:.1f}), max {lengths.max()}, total {lengths.sum()}"
    )

    params = init_params(MODEL, jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:  # the same weights, through our HF export
        save_hf_checkpoint(params, MODEL, d)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(d).eval()
        params = load_hf_params(d, MODEL)
    if p99 / p50 < 10:
        raise SystemExit(f"workload p99/median is {p99 / p50:.1f}, below the 10 required")
    bench_engine(params, prompts, lengths, slots)  # warm-up round (compiles every bucket)
    bench_hf(hf, prompts, lengths, slots)
    ours, theirs = [], []
    for r in range(rounds):
        ours.append(bench_engine(params, prompts, lengths, slots))
        theirs.append(bench_hf(hf, prompts, lengths, slots))
        print(
            f"  round {r}: dora_jax engine {ours[-1]:.0f} tok/s, HF generate {theirs[-1]:.0f} tok/s"
        )
    speedup = statistics.median(ours) / statistics.median(theirs)
    print(
        f"(a) generated tokens/s, engine / HF generate (median of {rounds}): {speedup:.2f}x "
        "(target >= 3x)"
    )

    mig = [bench_migration(params, c, 2 if args.quick else 3) for c in (1024, 2048, 4096)]
    for m in mig:
        print(
            f"(b) context {m['context_tokens']}: migration {m['migrate_ms_median']:.1f} ms, "
            f"re-prefill {m['reprefill_ms_median']:.1f} ms -> "
            f"{100 * m['migrate_over_reprefill']:.1f}% (target <= 10%)"
        )

    out = {
        "command": "python launch/bench_rollout.py" + (" --quick" if args.quick else ""),
        "machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__} "
        f"({jax.devices()[0].platform}), torch {torch.__version__}",
        "model": {
            "family": MODEL.family,
            "layers": MODEL.num_layers,
            "hidden": MODEL.hidden_size,
            "vocab": MODEL.vocab_size,
        },
        "workload": {
            "requests": n_req,
            "slots": slots,
            "median_tokens": float(p50),
            "p99_tokens": float(p99),
            "total_tokens": int(lengths.sum()),
        },
        "engine_settings": "continuous batching over 16 slots, paged KV (page 16), reference "
        "attention on CPU, decode_steps=8 per device call, batch/width buckets, greedy",
        "hf_settings": "model.generate in static batches of 16 (left padded), greedy, each batch "
        "runs to its longest request; useful tokens counted (each request's own length)",
        "throughput": {
            "units": "generated tokens per second",
            "engine_per_round": ours,
            "hf_generate_per_round": theirs,
            "speedup_engine_over_hf_median": speedup,
            "target": ">= 3x",
        },
        "migration": {
            "units": "milliseconds; ratio migrate/re-prefill",
            "rows": mig,
            "target": "migrate <= 10% of re-prefill",
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
