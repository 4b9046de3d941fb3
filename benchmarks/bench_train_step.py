"""The train step on padded and on packed batches, side by side: real tokens per second.

    python benchmarks/bench_train_step.py [--steps 40] [--big-steps 3]
    python benchmarks/bench_train_step.py --case smollm2 [--model-dir DIR] [--smollm2-steps 8]

Two synthetic cases (the default, ``--case synthetic``), each timed on the same batches, one
after the other in this process, three ways: ``padded`` (``train.packing=rows``: one trajectory
per row, padded to the batch's bucket), ``packed_ladder`` (``train.packing=tokens``: several per
row, the row count from the ladder, a compilation per shape met) and ``packed`` (the same
packing in microbatches of ``train.microbatch_tokens`` per device, the step looping over those
that hold samples: one compilation per bucket; the default config's path):

- ``default_task``: the default config's policy, trainer mesh (data 2 x model 2 on fake CPU
  devices), batch (8 prompt groups x 8 samples) and buckets (96, 192), on the built-in task's
  trajectories as the warm-start teacher writes them (half bare answers, half scratchpads: the
  length mix of the default run's first steps).
- ``qwen2.5-0.5b_shape``: Qwen2.5-0.5B's layer shape (hidden 896, 14 heads, 2 KV heads, MLP
  4864) with 2 of its 24 layers and a 16,384-token vocabulary (the full 151,936 would make the
  LM head most of a CPU step), blockwise attention as the GPU presets use, on one device, 2
  prompt groups x 4 samples with long-tailed response lengths (lognormal, p99/median > 10,
  capped at 1,000 tokens), buckets 256/512/1024 and microbatches of 1,024 tokens.

Every batch shape is compiled once before the timing; the step's seconds are from dispatch to
the metrics on the host. Reported per case and packing: ``real_token_share`` (real tokens over
the positions the step computes), ``real_tokens_per_s`` (the median over the timed steps), the
shapes met, and
``model_tflops`` per second: 6 x (params) x (real tokens) / seconds, the useful FLOP rate,
against ``matmul_peak_tflops``, a float32 matmul measured on the same machine. Then
``speedup_packed_over_padded`` in real tokens per second. Writes
``benchmarks/results/bench_train_step.json`` with the command, commit and load averages.

``--case smollm2`` (or ``--model smollm2-135m-instruct``): SmolLM2-135M-Instruct's real weights
from ``--model-dir`` (default ``models/smollm2-135m-instruct``; a missing one exits naming
``python launch/prepare_model.py smollm2-135m-instruct``) at the train shape of
``configs/recipes/smollm2-add-cpu.yaml``, on trajectories of its lengths, ``--smollm2-steps``
timed steps after one that compiles; model FLOPs counted for the model (non-embedding params, the
LM head once, causal attention over the packed segments) against the matmul peak. It lives in
``benchmarks/train_step_real.py`` (the formula is there) and writes
``benchmarks/results/bench_train_step_smollm2.json``.

Run it alone on a quiet machine (it waits for one: ``--max-load``, ``--wait``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas  # noqa: E402

fake_cpu_devices(8)
limit_malloc_arenas()

import quiet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_train_step.json"


def matmul_peak_tflops(n: int = 1024, reps: int = 20, dtype: str = "float32") -> float:
    """The best ``n x n x n`` matmul rate of one device, in TFLOP/s, with ``dtype`` operands
    (bfloat16: into a float32 result, the form the model's products take on a CPU)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), getattr(jnp, dtype))
    f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def default_task_batches(cfg, n_batches: int):
    """Trajectories of the built-in task as the warm-start teacher writes them."""
    import numpy as np

    from dora_jax.data.arithmetic import ArithmeticTask
    from dora_jax.model.tokenizer import load_tokenizer
    from dora_jax.train.batch import Trajectory

    tok = load_tokenizer("char")
    task = ArithmeticTask(cfg.seed, cfg.data.median_steps)
    G, NG = cfg.train.group_size, cfg.orchestrator.train_batch_prompts
    rng = np.random.default_rng(0)
    out = []
    for b in range(n_batches):
        batch = []
        for g in range(NG):
            for m in range(G):
                index = (b * NG + g) * G + m
                prompt, response = task.demonstration(index, cfg.warm_start.direct_frac)
                p = tok.encode(prompt)
                r = tok.encode(response)[: cfg.rollout.max_new_tokens]
                lp = -rng.random(len(r)).astype(np.float32)
                batch.append(Trajectory(p, r, lp, float(m % 2), 0, (b, g)))
        out.append(batch)
    return out


def long_tail_batches(vocab: int, groups: int, G: int, n_batches: int):
    import numpy as np

    from dora_jax.train.batch import Trajectory

    rng = np.random.default_rng(1)
    out = []
    for b in range(n_batches):
        batch = []
        for g in range(groups):
            P = int(rng.integers(32, 96))
            prompt = rng.integers(0, vocab, P)
            for m in range(G):
                R = int(min(1000 - P, max(1, rng.lognormal(np.log(40), 1.3))))
                r = rng.integers(0, vocab, R)
                lp = -rng.random(R).astype(np.float32)
                batch.append(Trajectory(prompt, r, lp, float(m % 2), 0, (b, g)))
        out.append(batch)
    return out


def time_case(model_cfg, train_cfg, mesh, batches, params, steps: int) -> dict:
    import jax
    import numpy as np

    from dora_jax.train import Trainer

    tr = Trainer(model_cfg, train_cfg, mesh=mesh, params=params)
    packed = [tr.pack(b, version=0) for b in batches]
    shapes = sorted({(p.num_rows, p.seq_len) for p in packed})
    for shape in shapes:  # compile every shape first
        jax.block_until_ready(tr.step(next(p for p in packed if (p.num_rows, p.seq_len) == shape)))
    rates, seconds, shares = [], [], []
    for p in packed[:steps]:
        real = int(np.count_nonzero(p.segment_ids))
        t0 = time.perf_counter()
        m = jax.device_get(tr.step(p))
        dt = time.perf_counter() - t0
        rates.append(real / dt)
        seconds.append(dt)
        shares.append(float(m["real_token_share"]))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rate = statistics.median(rates)
    return {
        "real_token_share": statistics.mean(shares),
        "real_tokens_per_s": rate,
        "step_s_median": statistics.median(seconds),
        "step_s_min_max": [min(seconds), max(seconds)],
        "steps_timed": len(rates),
        "shapes": [list(s) for s in shapes],
        "params": int(n_params),
        "model_tflops": 6 * n_params * rate / 1e12,
    }


def run_case(name, model_cfg, train_cfg, mesh, batches, steps) -> dict:
    import jax

    from dora_jax.model import init_params

    params = init_params(model_cfg, jax.random.key(0))
    variants = {
        "padded": dataclasses.replace(train_cfg, packing="rows", microbatch_tokens=0),
        "packed_ladder": dataclasses.replace(train_cfg, packing="tokens", microbatch_tokens=0),
        "packed": dataclasses.replace(train_cfg, packing="tokens"),
    }
    if not train_cfg.microbatch_tokens:  # the config's packed path is the ladder
        del variants["packed_ladder"]
    out = {}
    for kind, tcfg in variants.items():
        t0 = time.perf_counter()
        out[kind] = time_case(model_cfg, tcfg, mesh, batches, params, steps)
        out[kind]["microbatch_tokens"] = tcfg.microbatch_tokens
        print(f"{name}: {kind}: {out[kind]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["speedup_packed_over_padded"] = (
        out["packed"]["real_tokens_per_s"] / out["padded"]["real_tokens_per_s"]
    )
    return out


CASES = ("synthetic", "smollm2")  # synthetic: default_task and qwen2.5-0.5b_shape
MODEL_CASES = {"smollm2-135m-instruct": "smollm2"}  # --model NAME: the case of that model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=CASES, help="default: synthetic (or --model's)")
    p.add_argument("--model", choices=sorted(MODEL_CASES), help="a real model's case")
    p.add_argument("--model-dir", type=Path, help="smollm2: default models/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=40, help="timed steps, default task")
    p.add_argument("--big-steps", type=int, default=3, help="timed steps, 0.5B shape")
    p.add_argument("--smollm2-steps", type=int, default=8, help="timed steps, smollm2")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/bench_train_step[_CASE]")
    quiet.add_arguments(p)
    a = p.parse_args(argv)
    by_model = MODEL_CASES.get(a.model)
    if by_model and a.case not in (None, by_model):
        p.error(f"--model {a.model} is --case {by_model}, not {a.case}")
    a.case = by_model or a.case or "synthetic"
    if a.case != "smollm2" and a.model_dir is not None:
        p.error("--model-dir is for --case smollm2")
    if a.smollm2_steps < 1:
        p.error("--smollm2-steps must be at least 1")
    if a.case == "smollm2":
        import train_step_real

        a.model_dir = a.model_dir or ROOT / train_step_real.DEFAULT_DIR
        a.out = a.out or train_step_real.RESULTS
    a.out = a.out or RESULTS
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.case == "smollm2":
        import train_step_real

        return train_step_real.main(a, matmul_peak_tflops)
    load0 = quiet.wait_for_quiet(a.max_load, a.wait)

    import jax

    from dora_jax.config import ModelConfig, TrainConfig, load_config
    from dora_jax.mesh import make_mesh

    cfg = load_config(ROOT / "configs" / "default.yaml", [])
    tm = cfg.mesh.trainer
    trainer_devices = jax.devices()[:4]
    mesh = make_mesh(trainer_devices, tm.data, tm.model)
    figures = {
        "matmul_peak_tflops": matmul_peak_tflops(),
        "default_task": run_case(
            "default_task", cfg.model, cfg.train, mesh, default_task_batches(cfg, a.steps), a.steps
        ),
    }
    big = ModelConfig(
        family="qwen2",
        vocab_size=16384,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=2,
        num_heads=14,
        num_kv_heads=2,
        attention="blockwise",
        attention_block=256,
        tie_word_embeddings=True,
    )
    big_train = TrainConfig(group_size=4, length_buckets=(256, 512, 1024), microbatch_tokens=1024)
    figures["qwen2.5-0.5b_shape"] = run_case(
        "qwen2.5-0.5b_shape",
        big,
        big_train,
        make_mesh(jax.devices()[:1], 1, 1),
        long_tail_batches(big.vocab_size, 2, 4, a.big_steps),
        a.big_steps,
    )
    for case in ("default_task", "qwen2.5-0.5b_shape"):
        for kind in ("padded", "packed_ladder", "packed"):
            if kind not in figures[case]:
                continue
            c = figures[case][kind]
            c["share_of_matmul_peak"] = c["model_tflops"] / figures["matmul_peak_tflops"]
    figures.update(quiet.provenance(load0))
    figures["units"] = {
        "real_tokens_per_s": "prompt and response tokens of the batch's trajectories per second",
        "model_tflops": "6 x params x real tokens per second, 1e12 FLOP/s",
        "matmul_peak_tflops": "float32 1024^3 matmul on one device, best of 20, 1e12 FLOP/s",
        "step_s_median": "seconds from dispatch to metrics on the host",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(figures, indent=2) + "\n")
    d, b = figures["default_task"], figures["qwen2.5-0.5b_shape"]
    print(
        f"default task: real-token share {d['padded']['real_token_share']:.2f} -> "
        f"{d['packed']['real_token_share']:.2f}, packed/padded "
        f"{d['speedup_packed_over_padded']:.2f}x in real tokens/s; 0.5B shape: "
        f"{b['padded']['real_token_share']:.2f} -> "
        f"{b['packed']['real_token_share']:.2f}, {b['speedup_packed_over_padded']:.2f}x; "
        f"wrote {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
