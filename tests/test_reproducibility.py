"""The same seed and config twice gives identical metrics and identical params (bitwise, CPU)."""

import chex
import jax

from dora_jax.config import load_config
from dora_jax.pipeline.experiment import build, run

TINY = [
    "warm_start.steps=5",
    "warm_start.batch_size=8",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.group_size=4",
    "rollout.max_new_tokens=48",
    "logging.progress=false",
    "rollout.temperature=1.0",
    "eval.num_prompts=8",
    "orchestrator.clock=logical",
]


def one_run(tmp_path, name):
    cfg = load_config("configs/default.yaml", [*TINY, f"run_dir={tmp_path / name}"])
    exp = build(cfg, tmp_path / name)
    logs = []
    result = run(exp, 3, logs.append)
    return exp, logs, result


def test_same_seed_twice_is_bitwise_identical(tmp_path):
    a, logs_a, res_a = one_run(tmp_path, "a")
    b, logs_b, res_b = one_run(tmp_path, "b")
    chex.assert_trees_all_equal(
        jax.device_get(a.trainer.export_params()), jax.device_get(b.trainer.export_params())
    )
    assert [c.request_id for c in res_a.records.consumed] == [
        c.request_id for c in res_b.records.consumed
    ]
    for la, lb in zip(logs_a, logs_b, strict=True):
        assert la.rewards == lb.rewards
        chex.assert_trees_all_equal(jax.device_get(la.metrics), jax.device_get(lb.metrics))
    # And the run trained: three steps published, none skipped.
    assert a.runtime.steps_done == 3 and a.trainer.version >= 3
    assert all(int(log.metrics["skipped"]) == 0 for log in logs_a)
