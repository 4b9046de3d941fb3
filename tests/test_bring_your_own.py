"""Bring your own task, end to end through the train command (in process, logical clock): a
reward function in a file outside the package gets each dataset row's metadata (and how the
response ended) and returns a dict whose extra metric lands in ``metrics.jsonl``; the held-out
evaluation reports mean@4 and pass@4 (logged and summarised); Weights & Biases under
``WANDB_MODE=offline`` writes a local run with the same steps and metric names as
``metrics.jsonl`` and ``eval.jsonl``, and each step's sampled completions as a table."""

import json
import os
import textwrap
from pathlib import Path

import pytest
from wandb_records import history  # tests/wandb_records.py

from dora_jax.config import load_config
from dora_jax.main import train
from dora_jax.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "warm_start.steps=0",
    "mesh.trainer.devices=0:1",
    "mesh.trainer.data=1",
    "mesh.trainer.model=1",
    "mesh.rollout.devices=1:2",
    "mesh.rollout.groups=1",
    "orchestrator.clock=logical",
    "train.total_steps=2",
    "train.group_size=4",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "rollout.max_new_tokens=16",
    "train.length_buckets=[48]",
    "logging.progress=false",
    "logging.tensorboard=false",
]

REWARD = textwrap.dedent('''
    import os

    def score(response, answer, metadata):
        """Pays the row's own weight when it is told how the response ended; says whether the
        row's tag arrived, and from where."""
        ended = metadata["finish_reason"]
        return {"score": metadata["weight"] * (ended in ("eos", "length")),
                "tag_seen": float(metadata["tag"] == "mine"), "pid": os.getpid(),
                "cut": float(ended == "length")}
''')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    (d / "my_reward.py").write_text(REWARD)
    rows = [
        {"prompt": f"{10 + i}-{2 + i % 3}=", "answer": str(i), "weight": 0.25, "tag": "mine"}
        for i in range(12)
    ]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = d / "run"
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [
            *TINY,
            "data.task=jsonl",
            f"data.path={d / 'rows.jsonl'}",
            f"data.reward={d / 'my_reward.py'}:score",
            f"eval.path={d / 'rows.jsonl'}",
            "eval.num_prompts=3",
            "eval.samples_per_prompt=4",
            "eval.every_steps=1",
            "logging.wandb=true",
            "logging.wandb_project=byo",
            "logging.wandb_tags=[test]",
            f"run_dir={out}",
        ],
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    try:
        assert train(cfg) == 0
    finally:
        mp.undo()
    return out


def test_file_reward_gets_metadata_and_its_metric_is_logged(run_dir):
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["reward"] == 0.25  # the row's weight, through the metadata
        assert m["reward/tag_seen"] == 1.0
        assert 0.0 < m["reward/cut"] <= 1.0  # a random policy's responses hit the token limit
        assert m["reward/pid"] != os.getpid()  # scored in a worker process
        assert m["reward_errors"] == 0 and m["reward_errors/timeout"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["reward_errors_by_kind"] == {
        "timeout": 0,
        "exception": 0,
        "invalid": 0,
        "crash": 0,
    }


def test_eval_reports_mean_and_pass_at_4(run_dir):
    evals = read_metrics(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2]
    for e in evals:
        assert e["eval/mean@4"] == 0.25  # every sample pays the weight; none is "solved"
        assert e["eval/pass@1"] == 0.0 and e["eval/pass@4"] == 0.0
    held = json.loads((run_dir / "summary.json").read_text())["held_out_eval"]
    assert set(held[-1]["at_k"]) == {"mean@4", "pass@1", "pass@2", "pass@4"}
    assert "held-out mean@4" in (run_dir / "summary.md").read_text()


def _names(row: dict) -> set[str]:
    """Logged names: wandb internals dropped, a histogram's parts folded back to its name."""
    out = set()
    for key in row:
        if key.startswith("_"):
            continue
        head, _, tail = key.rpartition("/")
        out.add(head if tail in ("values", "bins", "_type", "packedBins") else key)
    return out


def test_wandb_offline_run_has_the_same_steps_and_names(run_dir):
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history(run_file)
    lines = read_metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["_step"] for r in train_rows] == [m["step"] for m in lines]
    for row, line in zip(train_rows, lines, strict=True):
        names = {n for n in _names(row) if n.partition("/")[0] not in ("eval", "samples")}
        assert names == set(line) - {"step"}
        # the step's sampled completions (logging.samples_per_step, 2), as a table
        assert row["samples/_type"] == "table-file" and row["samples/nrows"] == 2
        assert row["reward/tag_seen"] == line["reward/tag_seen"] and row["loss"] == line["loss"]
    eval_names = set(read_metrics(run_dir / "eval.jsonl")[0]) - {"step"}
    eval_steps = sorted(r["_step"] for r in rows if "eval/mean@4" in r)
    assert eval_steps == [0, 1, 2]
    assert all(
        {n for n in _names(r) if n.startswith("eval/")} == eval_names
        for r in rows
        if "eval/mean@4" in r
    )
