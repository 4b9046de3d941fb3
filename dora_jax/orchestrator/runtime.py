"""The control-plane loop: one runtime, five modes (``modes.py``), any ``RolloutBackend``.

Each :meth:`Runtime.tick`:

1. if the running train step has lasted its ticks, publish its version (window, backend); in
   ``partial`` mode every in-flight request is interrupted, every group switches to the new
   version, and the requests wait to be re-prefilled under it;
2. if the trainer is idle, take a batch: ``TBS`` ready prompt groups, oldest version first, when
   the window allows (``oversample``: abort and discard everything else first);
3. ``dora``: on a trigger (new version, KV pressure, period, a group idle while requests of
   another version wait) run the planner and carry its plan out (migrations, weight transfers,
   supplements); otherwise top the newest version up to ``RBS`` prompt groups in flight. Other
   modes: empty groups switch to the newest version; dispatch per the mode (batch or top-up);
4. admit pending requests to free slots of groups holding their version;
5. step the backend; finished requests go to the transfer queue; record the tick.

The trainer is abstract: ``step(batch) -> new_version`` and ``duration_ticks(batch)``. The
runtime calls ``step`` when it hands the batch over and publishes the version ``duration_ticks``
later, so rollout ticks overlap training ticks exactly as far as the mode's window allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator.backend import TRAINER, GroupInfo, RolloutBackend
from dora_jax.orchestrator.modes import ModePolicy, policy_for
from dora_jax.orchestrator.planner import (
    PlanPolicy,
    Snapshot,
    latest_supplement,
    plan,
    plan_trigger,
)
from dora_jax.orchestrator.records import ClusterTick, PlanRecord, Records, StepRecord, Summary
from dora_jax.orchestrator.rollout_manager import PromptSource, RolloutManager
from dora_jax.orchestrator.transfer_queue import ReadyGroup, TransferQueue
from dora_jax.orchestrator.versions import VersionWindow


class Trainer(Protocol):
    """What the runtime needs from a trainer."""

    def step(self, batch: list[ReadyGroup]) -> int:
        """Train on ``batch`` (prompt groups); return the new version (the previous one + 1)."""
        ...

    def duration_ticks(self, batch: list[ReadyGroup]) -> int:
        """How many ticks that step takes (>= 1); the new version is published after them."""
        ...


class StallError(RuntimeError):
    """The run made no progress for too long (a control-plane bug)."""


@dataclass
class RunResult:
    summary: Summary
    records: Records
    ledger: dict[int, str]  # request id -> final state


class Runtime:
    """Drives a backend and a trainer under one mode; see the module docstring."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        group_size: int,
        backend: RolloutBackend,
        trainer: Trainer,
        prompts: PromptSource,
        *,
        initial_version: int = 0,
    ):
        self.cfg = cfg
        self.policy: ModePolicy = policy_for(cfg)
        self.group_size = group_size
        self.backend = backend
        self.trainer = trainer
        self.window = VersionWindow(self.policy.k, self.policy.per_step, initial_version)
        self.queue = TransferQueue(group_size)
        self.manager = RolloutManager(group_size, prompts, self.window, self.queue)
        self.plan_policy = PlanPolicy(
            rollout_batch_prompts=self.policy.rollout_batch,
            kv_pressure_threshold=cfg.kv_pressure_threshold,
            legacy_fill=self.policy.legacy_fill,
        )
        infos = backend.groups()
        self.records = Records(
            self.policy.name,
            len(infos),
            max(g.max_slots for g in infos),
            getattr(backend, "tokens_per_slot_tick", 1),
        )
        self.records.consumed = self.queue.consumed
        self.tick_index = 0
        self.steps_done = 0
        self.dispatching = True  # False while draining: no new prompts
        self._train: tuple[int, int, int, int] | None = None  # (start, end, new version, maxst)
        self._last_plan: int | None = None
        self._new_version = True  # the initial version counts as new: plan at the first tick

    # -- one tick --------------------------------------------------------------------------------

    def tick(self) -> None:
        t = self.tick_index
        if self._train is not None and t >= self._train[1]:
            self._publish(t)
        if self._train is None:
            self._maybe_train(t)
        infos = self.backend.groups()
        if self.policy.planner:
            infos = self._plan_or_top_up(t, infos)
        else:
            infos = self._switch_empty_groups(t, infos)
            self._dispatch()
        self.manager.admit(self.backend, infos)
        cluster = ClusterTick(
            t, self.manager.pending_count(), self.manager.in_flight, self.queue.num_ready,
            self._train is not None, self.window.latest, self.window.num_live(),
        )  # fmt: skip
        events = self.backend.step()
        for fr in events.finished:
            self.manager.on_finished(fr, t)
        self.records.add_tick(events, cluster)
        self.tick_index += 1

    def _publish(self, t: int) -> None:
        start, _, version, maxst = self._train
        self.window.publish(version)
        self.backend.publish(version)
        self.steps_done += 1
        n = self.records.steps[-1].prompt_groups if self.records.steps else 0
        self.records.steps[-1] = StepRecord(start, t, version, n, maxst)
        self._train = None
        self._new_version = True
        if self.policy.on_update == "reprefill":
            infos = self.backend.groups()
            running = [rid for g in infos for rid in g.requests]
            partials = self.backend.interrupt(running) if running else []
            for g in infos:
                if g.version != version:
                    self.backend.set_version(g.group, version, TRAINER)
                    self.records.transfers.append((t, g.group, version))
            self.manager.upgrade_unstarted(version)
            self.manager.retag_pending(version)
            self.manager.requeue(partials, version)

    def _maybe_train(self, t: int) -> None:
        tbs = self.cfg.train_batch_prompts
        if self.policy.abort_surplus and self.queue.num_ready >= tbs:
            keep = {rg.prompt_group for rg in self.queue.select(tbs)}
            drop = [rg.prompt_group for rg in self.queue.ready_groups()
                    if rg.prompt_group not in keep] + self.queue.open_groups()  # fmt: skip
            if drop:
                self.records.discards.append((t, self.manager.abort(self.backend, drop)))
        flush = not self.dispatching and self.manager.in_flight == 0
        if self.queue.num_ready < tbs and not (flush and self.queue.num_ready):
            return
        batch = self.queue.select(tbs)
        if not self.window.can_step([rg.version for rg in batch]):
            return
        v = self.window.latest
        self.window.begin_step([rg.version for rg in batch])
        self.queue.take(batch, v, t)
        self.manager.on_consumed(batch)
        new_version = self.trainer.step(batch)
        if new_version != v + 1:
            raise RuntimeError(f"trainer returned version {new_version} after a step at v{v}")
        ticks = max(1, int(self.trainer.duration_ticks(batch)))
        maxst = max(v - rg.version for rg in batch)
        self._train = (t, t + ticks, new_version, maxst)
        self.records.steps.append(StepRecord(t, t + ticks, new_version, len(batch), maxst))

    # -- group versions and dispatch -------------------------------------------------------------

    def _switch_empty_groups(self, t: int, infos: list[GroupInfo]) -> list[GroupInfo]:
        latest, changed = self.window.latest, False
        for g in infos:
            if g.version != latest and not g.requests and not self.manager.pending_count(g.version):
                self.backend.set_version(g.group, latest, TRAINER)
                self.records.transfers.append((t, g.group, latest))
                changed = True
        return self.backend.groups() if changed else infos

    def _dispatch(self) -> None:
        if not self.dispatching:
            return
        v, n = self.window.latest, self.policy.rollout_batch
        if self.policy.barrier:
            if self.manager.in_flight == 0 and self.window.room(v) >= n:
                self.manager.dispatch(v, n)
        else:
            in_flight = self.manager.in_flight
            self.manager.dispatch(v, latest_supplement(in_flight, n, self.window.room(v)))

    def _plan_or_top_up(self, t: int, infos: list[GroupInfo]) -> list[GroupInfo]:
        since = t - self._last_plan if self._last_plan is not None else t + 1
        idle_waiting = False
        if self.policy.plan_on_idle and self.manager.pending_count():
            waiting = self.manager.pending_by_version()
            idle_waiting = any(
                not g.requests and not g.busy_ticks and any(v != g.version for v in waiting)
                for g in infos
            )
        trigger = plan_trigger(
            new_version=self._new_version,
            groups=infos,
            kv_pressure_threshold=self.cfg.kv_pressure_threshold,
            ticks_since_plan=since,
            period=self.cfg.plan_period_ticks,
            idle_waiting=idle_waiting,
        )
        if trigger is None:
            self._dispatch()
            return infos
        self._new_version = False
        self._last_plan = t
        w = self.window
        self.manager.upgrade_unstarted(w.latest)
        snap = Snapshot(
            tick=t,
            latest=w.latest,
            oldest=w.oldest,
            groups=tuple(infos),
            pending=self.manager.pending_by_version(),
            in_flight=self.manager.in_flight if self.dispatching else self.policy.rollout_batch,
            room={v: w.room(v) for v in range(max(w.oldest, w.first), w.latest + 1)},
            group_size=self.group_size,
            trigger=trigger,
        )
        t0 = time.perf_counter()
        p = plan(snap, self.plan_policy)
        ms = (time.perf_counter() - t0) * 1e3
        for m in p.migrations:
            self.backend.migrate(list(m.request_ids), m.src, m.dst)
        for x in p.transfers:
            self.backend.set_version(x.group, x.version, x.source)
            self.records.transfers.append((t, x.group, x.version))
        n_sup = 0
        if self.dispatching:
            for v, n in p.supplements:
                self.manager.dispatch(v, n)
                n_sup += n
        if p.migrations:
            self.records.migrations.append((t, p.migrated_requests))
        self.records.plans.append(
            PlanRecord(t, trigger, ms, len(p.transfers), p.migrated_requests, n_sup)
        )
        return self.backend.groups()

    # -- running ---------------------------------------------------------------------------------

    def done_draining(self) -> bool:
        return (
            self._train is None
            and self.manager.in_flight == 0
            and self.queue.num_ready == 0
            and self.manager.pending_count() == 0
        )

    def run(self, num_steps: int, *, drain: bool = False, max_ticks: int = 1_000_000) -> RunResult:
        """Tick until ``num_steps`` train steps have ended; with ``drain``, then stop dispatching
        and tick until every dispatched request has been consumed (or discarded)."""
        target = self.steps_done + num_steps
        while self.steps_done < target:
            self._guard(max_ticks)
            self.tick()
        if drain:
            self.dispatching = False
            while not self.done_draining():
                self._guard(max_ticks)
                self.tick()
        return RunResult(self.records.summary(target), self.records, dict(self.manager.status))

    def _guard(self, max_ticks: int) -> None:
        if self.tick_index >= max_ticks:
            raise StallError(
                f"{self.policy.name}: no end after {max_ticks} ticks: steps {self.steps_done}, "
                f"window v{self.window.latest} open {self.window.live_versions()}, "
                f"in flight {self.manager.in_flight}, ready {self.queue.num_ready}, "
                f"pending {self.manager.pending_by_version()}, training {self._train}"
            )
