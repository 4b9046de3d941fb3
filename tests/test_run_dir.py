"""The run directory's lock and logs (dora_jax/run_dir.py)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from dora_jax.run_dir import RunDirBusy, RunDirError, RunDirLock, create, cut_jsonl, start_over


def test_the_lock_refuses_a_second_owner_and_is_released(tmp_path):
    with RunDirLock(tmp_path) as lock:
        owner = json.loads((tmp_path / ".lock").read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        assert lock.took_over is None
        with pytest.raises(RunDirBusy, match=rf"in use by another run \(pid {os.getpid()} on "):
            RunDirLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()
    with RunDirLock(tmp_path):  # free again
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    with RunDirLock(tmp_path) as lock:
        assert lock.took_over is not None and f"pid {pid}" in lock.took_over


def test_a_lock_held_by_another_process_is_refused(tmp_path):
    code = (
        "import sys, time; from dora_jax.run_dir import RunDirLock; "
        f"l = RunDirLock({str(tmp_path)!r}); l.acquire(); print('held', flush=True); "
        "sys.stdin.readline(); l.release()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.communicate("\n", timeout=60)
    with RunDirLock(tmp_path) as lock:
        assert lock.took_over is None  # the holder removed its file on release


def test_cut_jsonl_keeps_each_step_once_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1}\n{"step": 2, "a": 1}\n{"step": 3}\n{"step": 2, "a": 2}\n{"step": 4}\n{"ste'
    )
    assert cut_jsonl(path, 3) == 3
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1},
        {"step": 2, "a": 1},
        {"step": 3},
    ]
    assert cut_jsonl(path, 3) == 0 and cut_jsonl(tmp_path / "none.jsonl", 3) == 0


def test_cut_jsonl_keeps_each_steps_block_of_lines_once(tmp_path):
    """A log of several lines per step (samples.jsonl): a step's first run of lines stays, a
    later repeat of it goes; ``steps`` keeps only the steps named (eval_samples.jsonl keeps the
    evaluations eval.jsonl kept)."""
    path = tmp_path / "samples.jsonl"
    rows = [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (1, "c"), (3, "a"), (3, "b"), (4, "a")]
    text = "".join(json.dumps({"step": s, "x": x}) + "\n" for s, x in rows)
    path.write_text(text + '{"step": 4, "x"')
    assert cut_jsonl(path, 3, several=True) == 3  # the repeated 1, step 4, the torn line
    kept = [(r["step"], r["x"]) for r in map(json.loads, path.read_text().splitlines())]
    assert kept == [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (3, "a"), (3, "b")]
    assert cut_jsonl(path, 3, several=True, steps={1, 3}) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 1, 3, 3]
    assert cut_jsonl(path, 3, several=True, steps=set()) == 4 and path.read_text() == ""


def test_start_over_removes_the_samples_files(tmp_path):
    for name in ("samples.jsonl", "eval_samples.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("x")
    assert sorted(start_over(tmp_path)) == ["eval.jsonl", "eval_samples.jsonl", "samples.jsonl"]
    assert not list(tmp_path.iterdir())


def test_start_over_and_create(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("x")
    (tmp_path / "tb").mkdir()
    (tmp_path / "config.yaml").write_text("kept")
    assert start_over(tmp_path) == ["metrics.jsonl", "tb/"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="cannot write there"):
        create(tmp_path / "file" / "run")
    create(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
