"""The run directory: who owns it, and its append-only logs.

- :class:`RunDirLock`: a run holds ``run_dir/.lock`` (an exclusive ``flock`` on it, and its pid,
  host and start time inside) from before it writes anything until it ends. A second run on the
  same directory is refused with a message naming the owner. The operating system drops the
  ``flock`` of a process that dies, so a lock left by a killed run is taken over (and said so);
  where the file system has no ``flock``, a lock whose pid no longer runs on this host is stale.
- :func:`create`: makes the directory, turning an ``OSError`` into a message naming it.
- :func:`cut_jsonl`: ``metrics.jsonl`` and ``eval.jsonl`` (one line per step) and
  ``samples.jsonl`` and ``eval_samples.jsonl`` (several) keep the lines of steps up to the
  checkpoint a run resumes from (a killed run may have written lines past it, or a torn line);
  :func:`start_over` clears the logs of an earlier run that never checkpointed.

Files are rewritten through a temporary file and ``os.replace``, so a crash mid-write leaves the
old or the new content, never a mix.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import shutil
import socket
from collections.abc import Container
from pathlib import Path

LOCK_FILE = ".lock"
# the append-only logs (records.jsonl and consumed.jsonl: dora_jax.orchestrator.history)
LOGS = (
    "metrics.jsonl",
    "eval.jsonl",
    "samples.jsonl",
    "eval_samples.jsonl",
    "records.jsonl",
    "consumed.jsonl",
)


class RunDirError(RuntimeError):
    """The run directory cannot be used (message names it and why)."""


def create(run_dir: Path) -> None:
    """``run_dir`` and its parents; a file in the way or no permission is a :class:`RunDirError`."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"run_dir {run_dir}: cannot write there ({_reason(e)})") from None


def _reason(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e)
    where = f": {e.filename}" if e.filename else ""
    return f"{text}{' [' + name + ']' if name else ''}{where}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cut_jsonl(
    path: Path, last_step: int, *, several: bool = False, steps: Container[int] | None = None
) -> int:
    """Keep the lines of ``path`` whose ``step`` is at most ``last_step`` (and one of ``steps``
    when given), each step once: a repeated step keeps its first line, or with ``several`` (a
    log of several lines per step) its first run of consecutive lines; torn or unreadable lines
    go. Returns lines dropped."""
    if not path.is_file():
        return 0
    kept, seen, dropped, last = [], set(), 0, None
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped += bool(line.strip())
            continue
        if (
            not isinstance(step, int)
            or step > last_step
            or (step in seen and not (several and step == last))
            or (steps is not None and step not in steps)
        ):
            dropped += 1
            continue
        seen.add(step)
        last = step
        kept.append(line + "\n")
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


def start_over(run_dir: Path) -> list[str]:
    """Remove the logs and reports of an earlier run that left no checkpoint (a fresh run must
    not append to them). Returns what was removed."""
    removed = []
    for name in (*LOGS, "summary.json", "summary.md"):
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
            removed.append(name)
    if (run_dir / "tb").is_dir():
        shutil.rmtree(run_dir / "tb")
        removed.append("tb/")
    return removed


def pid_alive(pid: int | str) -> bool:
    """Whether process ``pid`` runs on this host (a ``pid`` that is not a number does not)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class RunDirBusy(RuntimeError):
    """Another live run holds the directory."""


class RunDirLock:
    """``with RunDirLock(run_dir) as lock:``; ``lock.took_over`` describes a stale owner."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None
        self.took_over: str | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _owner(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _describe(owner: dict) -> str:
        return (
            f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, "
            f"started {owner.get('started', '?')}"
        )

    def acquire(self) -> None:
        import fcntl

        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunDirError(
                    f"run_dir {self.path.parent}: cannot create its lock file ({_reason(e)})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(self._busy(self._owner())) from None
            except OSError:  # no flock on this file system: judge by the pid
                flocked = False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner removed the file meanwhile: lock the new one
                os.close(fd)
                continue
            owner = self._owner()
            if owner and not flocked and self._may_run(owner):
                os.close(fd)
                raise RunDirBusy(self._busy(owner))
            if owner:  # with flock, a left-over owner has died (the system dropped its lock)
                self.took_over = self._describe(owner)
            self.fd = fd
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            return
        raise RunDirBusy(f"run_dir {self.path.parent}: could not take its lock (it keeps changing)")

    @staticmethod
    def _may_run(owner: dict) -> bool:
        """Without flock: whether the recorded owner may still run."""
        pid = owner.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():
            return False
        if owner.get("host") != socket.gethostname():
            return True  # another host: cannot tell, so assume it runs
        return pid_alive(pid)

    def _busy(self, owner: dict) -> str:
        return (
            f"run_dir {self.path.parent} is in use by another run ({self._describe(owner)}): "
            f"wait for it to end or choose another run_dir (if that run is gone, delete "
            f"{self.path})"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)  # drops the flock
        self.fd = None
