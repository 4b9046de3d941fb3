"""Transports of group commands inside one process. A transport moves commands to a
:class:`~dora_jax.execution.group.GroupWorker` in the order they were sent and returns a future of
each one's value; it knows nothing of what a command means (``dora_jax.distributed.remote`` is the
transport to a group of another process, with the same two calls).

- :class:`Inline` (logical clock): the command is carried out on the caller's thread before
  ``send`` returns (an error is raised there). Deterministic.
- :class:`Threaded` (wall clock): a worker thread owns the engine; it applies the commands in
  order, steps the engine whenever it holds work and is not paused, and posts every
  :class:`~dora_jax.execution.commands.GroupEvent` to the run's bus as it happens. A command whose
  caller waits for its value (``replies``) hands an error back to it; any other error stops the
  worker and is posted as its last event. The commands a stopped worker never carried out fail
  (their futures raise :class:`GroupDead`) and are handed to whoever asks (:meth:`unapplied`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dora_jax.execution.commands import GroupCommand, GroupEvent, GroupStatus
from dora_jax.execution.group import GroupWorker, error_text


def _failed() -> Future:
    fut: Future = Future()
    fut.set_exception(GroupDead("the group's worker stopped"))
    return fut


def done(value: Any = None) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class GroupDead(RuntimeError):
    """A command sent to a group whose worker has stopped on an error."""


class Inline:
    sync = True  # a command is carried out before send returns

    def __init__(self, worker: GroupWorker, post: Callable[[Any], None] | None = None):
        self.worker = worker

    @property
    def status(self) -> GroupStatus:
        return self.worker.status

    def send(self, cmd: GroupCommand) -> Future:
        return done(self.worker.apply(cmd))

    def stop(self, timeout: float = 10.0) -> None:
        pass


class Threaded(Inline):
    POLL_S = 0.05  # how long an idle worker waits for a command before looking again
    sync = False

    def __init__(self, worker: GroupWorker, post: Callable[[Any], None]):
        super().__init__(worker)
        self.post = post
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self.dead = False  # stopped on an error
        self._lock = threading.Lock()  # (a send and the worker's stop do not cross)
        self._thread = threading.Thread(
            target=self._loop, name=f"group-{worker.group}", daemon=True
        )
        self._thread.start()

    def send(self, cmd: GroupCommand) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.dead:
                fut.set_exception(GroupDead(f"group {self.worker.group}'s worker has stopped"))
            self._q.put((cmd, fut))
        return fut

    def unapplied(self) -> list[GroupCommand]:
        """The commands this stopped worker never carried out, in order (each future failed)."""
        out = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                cmd, fut = item
                if not fut.done():
                    fut.set_exception(GroupDead(f"group {self.worker.group}'s worker stopped"))
                out.append(cmd)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        w = self.worker
        try:
            while not self._stop:
                try:
                    item = self._q.get_nowait() if w.busy else self._q.get(timeout=self.POLL_S)
                except queue.Empty:
                    item = None
                if item is not None:
                    cmd, fut = item
                    try:
                        fut.set_result(w.apply(cmd))
                    except BaseException as e:  # noqa: BLE001 - the caller's, or the run's
                        fut.set_exception(e)
                        if not cmd.replies:
                            raise
                elif w.busy:
                    w.run_step()
                else:
                    w.idle()
                for e in w.take_events():
                    self.post(e)
        except BaseException as e:  # noqa: BLE001 - handed to the control loop
            with self._lock:
                self.dead = True
                for cmd in self.unapplied():  # (their futures fail now; kept for the loop)
                    self._q.put((cmd, _failed()))
            self.post(GroupEvent(w.group, error=error_text(e)))


def transport_for(clock: Any) -> type[Inline]:
    """The transport of a group on ``clock``: a worker thread per group where the groups run
    beside the control loop (the wall clock), else the caller's thread."""
    return Threaded if clock.concurrent else Inline  # (kept: the clock's choice of transport)
