"""A rollout host that dies mid-run costs its work, not the run (docs/reliability.md, "A rollout
host that dies"): three processes on loopback (the trainer and the control plane on process 0,
two rollout groups on each of processes 1 and 2), process 2 killed with SIGKILL after the second
train step, then started again with the command the launcher wrote for it. The run finishes;
process 2's groups are dead, restarting, stale (loading the newest version) and healthy again,
and take work after; every prompt group is consumed once, every trajectory by one version.
(``slow``: the run starts its own processes.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_runs import TINY_RUN, start_until_steps  # tests/live_runs.py
from reliability_cases import expect  # tests/reliability_cases.py

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

LAYOUT = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "mesh.rollout.devices=2:6",
    "mesh.rollout.groups=4",
    "orchestrator.prefer_local_moves=false",
]


def _health(run_dir: Path) -> list[tuple[float, int, str, str]]:
    rows = []
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        rows += [tuple(r) for r in json.loads(line).get("health", [])]
    return rows


def _worked_after(run_dir: Path, groups: set[int], t: float) -> set[int]:
    """Which of ``groups`` prefilled or decoded after ``t`` (a tick on the logical clock, whose
    ``groups`` records hold one row per tick; seconds on the wall clock, whose ``spans`` records
    hold every engine step with its start)."""
    out, tick = set(), 0
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        d = json.loads(line)
        rows = d.get("groups", [])
        ticks = [(tick + i, g) for i, row in enumerate(rows) for g in row]
        tick += len(rows)
        spans = [(g[8], g) for g in d.get("spans", [])]
        for when, g in ticks + spans:
            if g[0] in groups and when > t and g[2] in ("prefill", "decode"):
                out.add(g[0])
    return out


def _start(tmp_path: Path, clock: str, steps: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    """The three-process run, returned once it has done 2 steps; and its run dir."""
    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "3", *LAYOUT]
    args += [*extra, f"orchestrator.clock={clock}", f"run_dir={run_dir}"]
    args += [f"train.total_steps={steps}"]
    return start_until_steps(args, tmp_path, run_dir, 2), run_dir


def _wait_for(path: Path, text: str, proc: subprocess.Popen, times: int = 1) -> None:
    deadline = time.time() + 600
    while path.read_text().count(text) < times:
        assert time.time() < deadline and proc.poll() is None, path.read_text()[-2000:]
        time.sleep(0.2)


def _kill_until_gone(proc: subprocess.Popen, logs: Path, p: int) -> None:
    """SIGKILL process ``p``; return once process 0 has said it is gone."""
    said = (logs / "process_0.log").read_text().count(f"process {p} is gone")
    os.kill(int((logs / f"process_{p}.pid").read_text()), signal.SIGKILL)
    _wait_for(logs / "process_0.log", f"process {p} is gone", proc, times=said + 1)


def _start_command(tmp_path: Path, logs: Path, p: int, name: str) -> subprocess.Popen:
    """Start process ``p`` again with the command the launcher wrote for it, in a session of
    its own (its shell and python: one group to kill), its output to ``process_<p>.<name>.log``."""
    with open(logs / f"process_{p}.{name}.log", "w") as out:
        return subprocess.Popen(
            (logs / f"process_{p}.cmd").read_text(),
            shell=True,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _start_again_and_finish(tmp_path: Path, run_dir: Path, proc: subprocess.Popen) -> str:
    """Start process 2 again with the command the launcher wrote for it, wait for the run to
    end (both must exit 0) and return process 0's log."""
    logs = run_dir / "logs"
    rejoined = _start_command(tmp_path, logs, 2, "again")  # the documented command, as written
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        rejoined.wait(timeout=120)
    log0 = (logs / "process_0.log").read_text()
    assert proc.returncode == 0, log0[-3000:] + stderr[-2000:]
    assert rejoined.returncode == 0, (logs / "process_2.again.log").read_text()[-3000:]
    return log0


def _consumed_once(run_dir: Path, steps: int) -> dict:
    """Every prompt group consumed once, every trajectory by one version; the summary."""
    rows = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == steps * 2 * 4  # every prompt group once, nothing twice
    assert all(r["version_span"] == 1 for r in rows)
    return json.loads((run_dir / "summary.json").read_text())["summary"]


def _back_and_working(run_dir: Path) -> list:
    """Process 2's groups went dead, restarting, stale, healthy, in that order, and took work
    again after; the health rows."""
    health = _health(run_dir)
    for g in (2, 3):
        states = [h[2] for h in health if h[1] == g]
        assert states == ["dead", "restarting", "stale", "healthy"], health
    back = max(h[0] for h in health if h[2] == "healthy")
    assert _worked_after(run_dir, {2, 3}, back)
    return health


# logical clock: started again once process 0 has said it is gone (its lifeline closed); wall
# clock: started again at once. Steps: room for process 2 to come back (a few seconds) on a
# loaded CI machine; the wall clock's steps are short once the loss is seen (0.1 s here).
@pytest.mark.parametrize("clock,wait_for_loss,steps", [("logical", True, 30), ("wall", False, 120)])
def test_a_killed_rollout_host_is_dropped_and_rejoins(tmp_path, clock, wait_for_loss, steps):
    proc, run_dir = _start(tmp_path, clock, steps)
    logs = run_dir / "logs"
    os.kill(int((logs / "process_2.pid").read_text()), signal.SIGKILL)
    if wait_for_loss:
        _wait_for(logs / "process_0.log", "process 2 is gone", proc)
    log0 = _start_again_and_finish(tmp_path, run_dir, proc)

    summary = _consumed_once(run_dir, steps)
    assert summary["group_failures"] == 2  # process 2's two groups
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["recovery/group_failures"] for m in lines) == 2  # per line, since the last
    recovered = sum(m["recovery/redispatched/prompt"] for m in lines)
    assert recovered == summary["recovered"].get("prompt", 0)
    assert all(
        m["recovery/redispatched/kv"] == m["recovery/redispatched/tokens"] == 0 for m in lines
    )
    _back_and_working(run_dir)
    expect("host-lost", log0, proc.returncode)  # docs/reliability.md's row


# A SIGTERM (the notice before a preemption) to a rollout host: it hands its requests over and
# leaves; nothing it had computed is lost (KV moves with the requests) and the run goes on with
# the others; started again once it has left (its lifeline closed), it rejoins. Steps: as
# above, and on the logical clock room for the leave too (30 were too few once, under load).
@pytest.mark.parametrize("clock,steps", [("logical", 60), ("wall", 120)])
def test_a_rollout_host_told_to_stop_hands_its_requests_over(tmp_path, clock, steps):
    mid_decode = ("rollout.max_new_tokens=128", "orchestrator.rollout_batch_prompts=8")
    proc, run_dir = _start(tmp_path, clock, steps, *mid_decode)
    logs = run_dir / "logs"
    os.kill(int((logs / "process_2.pid").read_text()), signal.SIGTERM)
    _wait_for(logs / "process_2.log", "requests handed over; leaving", proc)  # (exit 0 next)
    _wait_for(logs / "process_0.log", "process 2 left (signal 15) after handing its", proc)
    log0 = _start_again_and_finish(tmp_path, run_dir, proc)
    # the run report and the metrics: a host asked to stop left; no group failed
    assert "rollout groups left 2 time(s) with their process, asked to stop" in log0
    assert "process 2 is gone" not in log0 and "rollout groups failed" not in log0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["recovery/groups_left"] for m in lines) == 2
    assert sum(m["recovery/group_failures"] for m in lines) == 0

    summary = _consumed_once(run_dir, steps)
    assert (summary["group_failures"], summary["groups_left"]) == (0, 2)
    # every request the host held goes on from its KV, or from its prompt if it had none (a
    # request queued there, not yet prefilled); never from tokens to prefill again. On the
    # logical clock process 2's groups are mid-decode at the signal; on the wall clock the
    # timing decides what they hold then (requests just queued, or none)
    recovered = summary["recovered"]
    assert recovered.get("tokens", 0) == 0, recovered
    if clock == "logical":
        assert recovered.get("kv", 0) > 0, recovered
    health = _back_and_working(run_dir)  # (its exit after the handover: no second loss)
    assert all("leaving" in h[3] for h in health if h[1] in (2, 3) and h[2] == "dead"), health


def test_a_host_killed_again_while_it_rejoins_comes_back_later(tmp_path):
    """Process 2 killed, started again, and killed again as soon as process 0 has it back (its
    groups to rebuild their engines: the control plane may not even have looked yet, then it
    finds a loss and a return between two rounds): the run goes on with the others; started a
    third time, process 2's groups rejoin and take work, every prompt group consumed once."""
    steps = 80
    proc, run_dir = _start(tmp_path, "logical", steps)
    logs = run_dir / "logs"
    _kill_until_gone(proc, logs, 2)
    second = _start_command(tmp_path, logs, 2, "second")
    _wait_for(logs / "process_0.log", "process 2 is back", proc)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(timeout=60)
    _wait_for(logs / "process_0.log", "process 2 is gone", proc, times=2)
    log0 = _start_again_and_finish(tmp_path, run_dir, proc)
    assert log0.count("process 2 is back") == 2, log0[-3000:]
    expect("host-killed-mid-rejoin", log0, proc.returncode)
    _consumed_once(run_dir, steps)
    health = _health(run_dir)
    for g in (2, 3):
        states = [h[2] for h in health if h[1] == g]
        assert states[0] == "dead" and states[-2:] == ["stale", "healthy"], health
        assert states.count("dead") == 2 and states.count("healthy") == 1, health
        assert states[: states.index("dead", 1)] == ["dead", "restarting"], health  # mid-rejoin
    assert _worked_after(run_dir, {2, 3}, max(h[0] for h in health if h[2] == "healthy"))


def test_a_live_hosts_command_started_twice_leaves_one_host(tmp_path):
    """Process 2's command started a second time while process 2 runs: process 0 takes the new
    one as process 2 started again (its groups rejoin); the old one says it was replaced and
    leaves (exit 3), holding nothing. The run finishes, every prompt group consumed once."""
    steps = 120
    proc, run_dir = _start(tmp_path, "wall", steps)
    logs = run_dir / "logs"
    old = int((logs / "process_2.pid").read_text())
    log0 = _start_again_and_finish(tmp_path, run_dir, proc)
    log2 = (logs / "process_2.log").read_text()
    expect("duplicate-host", log0 + log2)
    assert not _alive(old), "the replaced process is still running"
    assert "process 2 is back" in log0
    _consumed_once(run_dir, steps)
    health = _health(run_dir)
    assert all("process 2" in h[3] for h in health if h[2] == "dead"), health
    assert _worked_after(run_dir, {2, 3}, max(h[0] for h in health))
    # the same command once the run has ended: one line at once, nothing to join
    late = subprocess.run(
        (logs / "process_2.cmd").read_text(),
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expect("host-after-the-end", late.stdout + late.stderr, late.returncode)


# Two processes, as docs/usage.md's first layout: the trainer on process 0, every rollout group
# on process 1. Losing process 1 leaves no group in the run.
ALONE = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "mesh.rollout.devices=4:8",
    "mesh.rollout.groups=4",
]


def _start_alone(tmp_path: Path, steps: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "2", *ALONE]
    args += [*extra, f"run_dir={run_dir}", f"train.total_steps={steps}"]
    return start_until_steps(args, tmp_path, run_dir, 2), run_dir


def test_the_only_rollout_host_killed_and_started_again_finishes_the_run(tmp_path):
    """Every group comes back holding the newest version; the prompt groups started under older
    ones finish under theirs (the trainer sends those versions to groups again)."""
    steps = 30
    proc, run_dir = _start_alone(tmp_path, steps)
    logs = run_dir / "logs"
    _kill_until_gone(proc, logs, 1)
    rejoined = _start_command(tmp_path, logs, 1, "again")
    try:
        _, stderr = proc.communicate(timeout=900)  # (a hang fails here, not forever)
    finally:
        rejoined.wait(timeout=120)
    log0 = (logs / "process_0.log").read_text()
    assert proc.returncode == 0, log0[-3000:] + stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == steps * 2 * 4  # every prompt group once
    assert all(r["version_span"] == 1 for r in rows)


def test_the_only_rollout_host_lost_for_good_stops_the_run_with_a_checkpoint(tmp_path):
    proc, run_dir = _start_alone(tmp_path, 8, "orchestrator.no_groups_wait_s=15")
    logs = run_dir / "logs"
    os.kill(int((logs / "process_1.pid").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    log0 = (logs / "process_0.log").read_text()
    expect("no-rollout-group-left", log0 + out + err, proc.returncode)
    assert (
        f"waiting up to 15 s for process 1 to be started again with its own command "
        f"({logs / 'process_1.cmd'})" in log0
    )
    steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert (run_dir / "checkpoints" / str(steps)).is_dir() and steps < 8
    # the printed command continues the run to its end
    resume = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "2"]
        + ["--resume", f"run_dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 8


def test_process_0_killed_names_the_way_back_on_every_terminal(tmp_path):
    """SIGKILL of process 0 (the trainer and the control plane): it can say nothing itself; the
    launcher names the last checkpoint and the resume command, and the rollout host's output
    holds that command too (the runtime may end it before any handler of ours runs)."""
    from dora_jax.checkpoint import finished_steps

    proc, run_dir = _start_alone(tmp_path, 40, "checkpoint.every_steps=2")
    deadline = time.time() + 300
    while not finished_steps(run_dir / "checkpoints"):  # (a save of step 2 may still be on)
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    logs = run_dir / "logs"
    os.kill(int((logs / "process_0.pid").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    expect("process-0-killed", out + err, proc.returncode)
    assert f"--local-processes 2 --resume run_dir={run_dir}" in err
    log1 = (logs / "process_1.log").read_text()
    assert (
        f"the run then goes on from its last checkpoint with: python launch/train.py "
        f"--local-processes 2 --resume run_dir={run_dir}" in log1
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_launcher_killed_leaves_no_orphans_and_a_checkpoint(tmp_path):
    """SIGKILL of ``--local-processes``' launcher itself (no handler of its runs): process 0 is
    told (SIGTERM, as the parent-death signal), saves a checkpoint, stops the rollout host and
    ends; each process's output went to its log file all along."""
    proc, run_dir = _start_alone(tmp_path, 40)
    logs = run_dir / "logs"
    pids = [int((logs / f"process_{i}.pid").read_text()) for i in (0, 1)]
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 300
    while any(_alive(p) for p in pids):
        assert time.time() < deadline, "a process of the run outlived its launcher"
        time.sleep(0.5)
    log0 = (logs / "process_0.log").read_text()
    expect("launcher-killed", log0)
    steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert (run_dir / "checkpoints" / str(steps)).is_dir()
    assert "process 1: done" in (logs / "process_1.log").read_text()
