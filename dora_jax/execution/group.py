"""The interpreter of group commands: :class:`GroupWorker` carries each command of
:mod:`dora_jax.execution.commands` out on one group's engine, on whichever thread its transport
applies it (``transport.py``), and keeps what the group did as :class:`GroupEvent` spans (engine
steps, weight loads, KV moves, waits on the environment) stamped with the run's clock.

Handovers: a migration is a :class:`SendRequests` on the source (``Engine.move_out`` packs the
requests' KV) and a :class:`ReceiveRequests` on the destination (``Engine.move_in`` unpacks it);
nothing is prefilled again. A weight load from another group waits for that group's own load of
the version. The transports apply commands in the order the control plane made them, and neither
a send nor an offer of params ever waits on anything, so no cycle of waits can form.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax

from dora_jax import faults
from dora_jax.execution import commands as c
from dora_jax.execution.commands import HOST_GONE, GroupEvent, GroupStatus, TransferError
from dora_jax.orchestrator.backend import GroupTick
from dora_jax.rollout import Engine
from dora_jax.rollout.engine import Handover

# Weight loads read arrays that other threads may be reading at the same moment (one published
# version loaded into several groups at once). Splitting a sharded array into its shards for a
# copy is not safe from several threads at once in jax 0.10 (a copy saw 3 of 4 shards), so the
# copies are started one at a time; waiting for them to land is not serialised.
_LOAD_LOCK = threading.Lock()


class Handoffs:
    """Handovers between the groups of one process, by ticket: the first side to ask makes the
    slot, the receiver takes it away."""

    def __init__(self):
        self._slots: dict[int, Future] = {}
        self._lock = threading.Lock()

    def slot(self, ticket: int) -> Future:
        with self._lock:
            return self._slots.setdefault(ticket, Future())

    def take(self, ticket: int, timeout: float) -> Any:
        out = self.slot(ticket).result(timeout)
        with self._lock:
            self._slots.pop(ticket, None)
        return out


class Place:
    """What the groups of one process share: each other (peer loads), their handovers, and the
    transfer servers to other processes (multi-process runs)."""

    def __init__(self, transfers: Any = None, wait_s: float = 600.0):
        self.workers: dict[int, GroupWorker] = {}
        self.handoffs = Handoffs()
        self.transfers, self.wait_s = transfers, wait_s


def error_text(e: BaseException) -> str:
    """An error as a report carries it: its last frames, type and message."""
    return "".join(traceback.format_exception(e)[-6:])


class GroupWorker:
    def __init__(self, group: int, engine: Engine, now: Callable[[], float], place: Place):
        self.group, self.engine, self.now, self.place = group, engine, now, place
        place.workers[group] = self
        self._versions: dict[int, Future] = {}  # version -> its params, once loaded here
        self._lock = threading.Lock()
        if engine.params is not None:
            self._loaded(engine.version, engine.params)
        self.events: list[GroupEvent] = []  # since the transport last took them
        self.pausing = False  # wall clock: stop stepping (a Pause was applied)
        self.waiting_since: float | None = None  # idle while its conversations wait on the env
        self._to_compile: list[int] | None = None  # wall clock: move sizes left to compile
        self.status = self._status()
        self._table: dict[type, Callable[[Any], Any]] = {
            c.Load: self._load,
            c.OfferParams: self._offer,
            c.Submit: self._submit,
            c.SendRequests: self._send,
            c.ReceiveRequests: self._receive,
            c.Interrupt: self._interrupt,
            c.Extend: self._extend,
            c.End: self._end,
            c.Step: self._logical_step,
            c.Pause: self._pause,
            c.Resume: self._resume,
            c.Snapshot: lambda cmd: self.engine.snapshot(),
            c.Restore: self._restore,
            c.Import: self._import,
        }

    # -- the transports' entry points -------------------------------------------------------------
    def apply(self, cmd: c.GroupCommand) -> Any:
        """Carry ``cmd`` out; returns its value (events go to :attr:`events`)."""
        fn = self._table.get(type(cmd))
        if fn is None:
            raise ValueError(f"group {self.group}: unknown command {type(cmd).__name__}")
        if self.waiting_since is not None:  # a wait on the environment ends with this command
            self._event("env_wait", self.waiting_since, self.engine.num_requests)
            self.waiting_since = None
        try:
            return fn(cmd)
        finally:
            self.status = self._status()

    @property
    def busy(self) -> bool:
        """Whether a wall-clock worker should step now rather than wait for a command."""
        return self.engine.has_work and not self.pausing

    def run_step(self) -> None:
        """One engine step (a wall-clock worker with work)."""
        self.events.append(self._step_event())
        self.status = self._status()

    def idle(self) -> None:
        """A wall-clock worker found nothing to do: note when a wait on the environment began,
        and compile the programs of one more KV-move size (so that a migration does not compile
        them on the spot, inside the run's time)."""
        if self.waiting_since is None and self.engine.waiting_ids():
            self.waiting_since = self.now()
        if self._to_compile is None:
            self._to_compile = self.engine.move_sizes()
        if self._to_compile:
            self.engine.compile_move(self._to_compile.pop(0))

    def take_events(self) -> list[GroupEvent]:
        out, self.events = self.events, []
        return out

    # -- weights ----------------------------------------------------------------------------------
    def params_of(self, version: int) -> Future:
        """This group's params of ``version`` (its load of it may still be queued)."""
        with self._lock:
            return self._versions.setdefault(version, Future())

    def _loaded(self, version: int, params: Any) -> None:
        with self._lock:
            fut = self._versions.get(version)
            if fut is None or fut.done():  # (loaded again: a group may go back to a version)
                fut = self._versions[version] = Future()
            fut.set_result(params)
            # offered to peers: this version and the one before; loads still awaited stay
            older = sorted(v for v, f in self._versions.items() if f.done() and v != version)
            for v in older[:-1]:
                del self._versions[v]

    def _params(self, version: int, params: Any, peer: int | None, ticket: int | None) -> Any:
        p = self.place
        if peer is not None:
            return p.workers[peer].params_of(version).result(p.wait_s)
        if ticket is not None:
            shardings = self.engine.param_shardings
            arrays, _ = p.transfers.fetch(ticket, jax.tree.leaves(shardings), p.wait_s)
            return jax.tree.unflatten(jax.tree.structure(shardings), arrays)
        return params

    def _load(self, cmd: c.Load) -> None:
        t0 = self.now()
        params = self._params(cmd.version, cmd.params, cmd.peer, cmd.ticket)
        with _LOAD_LOCK:
            self.engine.load_params(params, cmd.version)
        jax.block_until_ready(self.engine.params)
        self._loaded(cmd.version, self.engine.params)
        self._event("transfer", t0)

    def _offer(self, cmd: c.OfferParams) -> None:
        self.place.transfers.serve(cmd.ticket, jax.tree.leaves(self.engine.params))

    def _restore(self, cmd: c.Restore) -> None:
        v = cmd.snapshot.version
        self.engine.load_params(self._params(v, cmd.params, None, cmd.ticket), v)
        self.engine.restore(cmd.snapshot)
        self._loaded(cmd.snapshot.version, self.engine.params)

    def _import(self, cmd: c.Import) -> None:
        """Requests recovered from host copies of their KV: they continue here (or wait parked
        until slots and pages allow); a recovery is not a migration."""
        t0 = self.now()
        for part in cmd.parts:
            moves = [r.migrations for r in part.requests]
            self.engine.move_in(Handover(part, [], []))
            for r, m in zip(part.requests, moves, strict=True):
                r.migrations = m
        jax.block_until_ready(self.engine.cache)
        self._event("migrate", t0, self.engine.num_requests)

    # -- requests ---------------------------------------------------------------------------------
    def _submit(self, cmd: c.Submit) -> None:
        self.engine.submit(list(cmd.requests))

    def _send(self, cmd: c.SendRequests) -> None:
        slot = None if cmd.remote else self.place.handoffs.slot(cmd.ticket)
        t0 = self.now()
        try:
            out = self.engine.move_out(list(cmd.ids))
            if out.running is not None:
                jax.block_until_ready(out.running.kv)
        except BaseException as e:
            if slot is not None:
                slot.set_exception(e)
            raise
        self._event("migrate", t0)
        if slot is not None:
            slot.set_result(out)
            return
        running = out.running  # its pack buffer travels as an array of its own
        meta = {
            "running": None if running is None else dataclasses.replace(running, kv=None),
            "queued": out.queued,
            "parked": out.parked,
        }
        self.place.transfers.serve(cmd.ticket, [running.kv] if running is not None else [], meta)

    def _receive(self, cmd: c.ReceiveRequests) -> None:
        p = self.place
        if cmd.remote:
            try:
                arrays, meta = p.transfers.fetch(
                    cmd.ticket,
                    lambda m: [self.engine.buffer_sharding] if m["running"] else [],
                    p.wait_s,
                    keep=True,
                )
            except TransferError as e:
                if HOST_GONE not in str(e):  # (its holder died: recovered by process 0)
                    raise
                arrays, meta = [], {"running": None, "queued": [], "parked": []}  # (recovered)
            r = meta["running"]
            running = None if r is None else dataclasses.replace(r, kv=arrays[0])
            handover = Handover(running, list(meta["queued"]), list(meta["parked"]))
        else:
            handover = p.handoffs.take(cmd.ticket, p.wait_s)
        t0 = self.now()
        self.engine.move_in(handover)
        jax.block_until_ready(self.engine.cache)
        self._event("migrate", t0, self.engine.num_requests)

    def _interrupt(self, cmd: c.Interrupt) -> list:
        held = set(self.engine.request_ids())
        mine = [i for i in cmd.ids if i in held]  # the others finished meanwhile
        return self.engine.interrupt(mine) if mine else []

    def _extend(self, cmd: c.Extend) -> None:
        for rid, tokens in cmd.items:
            self.engine.extend(rid, tuple(tokens))

    def _end(self, cmd: c.End) -> None:
        self.engine.end(list(cmd.ids))

    # -- progress ---------------------------------------------------------------------------------
    def _logical_step(self, cmd: c.Step) -> list[GroupEvent]:
        if self.engine.has_work:  # an empty engine's step is free: skip the call
            self.events.append(self._step_event())
        else:  # idle, or waiting on the environment of the conversations it holds
            kind = "env_wait" if self.engine.waiting_ids() else "idle"
            self._event(kind, self.now(), self.engine.num_requests)
        return self.take_events()

    def _pause(self, cmd: c.Pause) -> None:
        self.pausing = True

    def _resume(self, cmd: c.Resume) -> None:
        self.pausing = False

    def _step_event(self) -> GroupEvent:
        t0 = self.now()
        ld = self.engine.load()
        faults.point("engine_step")
        rep = self.engine.step()
        kind = "prefill" if rep.prefill_tokens else "decode" if rep.decode_tokens else "idle"
        span = self._span(
            kind,
            t0,
            ld.active + ld.pending + ld.parked,
            tokens=rep.sampled_tokens,
            prefill=rep.prefill_tokens,
            reprefill=rep.reprefill_tokens,
        )
        return GroupEvent(self.group, span, tuple(rep.finished), turn_ends=tuple(rep.turn_ends))

    def _event(self, activity: str, t0: float, active: int = 0) -> None:
        self.events.append(GroupEvent(self.group, self._span(activity, t0, active)))

    def _span(self, activity: str, t0: float, active: int = 0, **counts) -> GroupTick:
        t1 = self.now()
        return GroupTick(
            self.group,
            self.engine.version,
            activity,
            active,
            counts.get("tokens", 0),
            counts.get("prefill", 0),
            counts.get("reprefill", 0),
            t1 - t0,
            t0,
            t1,
        )

    def _status(self) -> GroupStatus:
        ld = self.engine.load()
        return GroupStatus(self.engine.held_pages(), ld.pages_used, ld.pages_total)
