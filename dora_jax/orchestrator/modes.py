"""The rollout paradigms, each one object the runtime loop asks what differs, and their registry.

A mode is a :class:`Mode` built from the config by the factory registered under its name
(:func:`register_mode`, :func:`mode_for`); its attributes and hooks are the runtime's decision
points, and each class says what its paradigm does at them. The base streams: empty groups switch
to the newest version once no request of theirs waits, and the newest version is topped up to
``rollout_batch`` prompt groups in flight.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Literal, Protocol, get_args

from dora_jax.config import schema
from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator import planner
from dora_jax.orchestrator.backend import GroupInfo, RolloutBackend, Source
from dora_jax.orchestrator.clock import LogicalClock, WallClock
from dora_jax.orchestrator.records import PlanRecord, Records
from dora_jax.orchestrator.rollout_manager import RolloutManager
from dora_jax.orchestrator.transfer_queue import TransferQueue
from dora_jax.orchestrator.versions import VersionWindow


class RuntimeView(Protocol):
    """What a mode's hooks are given of the runtime that calls them (``runtime.Runtime``): its
    parts to read and act on, and the three actions that go through the runtime's records."""

    clock: LogicalClock | WallClock
    backend: RolloutBackend
    window: VersionWindow  # the versions in flight and the room under the staleness bound
    queue: TransferQueue  # finished prompt groups waiting for the trainer
    manager: RolloutManager  # prompt groups in flight, by version
    records: Records
    group_size: int
    tick_index: int
    engine_steps: int  # wall clock: engine steps reported by all groups
    dispatching: bool  # False while the run drains: no new prompts

    def switch_empty_groups(self, t: float, infos: list[GroupInfo]) -> list[GroupInfo]: ...

    def send_weights(
        self, t: float, group: int, version: int, source: Source, host: dict
    ) -> None: ...

    def discard(self, t: float, prompt_groups: list[int]) -> None: ...


class Mode:
    """A rollout paradigm; this base streams (module docstring), subclasses override hooks."""

    name = ""  # the name it is registered under
    adapts_k = False  # whether K is re-chosen after each step (staleness_k: auto)

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.k = cfg.k_bound  # staleness bound the window enforces (auto: the largest)
        self.rollout_batch = cfg.rollout_batch_prompts  # per batch (barrier) or in flight
        self.per_step = cfg.train_batch_prompts  # prompt groups a step takes, as the window counts

    def on_publish(self, rt: RuntimeView, t: float, version: int) -> None:
        """A new version was published: requests in flight go on under their version."""

    def before_batch(self, rt: RuntimeView, t: float) -> None:
        """The trainer is idle and may take a batch: nothing to do first."""

    def route(self, rt: RuntimeView, t: float, infos: list[GroupInfo]) -> list[GroupInfo]:
        """Empty groups switch to the newest version, then dispatch; returns the groups."""
        infos = rt.switch_empty_groups(t, infos)
        self.dispatch(rt)
        return infos

    def dispatch(self, rt: RuntimeView) -> None:
        """Top the newest version up to ``rollout_batch`` prompt groups in flight."""
        if rt.dispatching:
            room = rt.window.room(rt.window.latest)
            n = planner.latest_supplement(rt.manager.in_flight, self.rollout_batch, room)
            rt.manager.dispatch(rt.window.latest, n)

    def state_dict(self) -> dict:
        """The mode's own keys, saved beside the runtime's (plain data)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """``state``: the whole control-plane state (it may come from another mode's run)."""


class Sync(Mode):
    """On-policy (K = 0): a batch of TBS prompt groups behind a barrier, dispatched whole once the
    previous one has finished. The window's room does the rest: with K = 0 nothing is dispatched
    while the trainer runs (rollout idles during training); with K = 1 one batch is generated
    under the previous version while it runs (``one_step``)."""

    name = "sync"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.k, self.rollout_batch = 0, cfg.train_batch_prompts

    def dispatch(self, rt: RuntimeView) -> None:
        """A whole batch, once the previous one has finished and the window has room for it."""
        v, n = rt.window.latest, self.rollout_batch
        if rt.dispatching and rt.manager.in_flight == 0 and rt.window.room(v) >= n:
            rt.manager.dispatch(v, n)


class OneStep(Sync):
    """One-step off-policy (K = 1): the next batch is generated under the previous version while
    the trainer runs; in-flight requests finish under their version (one version per batch). The
    config refuses it a ``staleness_k`` of 0."""

    name = "one_step"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.k = 1


class Oversample(Sync):
    """On-policy (K = 0): RBS prompt groups behind a barrier; once TBS are ready, everything else
    is aborted and discarded (the long tail: a bias to short responses)."""

    name = "oversample"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.rollout_batch = self.per_step = cfg.rollout_batch_prompts

    def before_batch(self, rt: RuntimeView, t: float) -> None:
        tbs = self.cfg.train_batch_prompts
        if rt.queue.num_ready >= tbs:
            keep = {rg.prompt_group for rg in rt.queue.select(tbs)}
            ready = [rg.prompt_group for rg in rt.queue.ready_groups()]
            rt.discard(t, [pg for pg in ready if pg not in keep] + rt.queue.open_groups())


class Partial(Mode):
    """Streams (K, RBS); at each update every request is interrupted, every group switches to the
    new version, and the requests are re-prefilled and continue under it (their span grows)."""

    name = "partial"

    def on_publish(self, rt: RuntimeView, t: float, version: int) -> None:
        running = [rid for g in rt.backend.groups() for rid in g.requests]
        partials = rt.backend.interrupt(running) if running else []
        rt.manager.upgrade_unstarted(version)
        rt.manager.retag_pending(version)
        rt.manager.requeue(partials, version)
        rt.switch_empty_groups(t, rt.backend.groups())  # all of them: every request waits now


class Dora(Mode):
    """Streams (K, RBS) under several versions: in-flight requests finish under their version; on
    a trigger the planner re-partitions the groups across versions (migrations, weight transfers,
    supplements), otherwise the newest version is topped up. Its state: when it last planned,
    whether a version came since, and the triggers muted (a plan of theirs moved nothing)."""

    name = "dora"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.adapts_k = cfg.auto_k
        self.plan_policy = planner.PlanPolicy(
            rollout_batch_prompts=self.rollout_batch,
            kv_pressure_threshold=cfg.kv_pressure_threshold,
            legacy_fill=cfg.legacy_fill,
            prefer_local=cfg.prefer_local_moves,
            **dataclasses.asdict(cfg.planner),
        )
        self.last_plan: float | None = None
        self.new_version = True  # the initial version counts as new: plan at the first round
        self.muted: dict[str, object] = {}  # trigger -> what must change before it fires again

    def state_dict(self) -> dict:
        return dict(last_plan=self.last_plan, new_version=self.new_version, muted=dict(self.muted))

    def load_state_dict(self, state: dict) -> None:
        self.last_plan, self.new_version = state.get("last_plan"), state.get("new_version", True)
        self.muted = dict(state.get("muted", {}))

    def on_publish(self, rt: RuntimeView, t: float, version: int) -> None:
        self.new_version = True

    def route(self, rt: RuntimeView, t: float, infos: list[GroupInfo]) -> list[GroupInfo]:
        cfg, kv = self.cfg, self.cfg.kv_pressure_threshold
        # plan_period_ticks counts ticks, or on the wall clock engine steps per group (groups
        # step at their own pace, so rounds would count faster with more groups)
        now = rt.clock.plan_time(rt.tick_index, rt.engine_steps / max(1, rt.records.num_groups))
        since = now - self.last_plan if self.last_plan is not None else now + 1
        waiting = rt.manager.pending_by_version()
        trigger = planner.plan_trigger(
            new_version=self.new_version,
            groups=infos,
            kv_pressure_threshold=kv,
            ticks_since_plan=since,
            period=cfg.plan_period_ticks,
            idle_waiting=cfg.plan_on_idle and planner.idle_group_waiting(infos, waiting),
            muted=self.muted,
            pending=waiting,
        )
        if trigger is None:
            self.dispatch(rt)
            return infos
        self.new_version, self.last_plan = False, now
        w = rt.window
        rt.manager.upgrade_unstarted(w.latest)
        snap = planner.Snapshot(
            tick=t,
            latest=w.latest,
            oldest=w.oldest,
            groups=tuple(infos),
            pending=rt.manager.pending_by_version(),
            in_flight=rt.manager.in_flight if rt.dispatching else self.rollout_batch,
            room={v: w.room(v) for v in range(max(w.oldest, w.first), w.latest + 1)},
            group_size=rt.group_size,
            trigger=trigger,
            ready=rt.queue.num_ready,
            train_batch=cfg.train_batch_prompts,
            sendable=frozenset(getattr(rt.backend, "sendable_versions", frozenset)()),
        )
        collecting = gc.isenabled()
        gc.disable()  # a collection of the whole run's records would land in the plan's time
        try:
            t0 = time.perf_counter()
            p = planner.plan(snap, self.plan_policy)
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            if collecting:
                gc.enable()
        host = {g.group: g.host for g in infos}
        for m in p.migrations:
            rt.backend.migrate(list(m.request_ids), m.src, m.dst)
            if host[m.src] != host[m.dst]:
                rt.records.cross_host.append((t, "kv", m.src, m.dst, len(m.request_ids)))
        for x in p.transfers:
            rt.send_weights(t, x.group, x.version, x.source, host)
        supplements = p.supplements if rt.dispatching else ()
        for v, n in supplements:
            rt.manager.dispatch(v, n)
        if p.migrations:
            rt.records.migrations.append((t, p.migrated_requests))
        if p.moves:
            self.muted.clear()  # the cluster changed: every trigger may fire again
        elif trigger in planner.MUTABLE_TRIGGERS and cfg.plan_hysteresis:
            self.muted[trigger] = planner.trigger_key(trigger, infos, snap.pending, kv)
        n_sup = sum(n for _, n in supplements)
        record = PlanRecord(t, trigger, ms, len(p.transfers), p.migrated_requests, n_sup)
        rt.records.plans.append(record)
        return rt.backend.groups()


# -- registry --------------------------------------------------------------------------------------

_FACTORIES: dict[str, Callable[[OrchestratorConfig], Mode]] = {}


def register_mode(name: str, factory: Callable[[OrchestratorConfig], Mode]) -> None:
    """Make ``orchestrator.mode: name`` run the mode ``factory(cfg)`` builds (its ``name``:
    ``name``; a :class:`Mode` subclass is such a factory); the config accepts the name from now."""
    _FACTORIES[name] = factory
    if name not in get_args(schema.Mode):  # the config's orchestrator.mode takes it from now on
        schema.Mode = Literal[(*get_args(schema.Mode), name)]


for _cls in (Sync, OneStep, Partial, Oversample, Dora):
    register_mode(_cls.name, _cls)
MODES = tuple(_FACTORIES)  # the built-in modes


def mode_for(cfg: OrchestratorConfig) -> Mode:
    """A new mode object for ``cfg.mode`` (the config checked the name); ValueError where the
    mode refuses the config (a registered mode may check more than the config does)."""
    return _FACTORIES[cfg.mode](cfg)
