"""Lifelines (dora_jax/distributed/lifeline.py): process 0 hears at once that a process ended,
however it ended; a process started again replaces its old lifeline."""

import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dora_jax.distributed.lifeline import Lifelines, hold

ROOT = Path(__file__).resolve().parents[1]


def _lifelines(count=4):
    closed: queue.Queue = queue.Queue()
    lines = Lifelines("127.0.0.1", closed.put, count)
    return lines, closed, f"127.0.0.1:{lines.port}"


def test_a_process_killed_with_sigkill_is_heard_at_once():
    lines, closed, where = _lifelines()
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from dora_jax.distributed.lifeline import hold;"
        "hold(sys.argv[2], 2, lambda: None); print('held', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(ROOT), where], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        time.sleep(0.2)  # (process 0's side has read the first line)
        assert closed.empty()  # alive: nothing said
        t0 = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        assert closed.get(timeout=10) == 2
        assert time.perf_counter() - t0 < 5  # the heartbeat would take 10 s
    finally:
        child.kill()
        child.wait()
        lines.close()


def test_a_newer_lifeline_replaces_the_old_one_and_a_bad_first_line_is_ignored():
    lines, closed, where = _lifelines()
    old = socket.create_connection(("127.0.0.1", lines.port))
    old.sendall(b"1\n")
    time.sleep(0.2)
    new = socket.create_connection(("127.0.0.1", lines.port))
    new.sendall(b"1\n")
    time.sleep(0.2)
    old.close()  # the process started again: the old connection's end is no news
    for bad in (b"zero\n", b"0\n", b"9\n"):  # not a number; process 0 itself; out of range
        s = socket.create_connection(("127.0.0.1", lines.port))
        s.sendall(bad)
        s.close()
    time.sleep(0.3)
    assert closed.empty()
    new.close()
    assert closed.get(timeout=5) == 1
    lines.close()


def test_a_lifeline_of_a_replaced_incarnation_says_nothing_when_it_closes():
    """A second copy of process 1's command joined (its token is now the current one) before
    the first copy's lifeline closed: the first's closing is no news; the second's is."""
    closed: queue.Queue = queue.Queue()
    current = {1: "first"}
    lines = Lifelines("127.0.0.1", closed.put, 4, current_token=current.get)
    first = socket.create_connection(("127.0.0.1", lines.port))
    first.sendall(b"1 first\n")
    time.sleep(0.2)
    current[1] = "second"  # the second copy joined; its lifeline is not up yet
    first.close()
    time.sleep(0.3)
    assert closed.empty()
    second = socket.create_connection(("127.0.0.1", lines.port))
    second.sendall(b"1 second\n")
    time.sleep(0.2)
    second.close()
    assert closed.get(timeout=5) == 1
    lines.close()


def test_the_other_end_hears_process_0_end():
    lines, _, where = _lifelines()
    ended: queue.Queue = queue.Queue()
    hold(where, 3, lambda: ended.put("process 0"))
    time.sleep(0.2)
    assert ended.empty()
    with lines._lock:
        conns = list(lines._newest.values())
    for c in conns:  # process 0 ending: the kernel closes its side
        c.shutdown(socket.SHUT_RDWR)
        c.close()
    assert ended.get(timeout=5) == "process 0"
    lines.close()
