"""``python launch/train.py --local-processes N ...``: a multi-process run on this machine, for
testing and for users without a scheduler.

Starts N processes of the same command with the run's settings in the environment (coordinator
on a free loopback port, process count and id, ``--devices-per-process`` fake CPU devices each),
optionally each pinned to its own CPU core (``--pin-cores``), forwards process 0's output to the
terminal and every process's to ``run_dir/logs/process_<i>.log`` (its pid in ``process_<i>.pid``),
passes SIGINT/SIGTERM on to
process 0 (which stops the run and the others cleanly), and ends the others when one fails. A
launcher that is itself killed (SIGKILL: no handler runs) leaves no orphans: on Linux process 0
gets SIGTERM when the launcher dies, so it saves a checkpoint and stops the others. The
exit status is process 0's when it failed by itself (a config error: 2), else the first failure's
(the others' "process 0 is gone", 3, comes after process 0's own error). Each process finds the
launcher's flags in ``DORA_LOCAL_LAUNCH`` (:func:`launch_flags`), for the command that resumes
the run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dora_jax.distributed.process import ENV_COORDINATOR, ENV_ID, ENV_NUM

GRACE_S = 60.0  # after one process fails, how long the others get to stop by themselves
ENV_LAUNCH = "DORA_LOCAL_LAUNCH"  # the launcher's flags, as the children's resume hint gives them
ENV_PARENT = "DORA_LAUNCHER_PID"  # process 0's: the launcher it ends with


def launch_flags(env: dict[str, str] | None = None) -> str:
    """The ``--local-processes`` flags this process was started with ("" when it was not)."""
    return (os.environ if env is None else env).get(ENV_LAUNCH, "")


def term_with_launcher() -> None:
    """In process 0 of a local launch, at its start: SIGTERM to itself when the launcher dies
    (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing), or at once if it is gone already. Set
    here, not between fork and exec: the launcher may hold JAX's threads."""
    parent = os.environ.pop(ENV_PARENT, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # (it died before the call)
        os.kill(os.getpid(), signal.SIGTERM)


def ended_launch(run_dir: Path, process_id: int) -> int | None:
    """For process ``process_id`` > 0 of a local launch (``DORA_LOCAL_LAUNCH`` set: every
    process on this machine), started again with its ``process_<i>.cmd``: the pid of process 0
    when that process no longer runs (the run it would join has ended: nothing will ever answer
    at its coordinator's address), else None. The launcher writes ``process_0.pid`` before it
    starts any other process, so a process of a running launch always finds it alive."""
    if not process_id or not launch_flags():
        return None
    from dora_jax.run_dir import pid_alive

    try:
        pid = int((Path(run_dir) / "logs" / "process_0.pid").read_text())
    except (OSError, ValueError):
        return None
    return None if pid_alive(pid) else pid


def local_flags(n: int, devices_per_process: int, pin_cores: bool) -> list[str]:
    """The launcher's flags as a command line gives them (what ``--resume`` needs again)."""
    flags = ["--local-processes", str(n)]
    if devices_per_process != max(1, 8 // n):
        flags += ["--devices-per-process", str(devices_per_process)]
    if pin_cores:
        flags.append("--pin-cores")
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(
    n: int,
    argv: list[str],
    run_dir: Path,
    *,
    devices_per_process: int,
    pin_cores: bool = False,
    entry: Path | None = None,
) -> int:
    entry = entry or Path(__file__).resolve().parents[2] / "launch" / "train.py"
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    launch = local_flags(n, devices_per_process, pin_cores)
    for i in range(n):
        env = dict(os.environ)
        env.update(
            {
                ENV_LAUNCH: shlex.join(launch),
                ENV_COORDINATOR: f"127.0.0.1:{port}",
                ENV_NUM: str(n),
                ENV_ID: str(i),
                "PYTHONUNBUFFERED": "1",
            }
        )
        flags = " ".join(
            f
            for f in env.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f
        )
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
        if i == 0:  # (process 0 stops the others)
            env[ENV_PARENT] = str(os.getpid())
        cmd = [sys.executable, str(entry), *argv]
        if pin_cores:
            cmd = ["taskset", "-c", str(cores[i % len(cores)]), *cmd]
        # each process writes its own log file (its output outlives the launcher); the
        # launcher shows process 0's on the terminal as it grows
        with open(logs / f"process_{i}.log", "w") as log:
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(p)
        (logs / f"process_{i}.pid").write_text(str(p.pid))
        # the command that starts this process again (a rollout host that died rejoins the run)
        keep = (ENV_LAUNCH, ENV_COORDINATOR, ENV_NUM, ENV_ID, "XLA_FLAGS", "PYTHONUNBUFFERED")
        again = " ".join(f"{k}={shlex.quote(env[k])}" for k in keep) + " " + shlex.join(cmd)
        (logs / f"process_{i}.cmd").write_text(again + "\n")
        if i == 0:
            t = threading.Thread(target=_follow, args=(p, logs / "process_0.log"), daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _wait(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(5)
    if code:
        print(f"error: the run failed (exit {code}); logs in {logs}", file=sys.stderr)
    return code


# gloo's note on every new communicator (several per run, sometimes run together on one line):
# kept in the log files, left out of the terminal
_GLOO = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of "
    r"connected peer ranks is : \d+"
)


# the runtime's own info and warning lines (glog: I/W, date, time, thread, file:line), such as the
# coordination service's note on its recoverable mode at every start: log files only
_GLOG_NOTE = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./-]+:\d+\] ")


def terminal_line(line: str) -> str:
    """``line`` as the terminal shows it ("" when there is nothing left to show)."""
    if _GLOG_NOTE.match(line):
        return ""
    if "[Gloo]" not in line:
        return line
    rest = _GLOO.sub("", line)
    return "" if not rest.strip() else rest


def _follow(p: subprocess.Popen, path: Path) -> None:
    """Show the lines of ``path`` (``p``'s log) on the terminal as they are written, until
    ``p`` has ended and every line is shown."""
    with open(path, errors="replace") as f:
        part = ""
        while True:
            ended = p.poll() is not None
            chunk = f.readline()
            if not chunk:
                if ended:
                    shown = terminal_line(part) if part else ""  # (a last line without its end)
                    if shown:
                        sys.stdout.write(shown)
                        sys.stdout.flush()
                    break
                time.sleep(0.1)
                continue
            part += chunk
            if not part.endswith("\n") and not ended:
                continue  # (a line being written: wait for its end)
            shown = terminal_line(part)
            part = ""
            if shown:
                sys.stdout.write(shown)
                sys.stdout.flush()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Process 0's exit code; once it has ended, the others get ``GRACE_S`` to end by
    themselves, then are ended. Another process that fails first is reported, and the run goes
    on as process 0 decides (a rollout host's loss costs its work; a trainer process's stops the
    run, and process 0 says so)."""
    lead_at, reported = None, set()
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc and i not in reported:
                reported.add(i)
                print(f"process {i} exited with code {rc}", file=sys.stderr)
        if lead_at is None and procs[0].poll() is not None:
            lead_at = time.monotonic()
        if lead_at is not None and time.monotonic() - lead_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return procs[0].returncode
