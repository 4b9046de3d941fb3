"""Compiling the train step for new batch shapes off the trainer's critical path.

A packed train batch takes one of a bounded set of shapes (the rows of
:func:`dora_jax.train.batch.row_ladder` times the length buckets), and the jitted step compiles
once for each shape it meets: seconds on a CPU core, minutes for a large model on an accelerator
host. With ``train.compile: background`` a batch whose best shape is not compiled yet runs in the
fewest-positions shape that is (at worst the memory plan's compiled largest shape), while one
worker thread compiles the best shape for the batches that follow. Which shape a batch gets then
depends on when a compilation finishes, so this is for the wall clock: on the logical clock
every shape compiles in line and a run repeats exactly.

:class:`ShapeCompiler` is the worker: ``request(key)`` queues a shape, ``ready()`` lists the
finished ones, ``get(key)`` waits for a queued or running one. A compilation that raises is
recorded and not retried here: the trainer then compiles that shape in line, where the error
reaches the caller. ``close()`` waits for a compilation under way, and every compiler still open
is closed at interpreter exit: a daemon thread still inside XLA when the interpreter finalises
aborts the process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any


class ShapeCompiler:
    """Compiles ``compile_fn(key)`` for requested keys on one daemon thread, oldest first."""

    def __init__(self, compile_fn: Callable[[Hashable], Any], name: str = "train-step-compiler"):
        self._compile_fn = compile_fn
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._running: Hashable | None = None
        self._ready: dict[Hashable, Any] = {}
        self.errors: dict[Hashable, BaseException] = {}
        self.seconds: dict[Hashable, float] = {}  # each finished compilation's wall seconds
        self._closed = False
        self._thread: threading.Thread | None = None
        _OPEN.add(self)

    def request(self, key: Hashable) -> bool:
        """Queue ``key`` unless it is compiled, queued, running or failed; True if queued."""
        with self._cv:
            if self._closed or self._known(key):
                return False
            self._queue.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return True

    def _known(self, key: Hashable) -> bool:
        return (
            key in self._ready or key in self.errors or key == self._running or key in self._queue
        )

    def ready(self) -> dict[Hashable, Any]:
        """The compiled keys so far (a copy)."""
        with self._cv:
            return dict(self._ready)

    def pending(self) -> int:
        """Keys queued or compiling."""
        with self._cv:
            return len(self._queue) + (self._running is not None)

    def get(self, key: Hashable) -> Any | None:
        """The compiled ``key``, waiting while it is queued or compiling; None if it was never
        requested, failed or the compiler was closed first."""
        with self._cv:
            while key in self._queue or key == self._running:
                if self._closed:
                    return None
                self._cv.wait()
            return self._ready.get(key)

    def wait_idle(self) -> None:
        """Block until nothing is queued or compiling."""
        with self._cv:
            while (self._queue or self._running is not None) and not self._closed:
                self._cv.wait()

    def close(self) -> None:
        """Drop the queue and stop the worker, waiting for its current compilation."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        _OPEN.discard(self)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key = self._running = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                compiled, error = self._compile_fn(key), None
            except Exception as e:  # recorded; the trainer compiles this shape in line
                compiled, error = None, e
            with self._cv:
                if error is None:
                    self._ready[key] = compiled
                    self.seconds[key] = time.perf_counter() - t0
                else:
                    self.errors[key] = error
                self._running = None
                self._cv.notify_all()


_OPEN: weakref.WeakSet[ShapeCompiler] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for compiler in list(_OPEN):
        compiler.close()
