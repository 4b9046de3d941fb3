"""Multi-process runs on JAX's multi-controller runtime, on this machine: several CPU processes on
loopback with fake devices each, standing in for hosts (``slow``: each run starts its own
processes and compiles everything anew).

- 2 processes x 4 devices, the tiny default model in ``dora`` mode with K=2, the trainer on
  process 0 and rollout groups on both: every request consumed exactly once, staleness <= K,
  weights and KV moved across processes, and the migrated requests continue bit-identically.
- On the logical clock the 2-process run consumes the same request ids in the same steps as the
  1-process run of the same config, and ends with the same params (within 1e-5).
- A trainer mesh spanning both processes: the same ids and params as the 1-process run of that
  layout, and a wall-clock run.
- Every trainer command on a trainer mesh spanning both processes: each process runs the same
  commands in the same order, through executables with the same fingerprints.
- A trainer process killed with SIGKILL (the trainer spanning both processes): the other stops
  within 60 s naming it, and ``--resume`` completes the run with nothing lost or consumed twice,
  its resumed losses equal to an uninterrupted run's. (A rollout host killed costs only its work:
  ``tests/test_host_loss.py``.)
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from live_runs import TINY_RUN, start_until_steps  # tests/live_runs.py
from reliability_cases import expect  # tests/reliability_cases.py

from dora_jax.distributed.launcher import launch_local

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "multiprocess_driver.py"
TINY = [
    *TINY_RUN,
    "mesh.rollout.devices=2:8",
    "mesh.rollout.groups=6",
    "orchestrator.kv_pressure_threshold=0.3",
    # host ignored by the planner: the 2-process run decides as the 1-process run does, and its
    # moves cross processes (the preference for local moves is tested on the planner)
    "orchestrator.prefer_local_moves=false",
]

# the trainer mesh spans both processes (devices 2-3 of process 0, 4-5 of process 1; data
# parallel across them), the two rollout groups live on process 1
SPANNING = [
    "mesh.trainer.devices=2:6",
    "mesh.trainer.data=2",
    "mesh.trainer.model=2",
    "mesh.rollout.devices=6:8",
    "mesh.rollout.groups=2",
]

pytestmark = pytest.mark.slow


def drive(
    tmp_path: Path,
    name: str,
    processes: int,
    clock: str,
    steps: int = 5,
    extra: tuple[str, ...] = (),
) -> dict:
    run_dir = tmp_path / name
    args = [str(steps), *TINY, *extra, f"orchestrator.clock={clock}", f"run_dir={run_dir}"]
    code = launch_local(processes, args, run_dir, devices_per_process=8 // processes, entry=DRIVER)
    logs = "".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert code == 0, logs
    result = json.loads((run_dir / "result.json").read_text())
    result["params"] = dict(np.load(run_dir / "params.npz"))
    return result


def _check_run(r: dict) -> None:
    ids = [c[0] for c in r["consumed"]]
    assert len(ids) == len(set(ids)) > 0  # nothing consumed twice
    assert r["ledger"] == ["consumed"] and r["live_requests"] == 0  # nothing lost (drained)
    assert all(0 <= c[2] <= 2 for c in r["consumed"]) and r["staleness_max"] <= 2
    assert r["reprefill_tokens"] == 0
    assert r["checked"] >= 1 and r["mismatches"] == []  # migrated requests continue bit for bit


def test_two_processes_logical_equals_one_process(tmp_path):
    two = drive(tmp_path, "two", 2, "logical", steps=10)
    _check_run(two)
    assert two["processes"] == 2
    assert two["cross_host_weight_transfers"] >= 1 and two["cross_host_migrated"] >= 1
    one = drive(tmp_path, "one", 1, "logical", steps=10)
    _check_run(one)
    assert [c[:2] for c in two["consumed"]] == [c[:2] for c in one["consumed"]]
    assert two["params"].keys() == one["params"].keys()
    for k in one["params"]:
        np.testing.assert_allclose(two["params"][k], one["params"][k], atol=1e-5, rtol=0)


def test_two_processes_wall_clock(tmp_path):
    r = drive(tmp_path, "wall", 2, "wall", steps=6)
    _check_run(r) if r["checked"] else None  # (whether the planner migrates depends on timing)
    ids = [c[0] for c in r["consumed"]]
    assert len(ids) == len(set(ids)) and r["ledger"] == ["consumed"] and r["live_requests"] == 0
    assert r["staleness_max"] <= 2 and r["cross_host_weight_transfers"] >= 1


def test_trainer_spanning_two_processes(tmp_path):
    """The trainer's computations run on both processes in lock-step: the run decides and
    trains as the 1-process run of the same layout (bit for bit here), on either clock."""
    two = drive(tmp_path, "two", 2, "logical", steps=6, extra=tuple(SPANNING))
    _check_run(two)
    assert two["trainer_processes"] == 2 and two["cross_host_weight_transfers"] >= 1
    one = drive(tmp_path, "one", 1, "logical", steps=6, extra=tuple(SPANNING))
    _check_run(one)
    assert [c[:2] for c in two["consumed"]] == [c[:2] for c in one["consumed"]]
    for k in one["params"]:
        np.testing.assert_allclose(two["params"][k], one["params"][k], atol=1e-5, rtol=0)
    wall = drive(tmp_path, "wall", 2, "wall", steps=4, extra=tuple(SPANNING))
    ids = [c[0] for c in wall["consumed"]]
    assert len(ids) == len(set(ids)) and wall["ledger"] == ["consumed"]
    assert wall["live_requests"] == 0 and wall["staleness_max"] <= 2 and wall["steps"] >= 4


def test_every_trainer_command_runs_on_every_trainer_process(tmp_path):
    """The trainer is one program: process 0 sends each command to the other trainer process
    before running it itself, and both compile the same executable for each batch shape."""
    run_dir = tmp_path / "spmd"
    args = [*TINY, *SPANNING, "train.length_buckets=[32,64]", f"run_dir={run_dir}"]
    code = launch_local(
        2, args, run_dir, devices_per_process=4, entry=ROOT / "tests" / "spmd_trainer_driver.py"
    )
    logs = {p.name: p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))}
    assert code == 0, "".join(t[-3000:] for t in logs.values())
    records = [
        json.loads(line.split("trainer commands: ", 1)[1])
        for text in logs.values()
        for line in text.splitlines()
        if "trainer commands: " in line
    ]
    assert sorted(r["process"] for r in records) == [0, 1]
    lead, other = sorted(records, key=lambda r: r["process"])
    assert lead["applied"] == [
        "StartTrainer",
        "ExportParams",
        "TrainStep",
        "TrainStep",
        "ExportParams",
        "GatherState",
        "RestoreState",
        "TrainStep",
        "GatherState",
    ]
    assert other["applied"] == lead["applied"]  # no command ran on process 0 alone
    assert len(lead["executables"]) == 2  # two batch shapes
    assert other["executables"] == lead["executables"]  # the same compiled programs
    assert lead["version"] == 3


@pytest.mark.parametrize("layout", ["trainer_spanning"])
def test_sigkill_of_one_process_then_resume(tmp_path, layout):
    run_dir = tmp_path / "killed"
    extra = SPANNING if layout == "trainer_spanning" else []
    args = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        "--local-processes",
        "2",
        *TINY,
        *extra,
        "orchestrator.clock=logical",
        f"run_dir={run_dir}",
        "train.total_steps=6",
        "checkpoint.every_steps=1",
        "checkpoint.async_save=false",
        "logging.tensorboard=false",
    ]
    proc = start_until_steps(args, tmp_path, run_dir, 2)
    pid = int((run_dir / "logs" / "process_1.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    out, err = proc.communicate(timeout=180)
    stopped_after = time.time() - t_kill
    assert proc.returncode != 0
    log0 = (run_dir / "logs" / "process_0.log").read_text()
    expect("process-killed", log0)  # docs/reliability.md: names the process, says --resume
    assert stopped_after < 60, stopped_after

    resumed = subprocess.run(
        [*args, "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    final = json.loads((run_dir / "summary.json").read_text())
    ids = final["extra"]["consumed_request_ids"]
    assert len(ids) == len(set(ids)) >= 6 * 2 * 4  # nothing lost, nothing consumed twice
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    if layout == "trainer_spanning":
        # the followers read their shards of the train state back: the resumed run trains as
        # one that was never stopped (one process, same layout, logical clock)
        ref_dir = tmp_path / "uninterrupted"
        single = [a for a in args if a not in ("--local-processes", "2")]
        single = [f"run_dir={ref_dir}" if a.startswith("run_dir=") else a for a in single]
        ref = subprocess.run(single, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
        ref_lines = (ref_dir / "metrics.jsonl").read_text().splitlines()
        for got, want in zip(lines, ref_lines, strict=True):
            got, want = json.loads(got), json.loads(want)
            assert got["step"] == want["step"]
            np.testing.assert_allclose(got["loss"], want["loss"], atol=1e-6, rtol=0)


def test_a_trainer_follower_lost_under_the_default_checkpoint_cadence(tmp_path):
    """The trainer spans both processes and checkpoints come at the default cadence (every 50
    steps, saved asynchronously): process 1 killed after step 52. Process 0 stops within 60 s
    naming the newest finished checkpoint (50, or none if its save had not finished) and the
    command; that command, run as printed, finishes the run: nothing lost or consumed twice."""
    from dora_jax.checkpoint import finished_steps

    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "2"]
    args += [*TINY, *SPANNING, f"run_dir={run_dir}", "train.total_steps=56"]
    args += ["logging.tensorboard=false"]
    proc = start_until_steps(args, tmp_path, run_dir, 52)
    os.kill(int((run_dir / "logs" / "process_1.pid").read_text()), signal.SIGKILL)
    t_kill = time.time()
    proc.communicate(timeout=180)
    assert proc.returncode != 0 and time.time() - t_kill < 60
    log0 = (run_dir / "logs" / "process_0.log").read_text()
    expect("follower-lost-default-cadence", log0)
    saved = finished_steps(run_dir / "checkpoints")
    assert saved in ([], [50]), saved
    said = f"the last checkpoint is {run_dir / 'checkpoints' / '50'}" if saved else "no checkpoint"
    assert said in log0, log0[-3000:]
    command = log0.split("Continue with: ")[-1].splitlines()[0]
    assert command.startswith("python launch/train.py --local-processes 2 --resume run_dir=")
    resumed = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    ids = json.loads((run_dir / "summary.json").read_text())["extra"]["consumed_request_ids"]
    assert len(ids) == len(set(ids)) >= 56 * 2 * 4
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 57))


CHATTER = [
    f"env.spec={ROOT / 'tests' / 'agentic_envs.py'}:Chatter",
    "env.workers=2",
    "env.kwargs.turns=8",
]


@pytest.mark.parametrize("clock", ["logical", "wall"])
def test_conversations_across_two_processes(tmp_path, clock):
    """Multi-turn conversations on groups of process 1, their environment on process 0: every
    turn end crosses to process 0 and every environment turn back; conversations migrated
    between processes continue bit for bit (replayed alone with the recorded environment
    turns); on the logical clock the run decides as the 1-process run does."""
    two = drive(tmp_path, "two", 2, clock, steps=5, extra=tuple(CHATTER))
    ids = [c[0] for c in two["consumed"]]
    assert len(ids) == len(set(ids)) > 0 and two["ledger"] == ["consumed"]
    assert two["live_requests"] == 0 and two["staleness_max"] <= 2
    assert two["reprefill_tokens"] == 0 and two["mismatches"] == []
    if clock == "logical":
        assert two["cross_host_migrated"] >= 1 and two["checked"] >= 1, two
        one = drive(tmp_path, "one", 1, clock, steps=5, extra=tuple(CHATTER))
        assert [c[:2] for c in two["consumed"]] == [c[:2] for c in one["consumed"]]
