"""Where the GPU train step's time goes: the ``train`` section of ``launch/gpu_check.py`` (the GRPO
step at Qwen2.5-0.5B's shape, 4 rows of 4096 tokens) with one setting changed at a time.

On the GPU machine, from the repository root::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 launch/gpu_train_probe.py --out DIR

and at tiny shapes on the CPU (a smoke test)::

    PYTHONPATH=. python3 launch/gpu_train_probe.py --cpu-smoke --out /tmp/probe

Each variant is timed as the check times its step (warm-up steps, then the median of the timed
ones) and printed as it finishes; ``gpu_train_probe.json`` in DIR is rewritten after each one.
A variant that would start after ``--max-seconds`` is recorded as skipped; one that raises is
recorded with its error and the probe goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import peak_flops, random_trajectories, train_flops_per_token  # noqa: E402
from gpu_check_plan import gpu_plan, smoke_plan  # noqa: E402

# name -> (ModelConfig changes, TrainConfig changes), against the check's own step
VARIANTS: dict[str, tuple[dict, dict]] = {
    "as_check": ({}, {}),
    "remat_none_seq_chunk_0_cudnn": ({"remat": "none", "seq_chunk": 0, "attention": "cudnn"}, {}),
    "remat_none": ({"remat": "none"}, {}),
    "seq_chunk_0": ({"seq_chunk": 0}, {}),
    "cudnn": ({"attention": "cudnn"}, {}),
    "remat_none_seq_chunk_0": ({"remat": "none", "seq_chunk": 0}, {}),
    "no_fp32_master": ({}, {"fp32_master_weights": False}),
    "attention_block_512": ({"attention_block": 512}, {}),
}


def run_variant(plan, seq: int, model_changes: dict, train_changes: dict, repeats: int) -> dict:
    from dora_jax.config import ModelConfig, TrainConfig
    from dora_jax.train import Trainer

    fields = dict(plan.train_model, param_dtype="bfloat16", compute_dtype="bfloat16")
    fields["remat"] = "nested"
    fields.update(model_changes)
    cfg = ModelConfig(**fields)
    tfields = dict(
        lr=1e-6, fp32_master_weights=True, length_buckets=(seq,), group_size=plan.train_rows
    )
    tfields.update(train_changes)
    trainer = Trainer(cfg, TrainConfig(**tfields))
    batch = trainer.pack(random_trajectories(cfg.vocab_size, seq, plan.train_rows))
    t0 = time.perf_counter()
    trainer.step(batch)
    jax.block_until_ready(trainer.state.params)
    first_s = time.perf_counter() - t0
    trainer.step(batch)
    jax.block_until_ready(trainer.state.params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        metrics = trainer.step(batch)
        jax.block_until_ready(trainer.state.params)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = batch.num_rows * batch.seq_len
    peak = peak_flops(jax.devices()[0].device_kind)
    achieved = train_flops_per_token(cfg, seq) * tokens / step_s
    return dict(
        first_step_s=first_s,
        step_s=step_s,
        step_s_min=min(times),
        step_s_max=max(times),
        tokens_per_s=tokens / step_s,
        model_tflops_per_s=achieved / 1e12,
        mfu=achieved / peak if peak else None,
        loss=float(metrics["loss"]),
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; smoke 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--only", action="append", default=[], help="variant names to run")
    a = p.parse_args(argv)
    if not a.cpu_smoke and jax.default_backend() != "gpu":
        print(f"gpu_train_probe: backend {jax.default_backend()!r}, not a GPU", file=sys.stderr)
        return 3
    plan = smoke_plan() if a.cpu_smoke else gpu_plan()
    seq = a.seq or plan.train_lengths[0]
    os.makedirs(a.out, exist_ok=True)
    out = dict(
        command=" ".join(sys.argv),
        jax_version=jax.__version__,
        device=str(jax.devices()[0].device_kind),
        seq_len=seq,
        rows=plan.train_rows,
        model=plan.train_model,
        load_average_before=[round(x, 2) for x in os.getloadavg()],
        variants={},
    )
    start = time.perf_counter()
    for name, (mc, tc) in VARIANTS.items():
        if a.only and name not in a.only:
            continue
        row: dict = dict(model_changes=mc, train_changes=tc)
        if time.perf_counter() - start > a.max_seconds:
            row["status"] = "skipped: --max-seconds spent"
        else:
            try:
                row.update(run_variant(plan, seq, mc, tc, a.repeats), status="ok")
            except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                row["status"] = f"error: {type(e).__name__}: {e}"[:2000]
                row["traceback"] = traceback.format_exc()[-3000:]
        out["variants"][name] = row
        out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        shown = {k: v for k, v in row.items() if k not in ("traceback",)}
        print(name, json.dumps(shown, default=str), flush=True)
        with open(os.path.join(a.out, "gpu_train_probe.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
