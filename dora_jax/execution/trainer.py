"""The trainer on its own worker thread: the wall clock's side of the runtime's trainer contract.

:class:`ThreadedTrainer` wraps anything with ``step(batch) -> new_version`` (the GRPO trainer):
``start(batch, now)`` hands the batch to the worker and returns at once; the worker scores,
packs and runs the jitted step on the trainer's devices while the rollout groups keep decoding,
and waits until the new version's params are computed (``inner.wait(version)``, when it has one);
``poll(now)`` returns ``(version, t0, t1)`` once the step has ended (the control loop publishes
the version then) and re-raises the step's error if it failed. The worker posts a wake-up on the
run's bus when a step ends, so the control loop does not wait for its next timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ThreadedTrainer:
    def __init__(self, inner: Any, now: Callable[[], float], post: Callable[[Any], None]):
        self.inner, self.now, self.post = inner, now, post
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._job: Future | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None

    def start(self, batch: list, now: float) -> None:
        if self._job is not None:
            raise RuntimeError("a train step is already running")

        def run() -> tuple[int, float, float]:
            t0 = self.now()
            try:
                version = self.inner.step(batch)
                wait = getattr(self.inner, "wait", None)
                if wait is not None:  # the step is dispatched; its version must be computed
                    wait(version)
            finally:
                self.post(("trainer", "step ended"))
            return version, t0, self.now()

        self._job = self._pool.submit(run)

    def poll(self, now: float) -> tuple[int, float, float] | None:
        if self._job is None or not self._job.done():
            return None
        job, self._job = self._job, None
        return job.result()  # raises the step's error, if any

    def wait(self, timeout: float) -> None:
        """Block until the running step (if any) has ended, at most ``timeout`` seconds."""
        if self._job is not None:
            self._job.exception(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
