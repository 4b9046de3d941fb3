"""Fault injection for tests: a process that kills itself (or raises) at a named point.

``DORA_FAULT=POINT[@N][:ACTION][,...]`` arms :func:`point`: the ``N``-th time (default the
first) this process reaches ``POINT``, it does ``ACTION``:

- ``kill`` (default): ``SIGKILL`` to itself, as a power cut or the OOM killer would;
- ``raise``: raises :class:`InjectedFault` (an unexpected crash inside the run);
- ``enospc``: raises ``OSError(ENOSPC)`` (a full disk).

The points: ``save`` (a checkpoint handed to orbax, still being written when saves are async),
``train_step`` (the jitted step dispatched, its results not yet taken in), ``migration`` (requests
left their source group's books, not yet moved), ``eval`` (inside a held-out evaluation),
``warm_start`` (after a warm-start step), ``engine_step`` (a rollout engine about to take a step:
``raise`` there is a failed engine, which the run recovers from).
Unset, :func:`point` costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

ENV = "DORA_FAULT"
POINTS = ("save", "train_step", "migration", "eval", "warm_start", "engine_step")
ACTIONS = ("kill", "raise", "enospc")
_reached: Counter = Counter()
_parsed: tuple[str, dict[str, tuple[int, str]]] | None = None


class InjectedFault(RuntimeError):
    """Raised at a fault point armed with ``:raise``."""


def _plan() -> dict[str, tuple[int, str]]:
    global _parsed
    spec = os.environ.get(ENV, "")
    if _parsed is None or _parsed[0] != spec:
        plan = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            where, _, action = item.partition(":")
            name, _, n = where.partition("@")
            action = action or "kill"
            if name not in POINTS or action not in ACTIONS or (n and not n.isdigit()):
                raise ValueError(
                    f"{ENV}={spec!r}: {item!r} is not POINT[@N][:ACTION] with POINT in "
                    f"{POINTS} and ACTION in {ACTIONS}"
                )
            plan[name] = (int(n or 1), action)
        _parsed = (spec, plan)
    return _parsed[1]


def reset() -> None:
    """Forget the visits counted so far (tests that run several commands in one process)."""
    _reached.clear()


def point(name: str) -> None:
    """Count a visit to ``name``; act if ``DORA_FAULT`` arms this visit."""
    if ENV not in os.environ:
        return
    plan = _plan()
    if name not in plan:
        return
    _reached[name] += 1
    n, action = plan[name]
    if _reached[name] != n:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"<{ENV} at {name}>")
    raise InjectedFault(f"{ENV}: injected fault at {name} (visit {n})")
