"""The rollout benchmark on a real model's weights (``launch/bench_rollout.py`` is the entry):

    python launch/bench_rollout.py --model smollm2-135m-instruct [--model-dir DIR] [--quick]
        [--requests N] [--tokens MEDIAN] [--rounds R] [--max-load L] [--wait S]

SmolLM2-135M-Instruct from its Hugging Face directory (default ``models/smollm2-135m-instruct``,
made by ``python launch/prepare_model.py smollm2-135m-instruct``), loaded by dora_jax
(``load_hf_config`` / ``load_hf_params``) and by ``transformers``
(``AutoModelForCausalLM.from_pretrained``) from the same files, in float32 and in bfloat16.
Prompts are chat-templated questions (``What is 13 + 14?``, ``data.word_arithmetic``) encoded by
dora_jax's ``HFTokenizer``. Greedy; the same two workloads as the tiny model's run: a long tail
(lognormal response lengths, median ``--tokens``, p99/median >= 10 from 32 requests up) and its
uniform control (the same prompts and total of response tokens).

Without EOS: every request runs to its workload's length, as in the other runs, on past the
model's own end of answer. With EOS the lengths would be the model's, so there would be no
uniform control (per-step and scheduling gains could not be told apart), and where bfloat16
rounding parts the two greedy runs the two sides would generate different amounts of work. How
many responses contain the model's EOS, and where, is recorded beside the figures.

On the warm-up round of each workload (it compiles) the outputs are compared: in float32 they
must equal HF's token for token, else the run fails; in bfloat16 a near-tie rounded differently
can part the two greedy runs after a few tokens, so the agreement (``greedy_agreement``: leading
tokens equal per request) is reported instead of failing. Then ``--rounds`` rounds alternate
engine and HF; ratios are of medians. It waits for a quiet machine first (``--max-load``,
``--wait``) and writes ``benchmarks/results/bench_rollout_smollm2.json`` with the command,
commit and load averages (``benchmarks/quiet.py``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
import numpy as np
from bench_rollout import (
    DECODE_STEPS,
    PAGE,
    SLOTS,
    Result,
    Workload,
    check_greedy_equal,
    greedy_agreement,
    long_tail_lengths,
    pick_torch_threads,
    run_engine,
    run_hf,
    uniform_like,
    write,
)

from benchmarks import quiet
from dora_jax.data.word_arithmetic import problems
from dora_jax.model.hf_checkpoint import load_hf_config, load_hf_params
from dora_jax.model.tokenizer import HFTokenizer, Tokenizer, encode_prompt, eos_ids

OUT = "benchmarks/results/bench_rollout_smollm2.json"
MIN_TAIL_REQUESTS = 32  # fewer evenly spaced lognormal quantiles cannot reach p99/median 10


def check_model_dir(path: Path, name: str) -> None:
    """``SystemExit`` with one line when ``path`` holds no prepared model."""
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(
            f"{path}: no Hugging Face model directory (config.json missing); make it with "
            f"`python launch/prepare_model.py {name}` or pass --model-dir"
        )


def make_workloads(tokenizer: Tokenizer, n: int, median: int, seed: int = 0) -> list[Workload]:
    """``n`` chat-templated questions ``What is a + b?`` and two length mixes for them: the long
    tail (lognormal, ``median``, capped at 16x) and its uniform control (the same total)."""
    rows = problems("+", 10, 99, n, seed)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    tail = long_tail_lengths(n, np.random.default_rng(seed), median=median, cap=16 * median)
    ratio = np.percentile(tail, 99) / np.median(tail)
    if n >= MIN_TAIL_REQUESTS and ratio < 10:
        raise SystemExit(f"workload p99/median is {ratio:.1f}, below the 10 required")
    return [Workload("long_tail", prompts, tail), Workload("uniform", prompts, uniform_like(tail))]


def eos_in_responses(wl: Workload, res: Result, stop: tuple[int, ...]) -> dict:
    """Where the model's own EOS came in each response (the run goes on past it)."""
    first = [
        next((j for j, t in enumerate(res.outputs[i]) if t in stop), None)
        for i in range(len(wl.prompts))
    ]
    at = [j for j in first if j is not None]
    return {
        "eos_ids": list(stop),
        "requests_with_eos": len(at),
        "first_eos_position_median": float(np.median(at)) if at else None,
    }


def compare(cfg, params, hf, wl: Workload, rounds: int, exact: bool, stop) -> dict:
    t0 = time.perf_counter()
    ours = run_engine(cfg, params, wl)  # warm-up: compiles every bucket
    warm_s = time.perf_counter() - t0
    theirs = run_hf(hf, wl)
    agree = greedy_agreement(wl, ours, theirs)
    if exact:
        check_greedy_equal(wl, ours, theirs)
    eos = eos_in_responses(wl, ours, stop)
    print(
        f"  {wl.name}: warm-up (engine compiles: {warm_s:.0f} s); greedy outputs: "
        f"{agree['requests_equal']}/{agree['requests']} requests equal token for token "
        f"({int(wl.lengths.sum())} tokens), first token equal in {agree['first_token_equal']}; "
        f"the model's EOS came in {eos['requests_with_eos']} responses",
        flush=True,
    )
    a, b = [], []
    for r in range(rounds):
        a.append(run_engine(cfg, params, wl).tokens_per_s)
        b.append(run_hf(hf, wl).tokens_per_s)
        print(
            f"  {wl.name} round {r}: engine {a[-1]:.1f} tok/s, HF generate {b[-1]:.1f} tok/s",
            flush=True,
        )
    return {
        "requests": len(wl.prompts),
        "prompt_tokens": [min(map(len, wl.prompts)), max(map(len, wl.prompts))],
        "median_tokens": float(np.median(wl.lengths)),
        "p99_tokens": float(np.percentile(wl.lengths, 99)),
        "max_tokens": int(wl.lengths.max()),
        "total_tokens": int(wl.lengths.sum()),
        "greedy_outputs_equal": agree["requests_equal"] == agree["requests"],
        "greedy_agreement": agree,
        "model_eos": eos,
        "engine_tokens_per_s": a,
        "hf_generate_tokens_per_s": b,
        "engine_over_hf": statistics.median(a) / statistics.median(b),
        "engine_warmup_s_with_compile": warm_s,
        "hf_decode_steps": theirs.decode_steps,
        "engine_decode_steps": ours.decode_steps,
        "engine_decode_steps_lower_bound": wl.continuous_steps_lower_bound(SLOTS),
    }


def bench_dtype(args, tokenizer, workloads: list[Workload], dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(args.model_dir, param_dtype=dtype, compute_dtype=dtype)
    params = load_hf_params(args.model_dir, cfg)
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # no EOS (and no min_new_tokens suppressing it)
    probe = Workload("probe", workloads[0].prompts[:4], np.full(min(4, args.requests), 4, int))
    threads, speeds = pick_torch_threads(hf, probe)
    print(
        f"{dtype}: HF generate on {threads} torch thread(s) (probe: "
        + ", ".join(f"{n}: {v:.1f} tok/s" for n, v in speeds.items())
        + ")",
        flush=True,
    )
    stop = eos_ids(tokenizer)
    res = {
        wl.name: compare(cfg, params, hf, wl, args.rounds, dtype == "float32", stop)
        for wl in workloads
    }
    per_step = res["uniform"]["engine_over_hf"]
    total = res["long_tail"]["engine_over_hf"]
    return {
        "workloads": res,
        "per_step_gain": per_step,
        "scheduling_gain": total / per_step,
        "total_gain_long_tail": total,
        "torch_threads": threads,
        "torch_threads_probe_tokens_per_s": speeds,
    }


def main(args) -> int:
    check_model_dir(args.model_dir, args.model)
    load0 = quiet.wait_for_quiet(args.max_load, args.wait)
    import torch

    t_start = time.perf_counter()
    tokenizer = HFTokenizer(args.model_dir)
    cfg = load_hf_config(args.model_dir)
    workloads = make_workloads(tokenizer, args.requests, args.tokens)
    print(
        f"{args.model} from {args.model_dir} ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}), {args.rounds} timed round(s) per "
        "workload and dtype",
        flush=True,
    )
    for wl in workloads:
        print(
            f"workload {wl.name}: {len(wl.prompts)} requests, response tokens median "
            f"{np.median(wl.lengths):.0f}, p99 {np.percentile(wl.lengths, 99):.0f}, max "
            f"{wl.lengths.max()}, total {wl.lengths.sum()}; decode steps: HF static batches of "
            f"{SLOTS} {wl.static_batch_steps(SLOTS)}, continuous batching over {SLOTS} slots "
            f">= {wl.continuous_steps_lower_bound(SLOTS)}"
        )
    by_dtype = {d: bench_dtype(args, tokenizer, workloads, d) for d in ("float32", "bfloat16")}
    for dtype, row in by_dtype.items():
        print(
            f"(a) {dtype}: engine / HF generate tokens/s (medians of {args.rounds}): uniform "
            f"(per-step gain) {row['per_step_gain']:.2f}x, long tail "
            f"{row['total_gain_long_tail']:.2f}x, scheduling gain "
            f"{row['scheduling_gain']:.2f}x"
        )
    elapsed = time.perf_counter() - t_start
    print(f"done in {elapsed:.0f} s")
    out = {
        **quiet.provenance(load0),
        "wall_s": elapsed,
        "machine": f"{jax.devices()[0].platform} ({len(jax.devices())} fake devices, one used), "
        f"one process, jax {jax.__version__}, torch {torch.__version__}",
        "model": {
            "name": args.model,
            "dir": str(args.model_dir),
            "family": cfg.family,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
            "weights": "the real ones, read from the directory by dora_jax (load_hf_params) "
            "and by transformers (AutoModelForCausalLM.from_pretrained)",
        },
        "prompts": "chat-templated 'What is a + b?' (data.word_arithmetic.problems('+', 10, "
        "99, n, seed 0)), encoded by dora_jax's HFTokenizer",
        "engine_settings": f"continuous batching over {SLOTS} slots, paged KV (page {PAGE}), "
        f"reference attention on CPU, decode_steps={DECODE_STEPS} per device call, greedy, "
        "no EOS",
        "hf_settings": f"model.generate (eager) in static batches of {SLOTS} (left padded), "
        "greedy, no EOS (generation_config.eos_token_id = None), each batch runs to its "
        "longest request; useful tokens counted; torch threads: the faster of 1 and one per "
        "core on a 4 x 4-token probe",
        "greedy_check": "warm-up round of each workload: float32 equal token for token or the "
        "run fails; bfloat16 agreement reported (rounding can part the two greedy runs)",
        "units": "generated tokens per second; ratios engine / HF of medians; decode steps are "
        "token positions run (engine: device calls x fused steps); seconds",
        "definitions": "per_step_gain = engine/HF on uniform lengths (no scheduling effect); "
        "scheduling_gain = long-tail ratio / uniform ratio",
        "rounds": args.rounds,
        "by_dtype": by_dtype,
    }
    write(out, args.out or OUT)
    return 0
