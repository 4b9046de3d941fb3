"""The train step of a real model (``benchmarks/bench_train_step.py --case smollm2`` is the entry):

    python benchmarks/bench_train_step.py --case smollm2 [--model-dir DIR] [--smollm2-steps N]

SmolLM2-135M-Instruct's real weights (``load_hf_params``) from its Hugging Face directory
(default ``models/smollm2-135m-instruct``, made by ``python launch/prepare_model.py
smollm2-135m-instruct``), at the train shape of ``configs/recipes/smollm2-add-cpu.yaml``: the
recipe read by ``load_config``, the model resolved from the directory as the pipeline does
(``resolve_model``), the trainer on one device, the recipe's buckets, token packing and
microbatches of ``train.microbatch_tokens``, and its batch (``orchestrator.train_batch_prompts``
groups of ``train.group_size``). The trajectories have the recipe's lengths: each group's prompt
is a chat-templated ``What is a + b?`` (``data.word_arithmetic``, operands 1 to 20) encoded by
dora_jax's ``HFTokenizer`` through ``encode_prompt`` (about 35 tokens); responses are random
token ids of seeded lognormal lengths (median 30, at least 10, at most the recipe's
``rollout.max_new_tokens``) with random behaviour logprobs; within each group some rewards are 1
and the rest 0, so every advantage is nonzero.

Model FLOPs of a step (forward + backward = 3 x forward, 2 FLOPs a multiply-add), over the real
tokens (prompt and response) of the packed segments, a segment of ``n`` tokens attending
causally within itself:

    6 x N x tokens                   N: parameters outside the embedding matrix (and LM head)
  + 6 x V x D x tokens               the LM head; the tied embedding matrix counts once, here
                                     (the input lookup is no FLOPs)
  + 6 x L x Nq x Hd x sum n (n + 1)  attention: a query at position i scores i + 1 keys (Q K^T)
                                     and sums as many values (P V), 4 x Nq x Hd x (i + 1) a layer

with V the vocabulary, D the hidden size, L the layers, Nq the query heads and Hd the head dim
(PaLM's ``12 x L x D x T`` per token counts the whole ``T x T`` square; the causal half is the
work a segment needs). The step also computes what these FLOPs leave out; :func:`executed_flops`
estimates its matmuls.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"
DEFAULT_DIR = Path("models") / NAME  # relative to the checkout
RECIPE = ROOT / "configs" / "recipes" / "smollm2-add-cpu.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "bench_train_step_smollm2.json"
RESPONSE_MEDIAN, RESPONSE_SIGMA, RESPONSE_MIN = 30, 0.5, 10


def check_model_dir(path: Path) -> None:
    """``SystemExit`` with one line when ``path`` holds no prepared model."""
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(
            f"{path}: no Hugging Face model directory (config.json missing); make it with "
            f"`python launch/prepare_model.py {NAME}` or pass --model-dir"
        )


def shown(path: Path) -> str:
    """``path`` as given, relative to the checkout when inside it (its links not followed)."""
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def non_embedding_params(cfg) -> int:
    """Parameters of a dense decoder outside its embedding matrix and LM head: the layers'
    (norms and biases included, as in 6N) and the final norm."""
    from dora_jax.model.params import param_specs

    if cfg.is_moe or cfg.sliding_window is not None:
        raise ValueError("dense models with full causal attention only")
    specs = param_specs(cfg)

    def count(tree) -> int:
        if isinstance(tree, dict):
            return sum(count(v) for v in tree.values())
        return math.prod(tree.shape)

    return count(specs) - count(specs["embed"]) - count(specs.get("lm_head", {}))


def train_flops(cfg, segment_lengths, keys: int | None = None) -> dict:
    """Model FLOPs of one train step over segments of ``segment_lengths`` real tokens: the
    module docstring's three terms and their total. ``keys``: the keys all queries attend to
    (:func:`attended_keys`; default: each segment's causal triangle, ``sum n (n + 1) / 2``)."""
    lengths = [int(n) for n in segment_lengths]
    tokens = sum(lengths)
    dense = 6 * non_embedding_params(cfg) * tokens
    lm_head = 6 * cfg.vocab_size * cfg.hidden_size * tokens
    q_width = cfg.num_heads * cfg.resolved_head_dim
    if keys is None:
        keys = sum(n * (n + 1) // 2 for n in lengths)
    attention = 12 * cfg.num_layers * q_width * keys
    return {
        "tokens": tokens,
        "dense": dense,
        "lm_head": lm_head,
        "attention": attention,
        "total": dense + lm_head + attention,
    }


def executed_flops(cfg, rows: int, seq_len: int) -> int:
    """The matmul FLOPs the step runs on ``rows`` rows of ``seq_len`` positions (the used
    microbatches'): every position's layers, padding included; the LM head at 8 x V x D a
    position (the vocabulary scan is rematerialised: its logits are computed again in the
    backward pass); dense attention's whole ``seq_len x seq_len`` scores in every row."""
    positions = rows * seq_len
    per_position = 6 * non_embedding_params(cfg) + 8 * cfg.vocab_size * cfg.hidden_size
    q_width = cfg.num_heads * cfg.resolved_head_dim
    return positions * per_position + 12 * cfg.num_layers * q_width * seq_len**2 * rows


def attended_keys(segment_ids) -> int:
    """The keys the real queries of ``segment_ids [B, T]`` attend to: each query its segment's
    earlier-or-same positions, plus (a response packed after a shared prompt) the whole root
    segment."""
    from dora_jax.model.attention import segment_root

    total = 0
    for row in np.asarray(segment_ids):
        ids, counts = np.unique(row[row != 0], return_counts=True)
        size = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        for i, n in size.items():
            root = int(segment_root(i))
            total += n * (n + 1) // 2 + (n * size.get(root, 0) if root != i else 0)
    return total


def segment_lengths(segment_ids) -> list[int]:
    """The tokens of each packed segment of a batch's ``segment_ids [B, T]`` (0: padding)."""
    return [int(n) for row in np.asarray(segment_ids) for n in np.bincount(row)[1:] if n]


def response_lengths(n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lognormal lengths, median ``RESPONSE_MEDIAN``, within ``[RESPONSE_MIN, cap]``."""
    raw = rng.lognormal(np.log(RESPONSE_MEDIAN), RESPONSE_SIGMA, n)
    return np.clip(np.round(raw), RESPONSE_MIN, cap).astype(int)


def batches(prompts, vocab: int, G: int, n_batches: int, cap: int, seed: int = 0):
    """``n_batches`` batches of ``len(prompts)`` groups of ``G`` trajectories: the group's
    prompt, random response tokens and logprobs; in each group 1 to G - 1 rewards are 1."""
    from dora_jax.train.batch import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        batch = []
        for g, prompt in enumerate(prompts):
            lengths = response_lengths(G, cap, rng)
            rewards = rng.permutation(G) < rng.integers(1, G)
            for m in range(G):
                r = rng.integers(0, vocab, lengths[m])
                lp = -rng.random(lengths[m]).astype(np.float32)
                batch.append(Trajectory(prompt, r, lp, float(rewards[m]), 0, (b, g)))
        out.append(batch)
    return out


def rest_of_the_time(cfg, logprob_chunk: int) -> str:
    from dora_jax.train.logprobs import chunk_layout

    chunks, width = chunk_layout(cfg.vocab_size, logprob_chunk)
    return (
        "Besides the model FLOPs, the step runs: the padding of the used microbatches "
        "(1 - real_token_share of their positions); the LM head's logits twice (the scan over "
        f"{chunks} vocabulary chunks of {width} ids is rematerialised, so 8 x V x D a position, "
        "not 6) and, per position, the online log-sum-exp and entropy over all "
        f"{cfg.vocab_size:,} logits (exp, max, sums: elementwise, no matmul); dense attention's "
        "whole row x row scores where the causal segments need under half; the microbatch loop "
        "(a fori_loop over the used microbatches, each adding a float32 gradient of every "
        "parameter); RMSNorm, RoPE, SiLU and softmax; AdamW over every parameter; and "
        "XLA's CPU matmuls at these shapes below the 1024^3 matmul's rate. executed_tflops "
        "counts the matmuls of the first three."
    )


def main(args, matmul_peak_tflops) -> int:
    """Time the recipe's train step on the real weights; write the JSON."""
    import quiet

    check_model_dir(args.model_dir)
    load0 = quiet.wait_for_quiet(args.max_load, args.wait)
    t_start = time.perf_counter()

    import jax

    from dora_jax.config import load_config
    from dora_jax.data.word_arithmetic import problems
    from dora_jax.mesh import make_mesh
    from dora_jax.model.hf_checkpoint import load_hf_params
    from dora_jax.model.tokenizer import HFTokenizer, encode_prompt
    from dora_jax.pipeline.experiment import resolve_model
    from dora_jax.train import Trainer

    cfg = resolve_model(load_config(RECIPE, [f"model.hf_path={args.model_dir}"]))
    mcfg, tcfg = cfg.model, cfg.train
    NG, G = cfg.orchestrator.train_batch_prompts, tcfg.group_size
    tok = HFTokenizer(args.model_dir)
    prompts = [encode_prompt(tok, r["prompt"]) for r in problems("+", 1, 20, NG, cfg.seed)]
    cap = cfg.rollout.max_new_tokens
    data = batches(prompts, mcfg.vocab_size, G, args.smollm2_steps + 1, cap, cfg.seed)
    peak = matmul_peak_tflops(dtype=mcfg.compute_dtype)  # the peak of the dtype it runs in
    params = load_hf_params(args.model_dir, mcfg)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    # the recipe's layout and, for the side-by-side ratio, the same batches without shared prompts
    variants = {"recipe": tcfg, "unshared": dataclasses.replace(tcfg, share_prompts=False)}
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    trainers = {k: Trainer(mcfg, c, mesh=mesh, params=params) for k, c in variants.items()}
    del params
    packed = {k: [tr.pack(b, version=0) for b in data] for k, tr in trainers.items()}
    first_s = {}
    for k, tr in trainers.items():
        t0 = time.perf_counter()
        jax.device_get(tr.step(packed[k][0]))  # compiles (one shape: the buckets' microbatches)
        first_s[k] = time.perf_counter() - t0
        print(f"{NAME}: {k}: first step (compiles) {first_s[k]:.1f} s", flush=True)
    timed = {k: [] for k in trainers}
    for i in range(1, len(data)):  # the two layouts in turn, step by step
        for k, tr in trainers.items():
            p = packed[k][i]
            t0 = time.perf_counter()
            m = jax.device_get(tr.step(p))
            dt = time.perf_counter() - t0
            flops = train_flops(mcfg, segment_lengths(p.segment_ids), attended_keys(p.segment_ids))
            per_mb = p.num_rows // len(p.chunk_mask)
            used_rows = int(np.sum(p.chunk_mask)) * per_mb
            timed[k].append((dt, flops, executed_flops(mcfg, used_rows, p.seq_len), m))
            print(
                f"{NAME}: {k} step {i}: {dt:.2f} s, {flops['tokens']} real tokens, "
                f"{flops['total'] / dt / 1e12:.4f} model TFLOP/s, loss {float(m['loss']):.4f}",
                flush=True,
            )
    traj_tokens = [sum(len(t.prompt_tokens) + len(t.response_tokens) for t in b) for b in data]
    pair = [u[0] / r[0] for r, u in zip(timed["recipe"], timed["unshared"], strict=True)]
    unshared_s = [r[0] for r in timed["unshared"]]
    side_by_side = {
        "what": "the same batches packed without shared prompts (train.share_prompts=false), "
        "timed in turn with the recipe's steps in this process",
        "unshared_step_s_median": statistics.median(unshared_s),
        "unshared_trajectory_tokens_per_s": statistics.median(
            n / s for n, s in zip(traj_tokens[1:], unshared_s, strict=True)
        ),
        "unshared_real_tokens_per_step": [r[1]["tokens"] for r in timed["unshared"]],
        "unshared_first_step_s_with_compile": first_s["unshared"],
        "speedup_recipe_over_unshared": {
            "median": statistics.median(pair),
            "min": min(pair),
            "max": max(pair),
        },
    }
    rows = timed["recipe"]
    p = packed["recipe"][1]
    seconds = [r[0] for r in rows]
    tokens = [r[1]["tokens"] for r in rows]
    tflops = statistics.median(r[1]["total"] / r[0] / 1e12 for r in rows)
    per_token = {
        k: sum(r[1][k] for r in rows) / sum(tokens) for k in ("dense", "lm_head", "attention")
    }
    out = {
        **quiet.provenance(load0),
        "wall_s": time.perf_counter() - t_start,
        "machine": f"{jax.devices()[0].platform} ({len(jax.devices())} fake devices, one used), "
        f"jax {jax.__version__}",
        "model": {
            "name": NAME,
            "dir": shown(args.model_dir),
            "family": mcfg.family,
            "layers": mcfg.num_layers,
            "hidden": mcfg.hidden_size,
            "heads": [mcfg.num_heads, mcfg.num_kv_heads, mcfg.resolved_head_dim],
            "mlp": mcfg.intermediate_size,
            "vocab": mcfg.vocab_size,
            "tied_embeddings": mcfg.tie_word_embeddings,
            "params": int(n_params),
            "non_embedding_params": non_embedding_params(mcfg),
            "dtype": mcfg.param_dtype,
            "attention": mcfg.attention,
            "weights": "the real ones, load_hf_params from the directory",
        },
        "recipe": quiet.rel(RECIPE),
        "train_shape": {
            "length_buckets": list(tcfg.length_buckets),
            "packing": tcfg.packing,
            "share_prompts": tcfg.share_prompts,
            "microbatch_tokens": tcfg.microbatch_tokens,
            "logprob_chunk": tcfg.logprob_chunk,
            "prompt_groups": NG,
            "group_size": G,
            "batch_shape": [p.num_rows, p.seq_len],
            "microbatches": len(p.chunk_mask),
            "microbatches_used": [int(np.sum(q.chunk_mask)) for q in packed["recipe"][1:]],
        },
        "trajectories": {
            "prompts": "chat-templated 'What is a + b?' (data.word_arithmetic.problems('+', 1, "
            f"20, {NG}, seed {cfg.seed})), HFTokenizer + encode_prompt, one per group",
            "prompt_tokens": sorted(len(p) for p in prompts),
            "responses": f"random token ids, lognormal lengths (median {RESPONSE_MEDIAN}, "
            f"sigma {RESPONSE_SIGMA}) within [{RESPONSE_MIN}, {cap}]; random logprobs; 1 to "
            f"{G - 1} rewards of 1 a group",
            "response_tokens_median": float(
                np.median([len(t.response_tokens) for b in data[1:] for t in b])
            ),
        },
        "steps_timed": len(rows),
        "first_step_s_with_compile": first_s["recipe"],
        "real_tokens_per_step": tokens,
        "real_token_share": statistics.mean(float(r[3]["real_token_share"]) for r in rows),
        "real_tokens_per_s": statistics.median(n / s for n, s in zip(tokens, seconds, strict=True)),
        "trajectory_tokens_per_step": traj_tokens[1:],
        "trajectory_tokens_per_s": statistics.median(
            n / s for n, s in zip(traj_tokens[1:], seconds, strict=True)
        ),
        "side_by_side": side_by_side,
        "step_s_median": statistics.median(seconds),
        "step_s_min_max": [min(seconds), max(seconds)],
        "model_flops_per_real_token": {**per_token, "total": sum(per_token.values())},
        "model_tflops": tflops,
        "matmul_peak_tflops": peak,
        "matmul_peak_dtype": f"{mcfg.compute_dtype} operands, float32 result, 1024^3",
        "mfu": tflops / peak,
        "executed_tflops": statistics.median(r[2] / r[0] / 1e12 for r in rows),
        "model_over_executed_flops": sum(r[1]["total"] for r in rows) / sum(r[2] for r in rows),
        "rest_of_the_time": rest_of_the_time(mcfg, tcfg.logprob_chunk),
        "formulas": {
            "model_flops": "6 x N x tokens + 6 x V x D x tokens + 6 x L x Nq x Hd x sum over "
            "packed segments of n (n + 1); N = non_embedding_params, V vocab, D hidden, L "
            "layers, Nq query heads, Hd head dim, n a segment's real tokens (causal attention "
            "within the segment; forward + backward = 3 x forward)",
            "executed_flops": "rows x T x (6 x N + 8 x V x D) + 12 x L x Nq x Hd x T^2 x rows "
            "over the used microbatches' rows of T positions (padding, the LM head's "
            "recomputed logits, dense attention's whole T x T)",
            "mfu": "model_tflops / matmul_peak_tflops",
        },
        "units": {
            "real_tokens_per_s": "real (non-padding) positions the step computes per second, "
            "median over the timed steps; a shared prompt counts once",
            "trajectory_tokens_per_s": "prompt and response tokens of the batch's trajectories "
            "per second (a shared prompt counted once per trajectory): the batch a user trains",
            "step_s_median": "seconds from dispatch to metrics on the host",
            "model_flops_per_real_token": "FLOPs, the timed steps' sums over their real tokens",
            "model_tflops": "model FLOPs per second, median over the timed steps, 1e12",
            "matmul_peak_tflops": "float32 1024^3 matmul on one device, best of 20, 1e12 FLOP/s",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    f = out["model_flops_per_real_token"]
    sbs = side_by_side["speedup_recipe_over_unshared"]
    print(
        f"{NAME}: {out['trajectory_tokens_per_s']:.0f} trajectory tokens/s "
        f"({side_by_side['unshared_trajectory_tokens_per_s']:.0f} unshared; recipe/unshared "
        f"step time ratio median {sbs['median']:.2f}x, min {sbs['min']:.2f}, max "
        f"{sbs['max']:.2f}); {out['real_tokens_per_s']:.0f} real tokens/s, "
        f"step {out['step_s_median']:.2f} s "
        f"(min {min(seconds):.2f}, max {max(seconds):.2f}); model FLOPs per real token "
        f"{f['total'] / 1e6:.0f}M (dense {f['dense'] / 1e6:.0f}M, LM head "
        f"{f['lm_head'] / 1e6:.0f}M, attention {f['attention'] / 1e6:.1f}M); "
        f"{tflops:.4f} TFLOP/s of a {peak:.4f} matmul peak: MFU {out['mfu']:.3f}; wrote "
        f"{shown(args.out)} in {out['wall_s']:.0f} s",
        flush=True,
    )
    return 0
