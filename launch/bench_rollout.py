"""Rollout benchmark on this machine's CPU, one process, side by side in one run.

(a) Generated tokens/s of our engine (continuous batching over paged KV, fused multi-step
    decode) vs Hugging Face ``transformers`` ``generate`` (eager, static batches padded to their
    longest request) on the same tiny Qwen2 weights and prompts, greedy, no EOS. Two workloads
    with the same prompts and the same total of response tokens separate two effects:

    - *uniform*: every request has the same length, so static batches waste nothing and
      continuous batching cannot help: the engine/HF ratio is the **per-step gain** (fused decode
      steps against eager ``generate`` on this small model);
    - *long tail*: lognormal lengths (p99/median >= 10): static batches run to their longest
      request, so the ratio also contains the **scheduling gain** = long-tail ratio / uniform
      ratio (compare it with the ratio of decode steps each side needs).

    On the first (warm-up) round of each workload the engine's tokens must equal HF's token for
    token (the same weights through our HF export, greedy): the run fails otherwise.
(b) KV migration (pack -> ``device_put`` to another fake CPU device of the same process, i.e. a
    host memory copy -> unpack; K and V both awaited) vs re-prefill of the same context on the
    destination, for contexts of 1k, 2k and 4k tokens. No network or device link is involved.

Rounds alternate the contenders; ratios are of medians. Writes
``benchmarks/results/bench_rollout.json`` with units and the command.

    python launch/bench_rollout.py [--quick] [--model tiny|qwen2.5-0.5b|smollm2-135m-instruct]

``--model qwen2.5-0.5b`` runs (a) only, at Qwen2.5-0.5B's shape (random weights), in float32
and in bfloat16, on a small uniform workload (``--requests``, ``--tokens``, ``--rounds``), and
writes ``benchmarks/results/bench_rollout_qwen2.5-0.5b.json``.

``--model smollm2-135m-instruct`` runs (a) only, on SmolLM2-135M-Instruct's real weights from
``--model-dir`` (default ``models/smollm2-135m-instruct``, made by ``python
launch/prepare_model.py smollm2-135m-instruct``) and chat-templated questions, both workloads,
in float32 (outputs equal token for token, else it fails) and in bfloat16 (agreement figures:
rounding may part the two greedy runs), after waiting for a quiet machine (``--max-load``,
``--wait``); it writes ``benchmarks/results/bench_rollout_smollm2.json``. That path lives in
``launch/bench_rollout_real.py`` (its docstring says why it runs without EOS).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(8)
# bench_rollout_real imports this module by name: run as a script, it is __main__
sys.modules.setdefault("bench_rollout", sys.modules[__name__])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dora_jax.config import ModelConfig, RolloutConfig  # noqa: E402
from dora_jax.mesh import make_mesh  # noqa: E402
from dora_jax.model import init_params  # noqa: E402
from dora_jax.model.hf_checkpoint import load_hf_params, save_hf_checkpoint  # noqa: E402
from dora_jax.rollout import Engine, Request, request_key  # noqa: E402

# Model shapes by name (a larger preset only needs an entry here and enough memory).
MODELS = {
    "tiny": ModelConfig(
        family="qwen2",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
    ),
    # Qwen2.5-0.5B-Instruct's shape (494M params, tied embeddings), random weights
    "qwen2.5-0.5b": ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
    ),
}
SLOTS = 16  # engine slots = HF static batch size
DECODE_STEPS = 8  # engine decode steps fused into one device call
PAGE = 16


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    lengths: np.ndarray  # response tokens per request

    def static_batch_steps(self, batch: int) -> int:
        """Decode steps of static batches: each runs to its longest request."""
        return int(
            sum(self.lengths[s : s + batch].max() for s in range(0, len(self.lengths), batch))
        )

    def continuous_steps_lower_bound(self, slots: int) -> int:
        """No schedule over ``slots`` slots needs fewer decode steps than this."""
        return int(max(self.lengths.max(), -(-self.lengths.sum() // slots)))


@dataclass
class Result:
    tokens_per_s: float
    outputs: dict[int, list[int]]  # request index -> its response tokens
    decode_steps: int  # decode steps run (engine: device calls x fused steps)


def long_tail_lengths(n: int, rng: np.random.Generator, median: int, cap: int) -> np.ndarray:
    """Lognormal response lengths at evenly spaced quantiles (so the sample has the intended
    shape even when small), sigma 1.2 (p99/median ~ 16), capped, in random order."""
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    lengths = np.clip(np.round(median * np.exp(1.2 * np.asarray(z))), 1, cap).astype(int)
    return rng.permutation(lengths)


def make_workloads(cfg: ModelConfig, n: int, rng: np.random.Generator) -> list[Workload]:
    """The long-tailed mix and its uniform control: the same prompts and total response
    tokens, every request of the mean length."""
    prompts = [list(rng.integers(3, cfg.vocab_size, int(rng.integers(16, 65)))) for _ in range(n)]
    tail = long_tail_lengths(n, rng, median=10, cap=256)
    p50, p99 = np.percentile(tail, 50), np.percentile(tail, 99)
    if p99 / p50 < 10:
        raise SystemExit(f"workload p99/median is {p99 / p50:.1f}, below the 10 required")
    return [Workload("long_tail", prompts, tail), Workload("uniform", prompts, uniform_like(tail))]


def uniform_like(lengths: np.ndarray) -> np.ndarray:
    """As many requests with the same total, lengths differing by at most 1."""
    n, total = len(lengths), int(lengths.sum())
    uniform = np.full(n, total // n, int)
    uniform[: total - uniform.sum()] += 1
    return uniform


def run_engine(cfg: ModelConfig, params, wl: Workload) -> Result:
    prompt_len = max(64, PAGE * -(-max(len(p) for p in wl.prompts) // PAGE))
    rcfg = RolloutConfig(
        max_slots=SLOTS,
        page_size=PAGE,
        num_pages=1 + SLOTS * -(-(prompt_len + int(wl.lengths.max())) // PAGE),
        max_prompt_len=prompt_len,
        max_new_tokens=int(wl.lengths.max()),
        prefill_chunk=64,
        temperature=0.0,
        batch_invariant=False,
        decode_steps=DECODE_STEPS,
    )
    engine = Engine(cfg, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1, interpret=False)
    engine.load_params(params, 0)
    reqs = [
        Request(i, list(p), 0, request_key(0, i), int(n))
        for i, (p, n) in enumerate(zip(wl.prompts, wl.lengths, strict=True))
    ]
    outputs, calls = {}, 0
    t0 = time.perf_counter()
    engine.submit(reqs)
    while engine.num_requests:
        report = engine.step()
        calls += report.decode_tokens > 0
        outputs.update({f.id: list(f.tokens) for f in report.finished})
    elapsed = time.perf_counter() - t0
    done = sum(len(t) for t in outputs.values())
    assert done == int(wl.lengths.sum()), (done, int(wl.lengths.sum()))
    return Result(done / elapsed, outputs, calls * DECODE_STEPS)


def run_hf(model, wl: Workload) -> Result:
    import torch

    outputs, steps = {}, 0
    t0 = time.perf_counter()
    for s in range(0, len(wl.prompts), SLOTS):
        ps, ns = wl.prompts[s : s + SLOTS], wl.lengths[s : s + SLOTS]
        width = max(len(p) for p in ps)
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=int(max(ns)),
                min_new_tokens=int(max(ns)),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        steps += int(max(ns))
        for i, n in enumerate(ns):  # useful tokens: each request's own length
            outputs[s + i] = out[i, width : width + int(n)].tolist()
    elapsed = time.perf_counter() - t0
    return Result(int(wl.lengths.sum()) / elapsed, outputs, steps)


def pick_torch_threads(model, wl: Workload) -> tuple[int, dict[int, float]]:
    """The faster of one thread and one per core for ``generate`` on ``wl`` (best of two runs
    each): on a small model a thread pool can cost more than it gives, more so when other
    processes share the cores, and the baseline should get its better setting."""
    import torch

    speeds = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        speeds[n] = max(run_hf(model, wl).tokens_per_s for _ in range(2))
    best = max(speeds, key=speeds.get)
    torch.set_num_threads(best)
    return best, speeds


def check_greedy_equal(wl: Workload, ours: Result, theirs: Result) -> None:
    """Token-for-token equality of the two greedy outputs; exits naming the first difference."""
    for i in range(len(wl.prompts)):
        a, b = ours.outputs[i], theirs.outputs[i]
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            raise SystemExit(
                f"{wl.name}: request {i} differs from HF generate at response token {at} "
                f"(lengths {len(a)} and {len(b)}): the two greedy runs must agree"
            )


def compare(cfg: ModelConfig, params, hf, wl: Workload, rounds: int) -> dict:
    ours, theirs = run_engine(cfg, params, wl), run_hf(hf, wl)  # warm-up: compiles every bucket
    check_greedy_equal(wl, ours, theirs)
    print(f"  {wl.name}: greedy outputs equal token for token ({int(wl.lengths.sum())} tokens)")
    a, b = [], []
    for r in range(rounds):
        a.append(run_engine(cfg, params, wl).tokens_per_s)
        b.append(run_hf(hf, wl).tokens_per_s)
        print(f"  {wl.name} round {r}: engine {a[-1]:.0f} tok/s, HF generate {b[-1]:.0f} tok/s")
    return {
        "requests": len(wl.prompts),
        "median_tokens": float(np.median(wl.lengths)),
        "p99_tokens": float(np.percentile(wl.lengths, 99)),
        "max_tokens": int(wl.lengths.max()),
        "total_tokens": int(wl.lengths.sum()),
        "greedy_outputs_equal": True,
        "engine_tokens_per_s": a,
        "hf_generate_tokens_per_s": b,
        "engine_over_hf": statistics.median(a) / statistics.median(b),
        "hf_decode_steps": theirs.decode_steps,
        "engine_decode_steps": ours.decode_steps,
        "engine_decode_steps_lower_bound": wl.continuous_steps_lower_bound(SLOTS),
    }


def bench_migration(cfg: ModelConfig, params, context: int, repeats: int) -> dict:
    rcfg = RolloutConfig(
        max_slots=1,
        page_size=PAGE,
        num_pages=2 + context // PAGE + 2,
        max_prompt_len=context,
        max_new_tokens=4,
        prefill_chunk=512,
        temperature=0.0,
    )
    src = Engine(cfg, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1, interpret=False)
    dst = Engine(cfg, rcfg, make_mesh(jax.devices()[1:2], 1, 1), eos_id=-1, interpret=False)
    for e in (src, dst):
        e.load_params(params, 0)
    prompt = list(np.random.default_rng(context).integers(3, cfg.vocab_size, context))
    migrate_s, prefill_s = [], []
    for rep in range(repeats + 1):  # the first round compiles
        req = Request(rep, prompt, 0, request_key(1, rep), 4)
        src.submit([req])
        src.step()  # prefill + first token
        jax.block_until_ready((src.cache.k, src.cache.v))
        t0 = time.perf_counter()
        exported = src.export_requests([req.id])
        dst.import_requests(exported)
        jax.block_until_ready((dst.cache.k, dst.cache.v))
        t_mig = time.perf_counter() - t0
        dst.interrupt([req.id])
        # Re-prefill the same context on the destination (what partial rollout would pay).
        again = Request(("re", rep), prompt, 0, request_key(1, rep), 4)
        t0 = time.perf_counter()
        dst.prefill([again])
        jax.block_until_ready((dst.cache.k, dst.cache.v))
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


def greedy_agreement(wl: Workload, ours: Result, theirs: Result) -> dict:
    """How far the two greedy outputs agree: per request, the number of leading response tokens
    equal (at a real shape with random weights a near-tie of two logits can flip an argmax
    between two correct implementations, and after that the sequences differ)."""
    same = []
    for i in range(len(wl.prompts)):
        a, b = ours.outputs[i], theirs.outputs[i]
        differ = (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        same.append(next(differ, min(len(a), len(b))))
    return {
        "requests_equal": sum(n == int(k) for n, k in zip(same, wl.lengths, strict=True)),
        "requests": len(same),
        "leading_tokens_equal": same,
        "first_token_equal": sum(n > 0 for n in same),
    }


def bench_real_shape(args, base: ModelConfig) -> dict:
    """Engine vs HF ``generate`` at a real model's shape (random weights), in float32 and in
    bfloat16: ``--requests`` requests of ``--tokens`` response tokens each (uniform lengths: no
    scheduling gain, one static batch per ``SLOTS`` requests), one warm-up round (compiles; its
    greedy outputs are compared) and ``--rounds`` timed rounds. In float32 every request's
    first response token must agree with HF's (the same weights and prompt), else the run fails."""
    import torch
    import transformers

    rng = np.random.default_rng(0)
    prompts = [
        list(rng.integers(3, base.vocab_size, int(rng.integers(16, 65))))
        for _ in range(args.requests)
    ]
    wl = Workload("uniform", prompts, np.full(args.requests, args.tokens, int))
    rows = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(base, param_dtype=dtype, compute_dtype=dtype)
        with tempfile.TemporaryDirectory() as d:  # the same weights, through our HF export
            save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, d, dtype=dtype)
            hf = transformers.Qwen2ForCausalLM.from_pretrained(
                d, torch_dtype=getattr(torch, dtype)
            ).eval()
            params = load_hf_params(d, cfg)
        probe = Workload("probe", prompts[:4], np.full(min(4, len(prompts)), 4, int))
        threads, speeds = pick_torch_threads(hf, probe)
        print(
            f"  {dtype}: HF generate on {threads} torch thread(s) (probe: "
            + ", ".join(f"{n}: {v:.2f} tok/s" for n, v in speeds.items())
            + ")"
        )
        t0 = time.perf_counter()
        ours = run_engine(cfg, params, wl)
        warm_engine_s = time.perf_counter() - t0
        theirs = run_hf(hf, wl)
        agree = greedy_agreement(wl, ours, theirs)
        print(
            f"  {dtype}: warm-up (engine compiles: {warm_engine_s:.0f} s); greedy outputs: "
            f"{agree['requests_equal']}/{agree['requests']} requests equal token for token, "
            f"first token equal in {agree['first_token_equal']}"
        )
        if dtype == "float32" and agree["first_token_equal"] < agree["requests"]:
            raise SystemExit("float32: a first response token differs from HF generate's")
        a, b = [], []
        for r in range(args.rounds):
            a.append(run_engine(cfg, params, wl).tokens_per_s)
            b.append(run_hf(hf, wl).tokens_per_s)
            print(
                f"  {dtype} round {r}: engine {a[-1]:.2f} tok/s, HF generate {b[-1]:.2f} tok/s",
                flush=True,
            )
        rows[dtype] = {
            "engine_tokens_per_s": a,
            "hf_generate_tokens_per_s": b,
            "engine_over_hf": statistics.median(a) / statistics.median(b),
            "greedy_agreement": agree,
            "engine_warmup_s_with_compile": warm_engine_s,
            "torch_threads": threads,
            "torch_threads_probe_tokens_per_s": speeds,
        }
        del hf, params
    return {
        "units": "generated tokens per second; ratio engine / HF of medians",
        "workload": f"{args.requests} requests, prompts of 16-64 random tokens, {args.tokens} "
        f"response tokens each (uniform: the per-step gain only), greedy, no EOS",
        "rounds": args.rounds,
        "by_dtype": rows,
    }


# A real model's weights from its Hugging Face directory (launch/bench_rollout_real.py)
REAL_MODELS = {"smollm2-135m-instruct": "models/smollm2-135m-instruct"}
# --requests, --tokens, --rounds when not given (smollm2: --tokens is the long tail's median)
REAL_DEFAULTS = {"qwen2.5-0.5b": (8, 16, 2), "smollm2-135m-instruct": (32, 4, 2)}
QUICK_DEFAULTS = {"smollm2-135m-instruct": (4, 2, 1)}  # --quick: the path end to end, tiny


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--quick", action="store_true", help="fewer requests and rounds")
    add("--model", choices=[*sorted(MODELS), *REAL_MODELS], default="tiny", help="model")
    add("--model-dir", type=Path, help=f"default {', '.join(REAL_MODELS.values())}")
    add("--out", help="default: benchmarks/results/bench_rollout[_MODEL].json")
    shown = "; ".join(f"{m} {'/'.join(map(str, d))}" for m, d in REAL_DEFAULTS.items())
    quick = "; ".join(f"{m} {'/'.join(map(str, d))}" for m, d in QUICK_DEFAULTS.items())
    add(
        "--requests",
        type=int,
        help=f"real models: requests (/tokens/rounds: {shown}; --quick: {quick})",
    )
    add("--tokens", type=int, help="real models: response tokens each (smollm2: the median)")
    add("--rounds", type=int, help="real models: timed rounds")
    add("--max-load", type=float, default=1.5, help="smollm2: wait for a lower load average")
    add("--wait", type=float, default=600.0, help="smollm2: seconds to wait for that")
    args = ap.parse_args(argv)
    if args.model_dir is not None and args.model not in REAL_MODELS:
        ap.error(f"--model-dir is for --model {' or '.join(REAL_MODELS)}")
    if args.model in REAL_MODELS:
        args.model_dir = args.model_dir or Path(REAL_MODELS[args.model])
    if args.model in REAL_DEFAULTS:
        table = QUICK_DEFAULTS if args.quick and args.model in QUICK_DEFAULTS else REAL_DEFAULTS
        given = (args.requests, args.tokens, args.rounds)
        args.requests, args.tokens, args.rounds = (
            d if g is None else g for g, d in zip(given, table[args.model], strict=True)
        )
        if min(args.requests, args.tokens, args.rounds) < 1:
            ap.error("--requests, --tokens and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model in REAL_MODELS:
        import bench_rollout_real

        return bench_rollout_real.main(args)
    import torch
    import transformers

    cfg = MODELS[args.model]
    load_start = os.getloadavg()[0]
    if args.model != "tiny":
        return main_real_shape(args, cfg, load_start)
    n_req, rounds = (32, 2) if args.quick else (64, 3)
    workloads = make_workloads(cfg, n_req, np.random.default_rng(0))
    for wl in workloads:
        print(
            f"workload {wl.name}: {n_req} requests, response tokens median "
            f"{np.median(wl.lengths):.0f}, p99 {np.percentile(wl.lengths, 99):.0f}, max "
            f"{wl.lengths.max()}, total {wl.lengths.sum()}; decode steps: HF static batches of "
            f"{SLOTS} {wl.static_batch_steps(SLOTS)}, continuous batching over {SLOTS} slots "
            f">= {wl.continuous_steps_lower_bound(SLOTS)}"
        )

    params = init_params(cfg, jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:  # the same weights, through our HF export
        save_hf_checkpoint(params, cfg, d)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(d).eval()
        params = load_hf_params(d, cfg)

    threads, speeds = pick_torch_threads(hf, workloads[1])
    print(
        f"HF generate on {threads} torch thread(s) ("
        + ", ".join(f"{n}: {v:.0f} tok/s" for n, v in speeds.items())
        + " on the uniform workload)"
    )
    res = {wl.name: compare(cfg, params, hf, wl, rounds) for wl in workloads}
    per_step = res["uniform"]["engine_over_hf"]
    total = res["long_tail"]["engine_over_hf"]
    scheduling = total / per_step
    tail = res["long_tail"]
    step_ratio = tail["hf_decode_steps"] / tail["engine_decode_steps"]
    print(f"(a) engine / HF generate tokens/s (median of {rounds}), CPU, one process:")
    print(f"    uniform lengths (per-step gain):      {per_step:.2f}x")
    print(f"    long tail (per-step x scheduling):     {total:.2f}x")
    print(
        f"    scheduling gain (long tail / uniform): {scheduling:.2f}x (decode steps on the long "
        f"tail: HF {tail['hf_decode_steps']}, engine {tail['engine_decode_steps']}, ratio "
        f"{step_ratio:.2f}x)"
    )

    mig = [bench_migration(cfg, params, c, 2 if args.quick else 3) for c in (1024, 2048, 4096)]
    for m in mig:
        print(
            f"(b) context {m['context_tokens']}: migration (host memory copy between two fake "
            f"CPU devices) {m['migrate_ms_median']:.1f} ms, re-prefill "
            f"{m['reprefill_ms_median']:.1f} ms -> {100 * m['migrate_over_reprefill']:.1f}%"
        )

    out = {
        "command": "python launch/bench_rollout.py"
        + (" --quick" if args.quick else "")
        + (f" --model {args.model}" if args.model != "tiny" else ""),
        "machine": f"{os.cpu_count()} CPU cores, one process, jax {jax.__version__} "
        f"({jax.devices()[0].platform}, 8 fake devices), torch {torch.__version__}; 1-minute "
        f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        "(other processes share the cores)",
        "model": {
            "name": args.model,
            "family": cfg.family,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
        },
        "engine_settings": f"continuous batching over {SLOTS} slots, paged KV (page {PAGE}), "
        f"reference attention on CPU, decode_steps={DECODE_STEPS} per device call, batch/width "
        "buckets, greedy",
        "hf_settings": f"model.generate (eager) in static batches of {SLOTS} (left padded), "
        "greedy, each batch runs to its longest request; useful tokens counted (each request's "
        f"own length); torch threads: {threads}, the faster of "
        + ", ".join(f"{n} ({v:.0f} tok/s)" for n, v in speeds.items()),
        "throughput": {
            "units": "generated tokens per second; ratios engine / HF of medians; decode steps "
            "are token positions run (engine: device calls x fused steps)",
            "workloads": res,
            "per_step_gain": per_step,
            "scheduling_gain": scheduling,
            "total_gain_long_tail": total,
            "long_tail_decode_step_ratio_hf_over_engine": step_ratio,
            "definitions": "per_step_gain = engine/HF on uniform lengths (no scheduling effect); "
            "scheduling_gain = long-tail ratio / uniform ratio",
        },
        "migration": {
            "units": "milliseconds; ratio migrate/re-prefill",
            "what": "pack -> jax.device_put to another fake CPU device of the same process (a "
            "host memory copy) -> unpack, K and V awaited; re-prefill of the same context on the "
            "destination",
            "rows": mig,
            "target": "migrate <= 10% of re-prefill",
        },
    }
    write(out, args.out or "benchmarks/results/bench_rollout.json")
    return 0


def write(out: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


def main_real_shape(args, cfg: ModelConfig, load_start: float) -> int:
    import torch

    print(
        f"{args.model} shape, random weights ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}): {args.requests} requests x {args.tokens} "
        f"tokens, {args.rounds} timed round(s) per dtype",
        flush=True,
    )
    res = bench_real_shape(args, cfg)
    for dtype, row in res["by_dtype"].items():
        print(
            f"(a) {dtype}: engine {statistics.median(row['engine_tokens_per_s']):.2f} tok/s, "
            f"HF generate {statistics.median(row['hf_generate_tokens_per_s']):.2f} tok/s -> "
            f"{row['engine_over_hf']:.2f}x"
        )
    out = {
        "command": f"python launch/bench_rollout.py --model {args.model}"
        + (f" --requests {args.requests}" if args.requests != 8 else "")
        + (f" --tokens {args.tokens}" if args.tokens != 16 else "")
        + (f" --rounds {args.rounds}" if args.rounds != 2 else ""),
        "machine": f"{os.cpu_count()} CPU cores, one process, jax {jax.__version__} "
        f"({jax.devices()[0].platform}), torch {torch.__version__}; 1-minute load average "
        f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other processes "
        "share the cores)",
        "model": {
            "name": args.model,
            "family": cfg.family,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
            "weights": "random (init_params, key 0), through our HF export to both sides",
        },
        "engine_settings": f"continuous batching over {SLOTS} slots, paged KV (page {PAGE}), "
        f"reference attention on CPU, decode_steps={DECODE_STEPS} per device call, greedy",
        "hf_settings": f"model.generate (eager) in static batches of {SLOTS} (left padded), "
        "greedy; torch threads: the faster of 1 and one per core on a 4 x 4-token probe "
        "(best of two runs each; a thread pool loses badly when other processes share the "
        "cores)",
        "throughput": res,
        "migration": "not measured at this shape (the tiny model's run measures it)",
    }
    write(out, args.out or f"benchmarks/results/bench_rollout_{args.model}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
