"""``data.reward`` reaches the experiment: hand-written responses scored through the reward an
experiment built from a config uses. Every expected pair of values differs from what each of the
other reward functions gives, so a wrong wiring fails (the JSONL ``boxed_math`` case is checked
in ``test_hf_jsonl_run.py``, which builds that experiment anyway)."""

from pathlib import Path

import pytest

from dora_jax.config import load_config
from dora_jax.pipeline.experiment import build

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "warm_start.steps=0",
    "eval.num_prompts=0",
    "mesh.trainer.devices=0:1",
    "mesh.trainer.data=1",
    "mesh.trainer.model=1",
    "mesh.rollout.devices=1:2",
    "mesh.rollout.groups=1",
]
REFERENCE = "23,18,13,8,3#3"  # the built-in task's worked solution of "23-5="
BARE = "#3"  # the right remainder, no scratchpad
PREFIX = "23,18,13,9#1"  # three correct countdown values of five, then a wrong turn


# (bare answer, wrong answer with a correct prefix) under each reward function:
#   exact (remainder after '#'): (1, 0); partial_credit: (1, 0.5 * 3 / 5);
#   string equality: (0, 0); boxed_math: (0, 0)
@pytest.mark.parametrize("reward,want", [("exact", (1.0, 0.0)), ("partial_credit", (1.0, 0.3))])
def test_built_in_task_reward_is_the_configured_one(tmp_path, reward, want):
    cfg = load_config(
        ROOT / "configs" / "default.yaml", [*SMALL, f"data.reward={reward}", f"run_dir={tmp_path}"]
    )
    exp = build(cfg, tmp_path)
    assert exp.reward(REFERENCE, REFERENCE) == 1.0
    got = (exp.reward(BARE, REFERENCE), exp.reward(PREFIX, REFERENCE))
    assert got == pytest.approx(want, abs=1e-12)
    assert exp.reward.errors == 0
