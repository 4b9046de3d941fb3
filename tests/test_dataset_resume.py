"""A dataset run resumes exactly: Parquet rows in veRL's layout, shuffled over several epochs,
scored by a reward function from a file in worker processes; stopping after 2 steps and resuming
gives the same params, the same consumed requests and the same reward metrics as 4 steps in a
row, and the failure counts survive the checkpoint."""

import textwrap
from pathlib import Path

import chex
import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dora_jax.checkpoint import RunCheckpointer
from dora_jax.config import load_config
from dora_jax.pipeline.experiment import build, run

ROOT = Path(__file__).resolve().parents[1]
REWARD = textwrap.dedent("""
    def score(response, answer, metadata):
        if len(response) % 5 == 0:
            raise ValueError("a verifier bug, on some responses")
        return {"score": float(len(response) % 2), "level": metadata["extra_info"]["level"]}
""")


@pytest.mark.slow
def test_dataset_run_with_file_reward_resumes_exactly(tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{30 + i}-{3 + i}="}],
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"level": i},
        }
        for i in range(5)
    ]  # 4 steps x 2 prompts: past the first epoch
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    over = [
        "warm_start.steps=0",
        "eval.num_prompts=0",
        "mesh.trainer.devices=0:1",
        "mesh.trainer.data=1",
        "mesh.trainer.model=1",
        "mesh.rollout.devices=1:2",
        "mesh.rollout.groups=1",
        "orchestrator.clock=logical",
        "train.group_size=4",
        "orchestrator.train_batch_prompts=2",
        "orchestrator.rollout_batch_prompts=4",
        "rollout.max_new_tokens=16",
        "train.length_buckets=[48]",
        "logging.progress=false",
        "checkpoint.async_save=false",
        "data.task=parquet",
        f"data.path={tmp_path / 'rows.parquet'}",
        "data.answer_field=reward_model.ground_truth",
        f"data.reward={tmp_path / 'r.py'}:score",
    ]
    cfg = load_config(ROOT / "configs" / "default.yaml", over)

    def make(name):
        return build(cfg, tmp_path / name)

    straight = make("straight")
    first = again = None
    try:
        run(straight, 4)
        first = make("resumed")
        run(first, 2, checkpointer=RunCheckpointer(tmp_path / "ck", async_save=False))
        first.close()
        again = make("resumed")
        RunCheckpointer(tmp_path / "ck").restore_latest(again)
        assert again.source.cursor == first.source.cursor > 0
        assert again.reward.error_counts() == first.reward.error_counts()
        run(again, 2)
    finally:
        for exp in (straight, first, again):
            if exp is not None:
                exp.close()
    chex.assert_trees_all_equal(
        jax.device_get(straight.trainer.export_params()),
        jax.device_get(again.trainer.export_params()),
    )
    ids = [c.request_id for c in straight.runtime.records.consumed]
    assert ids == [c.request_id for c in again.runtime.records.consumed]
    assert [s.reward_metrics for s in straight.grpo.log] == [
        s.reward_metrics for s in again.grpo.log
    ]
    assert [s.rewards for s in straight.grpo.log] == [s.rewards for s in again.grpo.log]
    assert straight.reward.error_counts() == again.reward.error_counts()
    assert straight.source.cursor == again.source.cursor > 5  # into the second epoch
