"""The MoE block's two dropless grouped paths (dora_jax.model.moe: ``ragged_dot``, and the
blocked scan used on CPUs) vs a dense per-expert loop, side by side in one run.

    python benchmarks/bench_moe.py [--tokens 2048] [--hidden 256] [--ffn 128] [--repeats 5]

The baseline applies every expert to every token in a ``lax.scan`` over experts, weighting each
token's output by its combine weight (0 where the expert was not chosen): the same result as the
grouped block with ``E / k`` times its expert FLOPs, and one expert's ``[N, f]`` temporaries at a
time. All run the same router (float32 softmax, top-k). JAX lowers ``ragged_dot`` to XLA's
ragged-dot instruction on GPUs and TPUs (not measured here) but, on CPUs, to a dense product of
every row with every group, masked; the blocked path pads each expert's rows to whole blocks and
scans over the blocks. For 8 and 64 experts (top-2) it reports, for the forward pass (rollout)
and the forward + backward pass (train): tokens per second (median of ``repeats`` timed calls
after one warm-up call), the temporary bytes of the compiled program (XLA's
``memory_analysis().temp_size_in_bytes``) and the grouped / loop ratios. Results go to
``benchmarks/results/bench_moe.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dora_jax.config import ModelConfig  # noqa: E402
from dora_jax.model.moe import grouped_experts, moe_param_specs, route  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "bench_moe.json"


def grouped(impl):
    """The model's block with the expert path ``impl`` ("ragged", "blocked" or the "loop"
    baseline)."""

    def fn(lp, x, cfg):
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        chosen, weights = route(lp["router"], xf, cfg)
        y = grouped_experts(lp, xf, chosen, weights, cfg.num_experts, impl=impl)
        return y.reshape(B, T, D), chosen.reshape(B, T, -1)

    return fn


def layer_params(cfg, key):
    specs = moe_param_specs(cfg)
    keys = jax.random.split(key, len(specs))
    return {
        name: 0.05 * jax.random.normal(k, s.shape[1:], jnp.float32)  # one layer: drop L
        for (name, s), k in zip(specs.items(), keys, strict=True)
    }


def measure(fn, args, repeats):
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), temp


def bench_experts(E: int, a: argparse.Namespace, B: int, T: int) -> dict:
    cfg = ModelConfig(
        family="qwen3_moe",
        hidden_size=a.hidden,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        num_experts=E,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.ffn,
    )
    lp = layer_params(cfg, jax.random.key(E))
    x = jax.random.normal(jax.random.key(1), (B, T, a.hidden), jnp.float32)
    impls = {name: grouped(name) for name in ("ragged", "blocked", "loop")}
    outs = {name: jax.jit(lambda lp, x, fn=fn: fn(lp, x, cfg))(lp, x) for name, fn in impls.items()}
    row = {"experts": E, "top_k": a.top_k}
    for name in ("ragged", "blocked"):
        assert bool(jnp.all(outs[name][1] == outs["loop"][1])), "routed differently"
        row[f"max_abs_output_diff_{name}_vs_loop"] = float(
            jnp.abs(outs[name][0] - outs["loop"][0]).max()
        )
    for impl, fn in impls.items():

        def fwd(lp, x, fn=fn):
            return fn(lp, x, cfg)[0]

        def fwd_bwd(lp, x, fn=fn):
            return jax.grad(lambda lp, x: jnp.sum(fn(lp, x, cfg)[0] ** 2), argnums=(0, 1))(lp, x)

        for mode, f in (("forward", fwd), ("forward_backward", fwd_bwd)):
            secs, temp = measure(f, (lp, x), a.repeats)
            row[f"{impl}_{mode}"] = {
                "tokens_per_s": round(B * T / secs, 1),
                "median_ms": round(1e3 * secs, 2),
                "temp_mib": round(temp / 2**20, 2),
            }
            print(
                f"E={E:3d} {impl:7s} {mode:16s} {B * T / secs:10.0f} tokens/s "
                f"{temp / 2**20:8.2f} MiB temp",
                flush=True,
            )
    for mode in ("forward", "forward_backward"):
        lo = row[f"loop_{mode}"]
        for name in ("ragged", "blocked"):
            g = row[f"{name}_{mode}"]
            row[f"{mode}_speedup_{name}_over_loop"] = round(
                g["tokens_per_s"] / lo["tokens_per_s"], 2
            )
            row[f"{mode}_temp_ratio_{name}_over_loop"] = (
                round(g["temp_mib"] / lo["temp_mib"], 2) if lo["temp_mib"] else None
            )
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128, help="each expert's ffn width")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    B, T = 8, a.tokens // 8
    results = {}
    for E in a.experts:
        results[f"E{E}"] = bench_experts(E, a, B, T)
    res = {
        "benchmark": "MoE block: dropless grouped paths (ragged_dot; blocked scan) vs a dense "
        "per-expert loop",
        "units": "tokens_per_s: tokens through one MoE block per second (median of repeats); "
        "temp_mib: compiled temporaries (memory_analysis().temp_size_in_bytes) in MiB",
        "command": "python benchmarks/bench_moe.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": {"tokens": a.tokens, "hidden": a.hidden, "expert_ffn": a.ffn, "dtype": "float32"},
        "repeats": a.repeats,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
