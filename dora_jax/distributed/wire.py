"""The execution layer's records as plain data for messages (``codec.py`` makes them bytes)."""

from __future__ import annotations

import dataclasses

from dora_jax.execution.group import GroupEvent, GroupStatus
from dora_jax.orchestrator.backend import GroupTick
from dora_jax.rollout import FinishedRequest
from dora_jax.rollout.engine import EngineSnapshot
from dora_jax.rollout.requests import exported_as_data as exported
from dora_jax.rollout.requests import exported_from_data as to_exported
from dora_jax.rollout.requests import request_as_data as request
from dora_jax.rollout.requests import request_from_data as to_request


def snapshot(s: EngineSnapshot) -> dict:
    return {
        "version": s.version,
        "running": exported(s.running),
        "pending": [request(r) for r in s.pending],
        "parked": [exported(p) for p in s.parked],
    }


def to_snapshot(d: dict) -> EngineSnapshot:
    return EngineSnapshot(
        d["version"], to_exported(d["running"]), [to_request(r) for r in d["pending"]],
        [to_exported(p) for p in d["parked"]],
    )  # fmt: skip


def event(e: GroupEvent) -> dict:
    return {
        "group": e.group,
        "span": list(e.span) if e.span is not None else None,
        "finished": [dataclasses.asdict(f) for f in e.finished],
        "error": None if e.error is None else f"{type(e.error).__name__}: {e.error}",
        "turn_ends": [dataclasses.asdict(f) for f in e.turn_ends],
    }


def to_event(d: dict, host: int) -> GroupEvent:
    span = GroupTick(*d["span"]) if d["span"] is not None else None
    err = RemoteError(f"on process {host}: {d['error']}") if d["error"] else None
    finished = tuple(_finished(f) for f in d["finished"])
    return GroupEvent(d["group"], span, finished, err, tuple(_finished(f) for f in d["turn_ends"]))


def _finished(f: dict) -> FinishedRequest:
    tuples = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
              for k, v in f.items() if isinstance(v, list)}  # fmt: skip
    return FinishedRequest(**(f | tuples))


def status(s: GroupStatus) -> dict:
    return {"pages": [[k, v] for k, v in s.pages.items()], "used": s.pages_used,
            "total": s.pages_total}  # fmt: skip


def to_status(d: dict) -> GroupStatus:
    return GroupStatus({k: v for k, v in d["pages"]}, d["used"], d["total"])


class RemoteError(RuntimeError):
    """An error raised in another process (its type and message)."""
