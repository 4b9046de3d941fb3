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


# logical clock: started again once process 0 has said it is gone (its lifeline closed); wall
# clock: started again at once. Steps: room for process 2 to come back (a few seconds) on a
# loaded CI machine; the wall clock's steps are short once the loss is seen (0.1 s here).
@pytest.mark.parametrize("clock,wait_for_loss,steps", [("logical", True, 30), ("wall", False, 120)])
def test_a_killed_rollout_host_is_dropped_and_rejoins(tmp_path, clock, wait_for_loss, steps):
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        "--local-processes",
        "3",
        *LAYOUT,
        f"orchestrator.clock={clock}",
        f"run_dir={run_dir}",
        f"train.total_steps={steps}",
    ]
    proc = start_until_steps(args, tmp_path, run_dir, 2)
    logs = run_dir / "logs"
    os.kill(int((logs / "process_2.pid").read_text()), signal.SIGKILL)
    again = (logs / "process_2.cmd").read_text()  # the documented command, as written
    log0, deadline = logs / "process_0.log", time.time() + 600
    while wait_for_loss and "process 2 is gone" not in log0.read_text():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    with open(logs / "process_2.again.log", "w") as out:
        rejoined = subprocess.Popen(
            again, shell=True, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            rejoined.wait(timeout=120)
    log0 = log0.read_text()
    assert proc.returncode == 0, log0[-3000:] + stderr[-2000:]
    assert rejoined.returncode == 0, (logs / "process_2.again.log").read_text()[-3000:]

    rows = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == steps * 2 * 4  # every prompt group once, nothing twice
    assert all(r["version_span"] == 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    assert summary["group_failures"] == 2  # process 2's two groups
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["recovery/group_failures"] for m in lines) == 2  # per line, since the last
    recovered = sum(m["recovery/redispatched/prompt"] for m in lines)
    assert recovered == summary["recovered"].get("prompt", 0)
    assert all(
        m["recovery/redispatched/kv"] == m["recovery/redispatched/tokens"] == 0 for m in lines
    )

    health = _health(run_dir)
    for g in (2, 3):  # process 2's groups: dead, restarting, stale, healthy, in that order
        states = [h[2] for h in health if h[1] == g]
        assert states == ["dead", "restarting", "stale", "healthy"], health
    back = max(h[0] for h in health if h[2] == "healthy")
    assert _worked_after(run_dir, {2, 3}, back)  # process 2's groups took work again
    expect("host-lost", log0, proc.returncode)  # docs/reliability.md's row


# A SIGTERM (the notice before a preemption) to a rollout host: it hands its requests over and
# leaves; nothing it had computed is lost (KV moves with the requests) and the run goes on with
# the others; started again once it has left, it rejoins. Steps: room to come back, as above.
@pytest.mark.parametrize("clock,steps", [("logical", 30), ("wall", 120)])
def test_a_rollout_host_told_to_stop_hands_its_requests_over(tmp_path, clock, steps):
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        "--local-processes",
        "3",
        *LAYOUT,
        "rollout.max_new_tokens=128",  # (requests mid-decode at the signal: KV to move)
        "orchestrator.rollout_batch_prompts=8",
        f"orchestrator.clock={clock}",
        f"run_dir={run_dir}",
        f"train.total_steps={steps}",
    ]
    proc = start_until_steps(args, tmp_path, run_dir, 2)
    logs = run_dir / "logs"
    os.kill(int((logs / "process_2.pid").read_text()), signal.SIGTERM)
    log2, deadline = logs / "process_2.log", time.time() + 600
    while "requests handed over; leaving" not in log2.read_text():  # (exit 0 follows)
        assert time.time() < deadline and proc.poll() is None, log2.read_text()[-2000:]
        time.sleep(0.2)
    log0 = logs / "process_0.log"
    while "process 2 is gone" not in log0.read_text():  # (its lifeline closed: it has ended)
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    again = (logs / "process_2.cmd").read_text()
    with open(logs / "process_2.again.log", "w") as out:
        rejoined = subprocess.Popen(
            again, shell=True, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            rejoined.wait(timeout=120)
    log0 = log0.read_text()
    assert proc.returncode == 0, log0[-3000:] + stderr[-2000:]
    assert rejoined.returncode == 0, (logs / "process_2.again.log").read_text()[-3000:]

    rows = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == steps * 2 * 4  # every prompt group once, nothing twice
    assert all(r["version_span"] == 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    # every request the host held goes on from its KV, or from its prompt if it had none (a
    # request queued there, not yet prefilled); never from tokens to prefill again. On the
    # logical clock process 2's groups are mid-decode at the signal; on the wall clock the
    # timing decides what they hold then (requests just queued, or none)
    recovered = summary["recovered"]
    assert recovered.get("tokens", 0) == 0, recovered
    if clock == "logical":
        assert recovered.get("kv", 0) > 0, recovered
    health = _health(run_dir)
    for g in (2, 3):  # process 2's groups: handed over (its exit no second loss), then back
        states = [(h[2], h[3]) for h in health if h[1] == g]
        assert [s for s, _ in states] == ["dead", "restarting", "stale", "healthy"], health
        assert "leaving" in states[0][1], health
    back = max(h[0] for h in health if h[2] == "healthy")
    assert _worked_after(run_dir, {2, 3}, back)  # process 2's groups took work again
