"""Clocks of the control plane, and the bus on which wall-clock workers report.

Two clocks drive one control plane (this module imports nothing but the standard library):

- :class:`LogicalClock`: time is the index of the control round (a *tick*); every group advances
  one engine step per tick on the caller's thread. Deterministic: the same seed and config give
  the same run, bit for bit, and a checkpoint resumes it exactly.
- :class:`WallClock`: time is seconds since the run started; every group runs its own engine
  loop on its own thread and the trainer its steps on another, and they report what they did,
  stamped with this clock, on a :class:`Bus` that the control loop waits on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any


class LogicalClock:
    """Ticks: ``now()`` is set by the runtime to the index of the current round. Nothing runs
    between two rounds, so there is nothing to hold still (``concurrent`` is false)."""

    kind = "logical"
    concurrent = False

    def __init__(self) -> None:
        self.tick = 0

    def now(self) -> int:
        return self.tick

    def start(self, offset: float = 0.0) -> None:
        """Nothing to start: a round's time is its index."""

    def begin_round(self, index: int) -> None:
        self.tick = index

    def round_length(self, t: float, last: float | None) -> float:
        """The time a round stands for: one tick, whatever ``t``."""
        return 1.0

    def stall(self, rounds: int, idle_s: float, max_ticks: int, stall_s: float) -> str | None:
        """Why a run that has taken ``rounds`` rounds, the last ``idle_s`` seconds without
        progress, counts as stalled (None: it does not): a bound on rounds."""
        return f"{max_ticks} ticks" if rounds >= max_ticks else None

    @staticmethod
    def plan_time(rounds: int, steps_per_group: float) -> float:
        """What the planner's period counts: rounds (every group steps once a round)."""
        return rounds

    # -- a run's figures in this clock's unit (its summary, reports) -------------------------------
    @staticmethod
    def horizon(summary: Any) -> float:
        """A run summary's horizon: ticks."""
        return summary.ticks

    @staticmethod
    def per_tick(value: float) -> float | None:
        """A rate per tick, as it is."""
        return value

    @staticmethod
    def amount(x: float) -> str:
        return f"{x} ticks"

    @staticmethod
    def describe(summary: Any) -> str:
        return f"{summary.ticks} ticks"

    @staticmethod
    def close_up(horizon: float) -> float:
        """How much of a run a close-up timeline shows: its first 300 ticks."""
        return 300


class WallClock:
    """Seconds since :meth:`start` (``time.perf_counter``); shared by every worker of a run,
    which runs beside the control loop (``concurrent``)."""

    kind = "wall"
    concurrent = True

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self, offset: float = 0.0) -> None:
        """Restart at ``offset`` seconds (a resumed run continues its timeline)."""
        self._t0 = time.perf_counter() - offset

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_round(self, index: int) -> None:
        """Nothing to set: a round's time is when it runs."""

    def round_length(self, t: float, last: float | None) -> float:
        """Seconds since the last round (none for the first)."""
        return t - (last or t)

    def stall(self, rounds: int, idle_s: float, max_ticks: int, stall_s: float) -> str | None:
        """As :meth:`LogicalClock.stall`: a bound on seconds without progress."""
        return f"{stall_s:.0f} s without progress" if idle_s > stall_s else None

    @staticmethod
    def plan_time(rounds: int, steps_per_group: float) -> float:
        """What the planner's period counts: engine steps per group (groups step at their own
        pace, so rounds would count faster with more groups)."""
        return steps_per_group

    @staticmethod
    def horizon(summary: Any) -> float:
        """A run summary's horizon: seconds."""
        return summary.seconds

    @staticmethod
    def per_tick(value: float) -> float | None:
        """None: a round is no unit of time here."""
        return None

    @staticmethod
    def amount(x: float) -> str:
        return f"{x:.1f} s"

    @staticmethod
    def describe(summary: Any) -> str:
        return f"{summary.seconds:.4g} s of run time ({summary.ticks} control rounds)"

    @staticmethod
    def close_up(horizon: float) -> float:
        """How much of a run a close-up timeline shows: its first tenth."""
        return horizon / 10


CLOCKS = {c.kind: c for c in (LogicalClock, WallClock)}


def make_clock(kind: str) -> LogicalClock | WallClock:
    """The clock ``orchestrator.clock`` names (``logical`` or ``wall``)."""
    return CLOCKS[kind]()


class Bus:
    """Events from workers to the control loop: ``post`` from any thread, ``collect`` from one.

    ``collect(timeout)`` returns every event posted since the last call, waiting up to
    ``timeout`` seconds for the first one (never longer: every wait is bounded).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()

    def post(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def collect(self, timeout: float) -> list[Any]:
        with self._cv:
            if not self._items and timeout > 0:
                self._cv.wait(timeout)
            out = list(self._items)
            self._items.clear()
        return out
