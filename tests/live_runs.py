"""Runs of the train command in a subprocess, for tests that act on them while they run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

# the tiny default model in ``dora`` mode, K=2, two prompt groups of 4 per step, the trainer on
# devices 0-1 (process 0's): what the multi-process tests add their rollout layout to
TINY_RUN = [
    "warm_start.steps=20",
    "eval.num_prompts=0",
    "logging.progress=false",
    "orchestrator.staleness_k=2",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.group_size=4",
    "rollout.max_new_tokens=64",
    "mesh.trainer.devices=0:2",
    "mesh.trainer.data=1",
    "mesh.trainer.model=2",
]


def start_until_steps(args: list[str], cwd: Path, run_dir: Path, steps: int) -> subprocess.Popen:
    """Start ``args`` (its own session, text pipes) and return once ``run_dir/metrics.jsonl``
    holds ``steps`` lines (bounded: 600 s); the run must still be going."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    return proc
