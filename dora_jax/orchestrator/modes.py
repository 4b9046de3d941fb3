"""The rollout paradigms as mode objects of one runtime loop, and their registry.

| mode | K used | in flight | barrier | at a weight update, in-flight requests ... | planner |
|---|---|---|---|---|---|
| ``sync`` | 0 | TBS | yes | (none: rollout idles during training) | no |
| ``one_step`` | 1 | TBS | yes | finish under their version (one version per batch) | no |
| ``partial`` | K | RBS | no | are interrupted, re-prefilled, continue under the new one | no |
| ``oversample`` | 0 | RBS | yes | (none: once TBS are ready the rest are aborted, discarded) | no |
| ``dora`` | K | RBS | no | finish under their version; groups re-partitioned | yes |

*Barrier*: a rollout batch is dispatched whole, and only once the previous batch has finished.
The window's room (``versions.py``) does the rest: with K = 0 nothing is dispatched while the
trainer runs, which is what makes ``sync`` synchronous; with K = 1 one batch is generated under
the previous version while the trainer runs, which is ``one_step``.

A mode is one :class:`Mode` object, built from the config by its registered factory
(:func:`register_mode`, :func:`policy_for`). The runtime asks it, and nothing else, what differs:

- ``k``, ``rollout_batch``, ``per_step``: the window's bound, the prompt groups dispatched per
  batch (barrier) or kept in flight (continuous), and those a train step takes as the window
  counts them; ``adapts_k``: whether ``orchestrator.adaptive_k`` re-chooses K;
- ``on_publish(rt, t, version)``: what a new version does to the requests in flight;
- ``before_batch(rt, t)``: what happens before the idle trainer takes a batch;
- ``route(rt, t, infos) -> infos``: group versions and dispatch, every round;
- ``state_dict()`` / ``load_state_dict(state)``: the mode's own state, kept beside the runtime's.

The base class streams: empty groups switch to the newest version as soon as no request of their
version waits, and the newest version is topped up to ``rollout_batch`` prompt groups in flight.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dora_jax.config import schema
from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator.backend import TRAINER, GroupInfo
from dora_jax.orchestrator.planner import (
    MUTABLE_TRIGGERS,
    PlanPolicy,
    Snapshot,
    idle_group_waiting,
    latest_supplement,
    plan,
    plan_trigger,
    trigger_key,
)
from dora_jax.orchestrator.records import PlanRecord

if TYPE_CHECKING:
    from dora_jax.orchestrator.runtime import Runtime


class Mode:
    """A rollout paradigm: the base streams (see the module docstring); subclasses override."""

    name = ""
    adapts_k = False

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.k = cfg.staleness_k  # staleness bound the window enforces
        self.rollout_batch = cfg.rollout_batch_prompts  # per batch (barrier) or in flight
        self.per_step = cfg.train_batch_prompts  # prompt groups a step takes, as the window counts

    def on_publish(self, rt: Runtime, t: float, version: int) -> None:
        """A new version was published: requests in flight go on under their version."""

    def before_batch(self, rt: Runtime, t: float) -> None:
        """The trainer is idle and may take a batch: nothing to do first."""

    def route(self, rt: Runtime, t: float, infos: list[GroupInfo]) -> list[GroupInfo]:
        """Empty groups switch to the newest version, then dispatch; returns the groups."""
        infos = rt.switch_empty_groups(t, infos)
        self.dispatch(rt)
        return infos

    def dispatch(self, rt: Runtime) -> None:
        """Top the newest version up to ``rollout_batch`` prompt groups in flight."""
        if rt.dispatching:
            room = rt.window.room(rt.window.latest)
            n = latest_supplement(rt.manager.in_flight, self.rollout_batch, room)
            rt.manager.dispatch(rt.window.latest, n)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """``state`` is the whole control-plane state (it may come from another mode's run)."""


class Sync(Mode):
    """On-policy: a batch of TBS prompt groups behind a barrier, K = 0."""

    name = "sync"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.k, self.rollout_batch = 0, cfg.train_batch_prompts

    def dispatch(self, rt: Runtime) -> None:
        """A whole batch, once the previous one has finished and the window has room for it."""
        v, n = rt.window.latest, self.rollout_batch
        if rt.dispatching and rt.manager.in_flight == 0 and rt.window.room(v) >= n:
            rt.manager.dispatch(v, n)


class OneStep(Sync):
    """One-step off-policy: the next batch is generated under the previous version (K = 1)."""

    name = "one_step"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        if cfg.staleness_k < 1:
            raise ValueError("one_step mode trains on the previous version: needs staleness_k >= 1")
        self.k = 1


class Oversample(Sync):
    """RBS prompt groups behind a barrier; once TBS are ready, the rest are aborted (K = 0)."""

    name = "oversample"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.rollout_batch = self.per_step = cfg.rollout_batch_prompts

    def before_batch(self, rt: Runtime, t: float) -> None:
        tbs = self.cfg.train_batch_prompts
        if rt.queue.num_ready >= tbs:
            keep = {rg.prompt_group for rg in rt.queue.select(tbs)}
            ready = [rg.prompt_group for rg in rt.queue.ready_groups()]
            rt.discard(t, [pg for pg in ready if pg not in keep] + rt.queue.open_groups())


class Partial(Mode):
    """Streams; at each update every request is interrupted, every group switches to the new
    version, and the requests are re-prefilled and continue under it (their span grows)."""

    name = "partial"

    def on_publish(self, rt: Runtime, t: float, version: int) -> None:
        infos = rt.backend.groups()
        running = [rid for g in infos for rid in g.requests]
        partials = rt.backend.interrupt(running) if running else []
        host = {g.group: g.host for g in infos}
        for g in infos:
            if g.version != version:
                rt.send_weights(t, g.group, version, TRAINER, host)
        rt.manager.upgrade_unstarted(version)
        rt.manager.retag_pending(version)
        rt.manager.requeue(partials, version)


class Dora(Mode):
    """Streams under several versions; on a trigger the planner re-partitions the groups across
    them (migrations, weight transfers, supplements), otherwise the newest version is topped up.
    Its state: when it last planned, whether a version came since, and the muted triggers."""

    name = "dora"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.adapts_k = cfg.adaptive_k
        self.plan_policy = PlanPolicy(
            rollout_batch_prompts=self.rollout_batch,
            kv_pressure_threshold=cfg.kv_pressure_threshold,
            legacy_fill=cfg.legacy_fill,
            prefer_local=cfg.prefer_local_moves,
        )
        self.last_plan: float | None = None
        self.new_version = True  # the initial version counts as new: plan at the first round
        # triggers whose last plan moved nothing, with what must change before they fire again
        self.muted: dict[str, object] = {}

    def state_dict(self) -> dict:
        return {"last_plan": self.last_plan, "new_version": self.new_version,
                "muted": dict(self.muted)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.last_plan = state.get("last_plan")
        self.new_version = state.get("new_version", True)
        self.muted = dict(state.get("muted", {}))

    def on_publish(self, rt: Runtime, t: float, version: int) -> None:
        self.new_version = True

    def route(self, rt: Runtime, t: float, infos: list[GroupInfo]) -> list[GroupInfo]:
        cfg, kv, now = self.cfg, self.cfg.kv_pressure_threshold, self._period_clock(rt)
        since = now - self.last_plan if self.last_plan is not None else now + 1
        waiting = rt.manager.pending_by_version()
        trigger = plan_trigger(
            new_version=self.new_version,
            groups=infos,
            kv_pressure_threshold=kv,
            ticks_since_plan=since,
            period=cfg.plan_period_ticks,
            idle_waiting=cfg.plan_on_idle and idle_group_waiting(infos, waiting),
            muted=self.muted,
            pending=waiting,
        )
        if trigger is None:
            self.dispatch(rt)
            return infos
        self.new_version, self.last_plan = False, now
        w = rt.window
        rt.manager.upgrade_unstarted(w.latest)
        snap = Snapshot(
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
        )
        collecting = gc.isenabled()
        gc.disable()  # a collection of the whole run's records would land in the plan's time
        try:
            t0 = time.perf_counter()
            p = plan(snap, self.plan_policy)
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
        n_sup = 0
        if rt.dispatching:
            for v, n in p.supplements:
                rt.manager.dispatch(v, n)
                n_sup += n
        if p.migrations:
            rt.records.migrations.append((t, p.migrated_requests))
        if p.moves:
            self.muted.clear()  # the cluster changed: every trigger may fire again
        elif trigger in MUTABLE_TRIGGERS and cfg.plan_hysteresis:
            self.muted[trigger] = trigger_key(trigger, infos, snap.pending, kv)
        record = PlanRecord(t, trigger, ms, len(p.transfers), p.migrated_requests, n_sup)
        rt.records.plans.append(record)
        return rt.backend.groups()

    @staticmethod
    def _period_clock(rt: Runtime) -> float:
        """What ``plan_period_ticks`` counts: ticks, or on the wall clock engine steps per group
        (groups step at their own pace, so rounds would count faster with more groups)."""
        if rt.clock.kind == "logical":
            return rt.tick_index
        return rt.engine_steps / max(1, rt.records.num_groups)


# -- registry --------------------------------------------------------------------------------------

_FACTORIES: dict[str, Callable[[OrchestratorConfig], Mode]] = {}


def register_mode(name: str, factory: Callable[[OrchestratorConfig], Mode]) -> None:
    """Make ``orchestrator.mode: name`` run the mode ``factory(cfg)`` builds (a :class:`Mode`
    subclass is such a factory); config validation accepts the name from now on."""
    _FACTORIES[name] = factory
    if name not in schema.MODE_NAMES:
        schema.MODE_NAMES.append(name)


for _cls in (Sync, OneStep, Partial, Oversample, Dora):
    register_mode(_cls.name, _cls)
MODES = tuple(_FACTORIES)  # the built-in modes


def policy_for(cfg: OrchestratorConfig) -> Mode:
    """The mode object of ``cfg.mode``; ``one_step`` needs ``staleness_k >= 1``."""
    factory = _FACTORIES.get(cfg.mode)
    if factory is None:
        raise ValueError(f"unknown mode {cfg.mode!r}; expected one of {tuple(_FACTORIES)}")
    return factory(cfg)
