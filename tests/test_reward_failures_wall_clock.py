"""A verifier that hangs past ``data.reward_timeout_s``, one that raises and one that returns a
string, on the wall clock: the run completes, each kind is counted (metrics and summary), and
the rollout groups kept stepping while the hung verifier was waited for (the engine steps' and
the reward calls' timestamps, on the run's clock)."""

import json
import textwrap
from pathlib import Path

import pytest

from dora_jax.config import load_config
from dora_jax.pipeline.experiment import build, run
from dora_jax.pipeline.observers import HeldOutEval, MetricsLog
from dora_jax.pipeline.run_report import write_run_report

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = textwrap.dedent("""
    import time

    def verify(response, answer, metadata):
        if metadata["kind"] == "slow":
            time.sleep(30)  # far past the timeout: the worker is stopped
        if metadata["kind"] == "raise":
            raise RuntimeError("verifier bug")
        return "correct"  # junk: not a number
""")


@pytest.mark.slow  # long: the default run stays under its time limit
def test_hung_raising_and_junk_verifiers_never_stall_the_run(tmp_path):
    (tmp_path / "verifier.py").write_text(VERIFIER)
    rows = [
        {"prompt": f"{20 + i}-3=", "answer": "1", "kind": k}
        for i, k in enumerate(["slow", "raise", "junk"])
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [
            "warm_start.steps=0",
            "eval.num_prompts=0",
            "mesh.trainer.devices=0:1",
            "mesh.trainer.data=1",
            "mesh.trainer.model=1",
            "mesh.rollout.devices=1:3",
            "mesh.rollout.groups=2",
            "orchestrator.clock=wall",
            "orchestrator.stall_s=120",
            "train.group_size=4",
            "orchestrator.train_batch_prompts=3",
            "orchestrator.rollout_batch_prompts=3",
            "rollout.max_new_tokens=64",
            "rollout.decode_steps=1",
            "train.length_buckets=[96]",
            "logging.progress=false",
            "logging.tensorboard=false",
            "data.task=jsonl",
            f"data.path={tmp_path / 'rows.jsonl'}",
            "data.shuffle=false",
            f"data.reward={tmp_path / 'verifier.py'}:verify",
            "data.reward_timeout_s=1.0",
            "data.reward_workers=2",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    run_dir = tmp_path / "run"
    exp = build(cfg, run_dir)
    try:
        metrics = MetricsLog(exp, run_dir, resume=False)
        # RBS = TBS = 3 rows, in file order: every step holds one prompt of each kind
        result = run(exp, 3, observers=(metrics,))
        metrics.close()
        write_run_report(exp, result, HeldOutEval(exp, run_dir, cfg, False), run_dir, 1.0, 0.0)
        pool_spans = list(exp.reward.pool.spans)
    finally:
        exp.close()
    assert exp.runtime.steps_done == 3
    assert all(r == 0.0 for log in exp.grpo.log for r in log.rewards)
    counts = exp.reward.error_counts()
    assert counts == {"timeout": 12, "exception": 12, "invalid": 12, "crash": 0}  # 4 samples x 3
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert {k: last[f"reward_errors/{k}"] for k in counts} == counts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["reward_errors_by_kind"] == counts
    # while a hung call was waited for, the rollout groups kept taking engine steps
    hung = sorted((t0, t1) for kind, t0, t1 in pool_spans if kind == "timeout")
    assert hung and all(t1 - t0 >= 1.0 for t0, t1 in hung)
    engine_steps = [s for s in result.records.spans if s.activity in ("prefill", "decode")]
    inside = [[s for s in engine_steps if t0 <= s.t0 and s.t1 <= t1] for t0, t1 in hung]
    assert max(len(x) for x in inside) >= 3, (hung, [len(x) for x in inside])
