"""A run with a run directory keeps its history in files, not in memory: the same records and
summary as a run that keeps everything in memory, a checkpoint whose host state does not grow
with the steps, and a resume that cuts the files back to the checkpoint (nothing counted twice).
"""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import TINY as CHECKPOINT_TINY  # the tiny logical-clock run

from dora_jax import state_codec
from dora_jax.checkpoint import RunCheckpointer
from dora_jax.config import load_config
from dora_jax.orchestrator.history import CONSUMED_FILE, RECORDS_FILE, read_history
from dora_jax.orchestrator.records import HISTORY_KINDS, PlanRecord, Summary
from dora_jax.pipeline.experiment import build, run
from dora_jax.report import plot_timeline

ROOT = Path(__file__).resolve().parents[1]
TINY = [*CHECKPOINT_TINY, "eval.num_prompts=0"]  # no evaluation: nothing here reads it


def make(tmp_path, name):
    cfg = load_config(ROOT / "configs" / "default.yaml", TINY)
    return build(cfg, tmp_path / name, warm_start_dir=tmp_path / "warm_start")


def timeless(x):
    """``x`` without the planner's measured milliseconds (wall time, never the same twice)."""
    if isinstance(x, Summary):
        return replace(x, plan_ms_mean=0.0, plan_ms_max=0.0)
    return [replace(p, ms=0.0) if isinstance(p, PlanRecord) else p for p in x]


def history_bytes(exp) -> int:
    """Bytes of the parts of a checkpoint's host state that used to grow with the run: the
    records, the trainer's step logs and the ledger (the rest is the work in flight)."""
    state = exp.state_dict()
    parts = (state["runtime"]["records"], state["grpo"], state["runtime"]["manager"]["status"])
    return len(state_codec.dumps(parts)[0])


def test_streamed_history_equals_memory_and_stays_small(tmp_path):
    memory = make(tmp_path, "memory")
    prompt_lens = {}
    memory.grpo.on_consume.append(
        lambda rid, v, comp: prompt_lens.setdefault(rid, len(comp.prompt.tokens))
    )
    sizes_m = []
    for _ in range(4):
        res_m = run(memory, 1)
        sizes_m.append(history_bytes(memory))
    streamed = make(tmp_path, "streamed")
    assert streamed.stream_history(tmp_path / "streamed") == []
    sizes = []
    for _ in range(4):
        res_s = run(streamed, 1)
        sizes.append(history_bytes(streamed))
    # the same figures and records, read back from the files
    assert timeless(res_s.summary) == timeless(res_m.summary)
    full_m, full_s = res_m.records, res_s.records
    for kind in (*HISTORY_KINDS, "consumed"):
        assert timeless(getattr(full_s, kind)) == timeless(getattr(full_m, kind)), kind
    assert [c.prompt_len for c in full_s.consumed] == [
        prompt_lens[c.request_id] for c in full_m.consumed
    ]
    plot_timeline(full_m, tmp_path / "m.png", title="t")
    plot_timeline(full_s, tmp_path / "s.png", title="t")
    assert (tmp_path / "m.png").read_bytes() == (tmp_path / "s.png").read_bytes()
    # in memory: only what happened since the last published version
    rt = streamed.runtime
    assert len(rt.records.groups) < 0.2 * len(full_m.groups)
    assert rt.records.consumed_count == len(full_m.consumed) and not rt.records.consumed
    assert len(streamed.grpo.log) <= 1 and streamed.grpo.log_start >= 3
    assert "consumed" not in rt.manager.status.values()
    assert rt.manager.state_counts()["consumed"] == len(full_m.consumed)
    # a checkpoint's host state: flat in the steps when streamed, growing when in memory
    flushes, consumed = read_history(tmp_path / "streamed")
    assert len(consumed) == len(full_m.consumed) and len(flushes) >= 4
    # (streamed: the requests in flight in the ledger, an unpublished step; a few kB at most)
    assert max(sizes) < 4000, sizes
    assert sizes_m == sorted(sizes_m) and sizes_m[-1] > 2 * sizes_m[0] > 8 * max(sizes), sizes_m


@pytest.mark.slow  # three builds and a resume: 14 s (the default suite stays under 15 minutes)
def test_resume_cuts_the_history_back_to_the_checkpoint(tmp_path):
    straight = make(tmp_path, "straight")
    straight.stream_history(tmp_path / "straight")
    res_a = run(straight, 5)

    run_dir = tmp_path / "resumed"
    first = make(tmp_path, "resumed")
    first.stream_history(run_dir)
    ck = RunCheckpointer(run_dir / "checkpoints", async_save=False)
    run(first, 2, checkpointer=ck)
    assert ck.steps() == [2]  # named by train step
    run(first, 2)  # past the checkpoint, then "killed": these lines must not count
    lengths = [(run_dir / f).stat().st_size for f in (RECORDS_FILE, CONSUMED_FILE)]

    again = make(tmp_path, "resumed")
    RunCheckpointer(run_dir / "checkpoints").restore_latest(again)
    assert again.stream_history(run_dir, resume=True) == []
    cut = [(run_dir / f).stat().st_size for f in (RECORDS_FILE, CONSUMED_FILE)]
    assert all(c < n for c, n in zip(cut, lengths, strict=True))
    res_b = run(again, 3)
    ids_a = [c.request_id for c in res_a.records.consumed]
    ids_b = [c.request_id for c in res_b.records.consumed]
    assert ids_b == ids_a and len(ids_b) == len(set(ids_b)) == 5 * 2 * 4
    assert timeless(res_b.summary) == timeless(res_a.summary)
    for kind in HISTORY_KINDS:
        assert timeless(getattr(res_b.records, kind)) == timeless(getattr(res_a.records, kind))
    np.testing.assert_array_equal(
        np.asarray(straight.trainer.state.version), np.asarray(again.trainer.state.version)
    )
