"""Routing replay for mixture-of-experts RL, end to end on 8 fake CPU devices.

A tiny Qwen3-MoE policy trains 3 GRPO steps in ``dora`` mode with its experts sharded over 2
devices on the trainer and inside each rollout group. The engine records every fed token's
experts; the trainer either replays them (``train.routing_replay``) or routes by itself and
reports how often it disagreed. A dense Qwen3 of the same shape gives the numeric mismatch
floor that replay must stay within. Compute is bfloat16, so the engine's paged attention and
the trainer's forward differ in rounding and the router sometimes picks other experts; the
logical clock makes every run bitwise reproducible, so the comparisons are deterministic.
"""

from pathlib import Path

import numpy as np
import pytest

from dora_jax.config import load_config
from dora_jax.pipeline.experiment import build, run

ROOT = Path(__file__).resolve().parents[1]

COMMON = [
    "warm_start.steps=0",
    "eval.num_prompts=0",
    "train.group_size=4",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "rollout.max_new_tokens=24",
    "train.length_buckets=[48]",
    "rollout.num_pages=40",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.attention_bias=false",
    "model.compute_dtype=bfloat16",
    "mesh.trainer.data=1",
    "mesh.trainer.model=2",
    "mesh.rollout.groups=2",
]
MOE = [
    "model.family=qwen3_moe",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
    "mesh.trainer.expert=2",
    "mesh.rollout.expert=2",
]
DENSE = [
    "model.family=qwen3",
    "model.intermediate_size=64",
    "mesh.trainer.devices=0:2",
    "mesh.rollout.devices=4:6",
]


def three_steps(tmp_path: Path, name: str, overrides: list[str]) -> list[dict]:
    cfg = load_config(
        ROOT / "configs" / "default.yaml", [*COMMON, *overrides, f"run_dir={tmp_path / name}"]
    )
    exp = build(cfg, tmp_path / name)
    logs = []
    run(exp, 3, logs.append)
    assert exp.runtime.steps_done == 3
    return [{k: np.asarray(v) for k, v in log.metrics.items()} for log in logs]


def mismatch(steps: list[dict]) -> float:
    """Token-weighted mean of the behavior KL over staleness-0 tokens, all steps."""
    n = sum(float(s["mismatch_tokens"]) for s in steps)
    assert n > 0, "no staleness-0 tokens: nothing measures the engine/trainer mismatch"
    return sum(float(s["mismatch_kl"]) * float(s["mismatch_tokens"]) for s in steps) / n


@pytest.mark.slow
def test_moe_dora_with_and_without_routing_replay(tmp_path):
    replay = three_steps(tmp_path, "replay", [*MOE, "train.routing_replay=true"])
    free = three_steps(tmp_path, "free", [*MOE, "train.routing_replay=false"])
    dense = three_steps(tmp_path, "dense", DENSE)
    for s in replay + free:
        assert float(s["routed_tokens"]) > 0  # the engine's routes reached the trainer
    # replay: the train forward used the engine's experts for every recorded token
    assert all(float(s["routing_diff_share"]) == 0.0 for s in replay)
    # without replay the share is reported, and the bfloat16 router did disagree somewhere
    assert all(0.0 <= float(s["routing_diff_share"]) <= 1.0 for s in free)
    assert max(float(s["routing_diff_share"]) for s in free) > 0
    assert "routing_diff_share" not in dense[0]
    # the engine/trainer mismatch: replay removes the routing part of it, and stays within the
    # dense model's
    assert mismatch(replay) < mismatch(free), (mismatch(replay), mismatch(free))
    assert mismatch(replay) <= mismatch(dense), (mismatch(replay), mismatch(dense))
