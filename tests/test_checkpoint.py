"""Checkpoints: exact resume with requests in flight (chex, bitwise), a corrupt checkpoint falls
back to the previous one, a changed model shape is refused naming the field, and a run killed
with SIGTERM mid-rollout resumes with no prompt group lost or consumed twice."""

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import pytest
from reliability_cases import expect  # tests/reliability_cases.py

from dora_jax.checkpoint import CheckpointError, RunCheckpointer
from dora_jax.config import ConfigError, load_config
from dora_jax.pipeline.experiment import build, run

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "warm_start.steps=5",
    "warm_start.batch_size=8",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.group_size=4",
    "rollout.max_new_tokens=48",
    "logging.progress=false",
    "checkpoint.async_save=false",
    "eval.num_prompts=8",
    "orchestrator.clock=logical",
]


def make(tmp_path, name, *extra):
    cfg = load_config(ROOT / "configs" / "default.yaml", [*TINY, *extra])
    return build(cfg, tmp_path / name, warm_start_dir=tmp_path / "warm_start")


def test_stop_resume_equals_uninterrupted(tmp_path):
    straight = make(tmp_path, "straight")
    run(straight, 4)

    first = make(tmp_path, "resumed")
    ck = RunCheckpointer(tmp_path / "resumed" / "ckpt", async_save=False)
    run(first, 2, checkpointer=ck)
    assert first.backend.live_requests() > 0  # requests in flight

    again = make(tmp_path, "resumed")
    RunCheckpointer(tmp_path / "resumed" / "ckpt").restore_latest(again)
    assert again.runtime.steps_done == 2
    run(again, 2)
    chex.assert_trees_all_equal(
        jax.device_get(straight.trainer.export_params()),
        jax.device_get(again.trainer.export_params()),
    )
    ids = [c.request_id for c in straight.runtime.records.consumed]
    assert ids == [c.request_id for c in again.runtime.records.consumed]
    assert len(ids) == len(set(ids)) == 4 * 2 * 4  # steps x TBS x G, none twice
    assert again.runtime.records.summary().reprefill_tokens == 0  # KV came back with them
    # every step's metrics, the cumulative counters (undecodable_tokens) included
    chex.assert_trees_all_equal(
        [jax.device_get(s.metrics) for s in straight.grpo.log],
        [jax.device_get(s.metrics) for s in again.grpo.log],
    )


@pytest.mark.slow  # four builds: 31 s (the default suite stays under 15 minutes)
def test_corrupt_latest_falls_back_and_shape_change_is_refused(tmp_path, caplog):
    exp = make(tmp_path, "run")
    ck = RunCheckpointer(tmp_path / "run" / "ckpt", async_save=False)
    run(exp, 1, checkpointer=ck)
    run(exp, 1, checkpointer=ck)
    first, latest = ck.steps()
    for f in (tmp_path / "run" / "ckpt" / str(latest) / "host").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[:7])  # truncate every file of one item
    resumed = make(tmp_path, "run")
    again = RunCheckpointer(tmp_path / "run" / "ckpt", async_save=False)
    assert again.restore_latest(resumed) == first
    assert "unusable" in caplog.text
    # the unreadable one is moved aside, so the resumed run's save at that tick is its own
    (moved,) = again.moved_aside
    assert moved.parent == tmp_path / "run" / "unusable_checkpoints"
    run(resumed, 1, checkpointer=again)
    assert again.steps() == [first, latest]

    bigger = make(tmp_path, "run2", "model.hidden_size=96", "model.intermediate_size=128")
    with pytest.raises(
        ConfigError,
        match=r"^model\.hidden_size: the checkpoint has 64 but the "
        r"config says 96",
    ):
        RunCheckpointer(tmp_path / "run" / "ckpt").restore_latest(bigger)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        RunCheckpointer(tmp_path / "empty").restore_latest(resumed)


@pytest.mark.slow  # two training subprocesses: about 2-4 minutes on 2 cores
@pytest.mark.parametrize("clock", ["logical", "wall"])
def test_sigterm_mid_rollout_then_resume(tmp_path, clock):
    # on the wall clock the tiny run's steps take a few hundredths of a second: with 6 of them
    # the run could end before the signal reached it (the test raced), so it runs 40
    total = 6 if clock == "logical" else 40
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        f"run_dir={run_dir}",
        *TINY,
        f"train.total_steps={total}",
        "logging.tensorboard=false",
        f"orchestrator.clock={clock}",
    ]
    proc = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    expect("sigterm-mid-run", out + err, proc.returncode)
    assert "Traceback" not in err
    partial = json.loads((run_dir / "summary.json").read_text())
    assert partial["extra"]["stopped_early"] and partial["steps"] < total

    # the command it printed, as printed: the checkpoint's config needs no repeated overrides
    hint = shlex.split(re.search(r"continue with: (.+)", out).group(1))
    assert hint[:3] == ["python", "launch/train.py", "--resume"]
    resumed = subprocess.run(
        [sys.executable, *hint[1:]], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    final = json.loads((run_dir / "summary.json").read_text())
    ids = final["extra"]["consumed_request_ids"]
    assert final["steps"] == total and not final["extra"]["stopped_early"]
    assert len(ids) == len(set(ids)) == total * 2 * 4  # nothing lost, nothing consumed twice
    assert set(partial["extra"]["consumed_request_ids"]) <= set(ids)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, total + 1))
    # held-out evaluations: before the first step and after the last, none repeated
    evals = (run_dir / "eval.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in evals] == [0, total]


def test_the_no_space_message_shows_free_below_needed():
    """Half a MiB free against a little less needed (plus the 10% margin) read "0.5 MiB free,
    the checkpoint needs about 0.5 MiB": the figures now show which is smaller."""
    from dora_jax.checkpoint import no_space

    pattern = re.compile(
        r"no space left: ([\d,.]+) (KiB|MiB) free, the checkpoint needs about [\d,.]+ \2 "
        r"\(([\d,.]+) \2 with a 10% margin\)"
    )
    assert no_space(2**30, 2**20) is None
    mib = 2**20
    cases = [(mib // 2, int(0.48 * mib)), (50_000, 49_000), (int(20.5 * mib), 19 * mib)]
    for free, need in [*cases, (10 * mib - 1, int(9.5 * mib))]:
        text = no_space(free, need)
        got = pattern.fullmatch(text)
        assert got, text
        assert float(got[1].replace(",", "")) < float(got[3].replace(",", "")), text
    assert "KiB" in no_space(50_000, 49_000) and "MiB" in no_space(20 * mib, 19 * mib)


def test_asyncio_reports_of_orbax_write_tasks_are_left_out():
    """After a failed save, asyncio reports orbax's abandoned write tasks ("Task exception was
    never retrieved", with the traceback): the run's filter leaves those out, and only those."""
    import logging
    import sys

    from dora_jax.checkpoint import _QuietSaveFailures

    ns: dict = {}
    exec(compile("def write():\n    raise ValueError('disk')\n", "/x/orbax/fake.py", "exec"), ns)
    try:
        ns["write"]()
    except ValueError:
        from_orbax = sys.exc_info()
    try:
        raise KeyError("user")
    except KeyError:
        from_user = sys.exc_info()

    def record(exc_info, msg="Task exception was never retrieved"):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), exc_info)

    quiet = _QuietSaveFailures()
    assert not quiet.filter(record(from_orbax))
    assert not quiet.filter(record(None, "future: <Task ... orbax-checkpoint-tmp ...>"))
    assert quiet.filter(record(from_user))  # someone else's task: still reported
    assert quiet.filter(record(None, "an unrelated asyncio error"))
