"""The control-plane loop: one runtime, any mode object (``modes.py``), any ``RolloutBackend``,
either clock (``clock.py``).

Each :meth:`Runtime.tick` (one control round):

1. if the running train step has ended, publish its version (window, backend), then
   ``mode.on_publish`` (what it does to the requests in flight), then tell the observers;
2. if the trainer is idle, ``mode.before_batch``, then take ``TBS`` ready prompt groups, oldest
   version first, when the window allows;
3. ``mode.route``: group versions and dispatch (``dora``: the planner);
4. admit pending requests to free slots of groups holding their version;
5. step the backend; finished requests go to the transfer queue; record the round.

Time: on the logical clock ``now`` is the tick index and the backend advances every group one
engine step per tick; on the wall clock ``now`` is seconds since the start, groups run on their
own, and ``backend.step()`` returns what they reported since the last round.

The trainer is a :class:`StepRunner` (``start(batch, now)``, ``poll(now)``): on the wall clock a
worker thread runs the step while rollout goes on, and the version is published when the step
has ended. A :class:`LogicalTrainer` (``step(batch) -> new_version`` and
``duration_ticks(batch)``) is wrapped in :class:`TickedTrainer`: the step runs when the batch is
handed over and its version is published ``duration_ticks`` later, so rollout ticks overlap
training ticks exactly as far as the mode's window allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator.backend import TRAINER, GroupInfo, RolloutBackend, Source, StepEvents
from dora_jax.orchestrator.clock import LogicalClock, WallClock
from dora_jax.orchestrator.modes import Mode, mode_for
from dora_jax.orchestrator.records import ClusterTick, Records, StepRecord, Summary
from dora_jax.orchestrator.rollout_manager import DISCARDED, PromptStream, RolloutManager
from dora_jax.orchestrator.staleness import DriftK
from dora_jax.orchestrator.transfer_queue import ReadyGroup, TransferQueue
from dora_jax.orchestrator.versions import VersionWindow


class LogicalTrainer(Protocol):
    """What the runtime needs from a trainer."""

    def step(self, batch: list[ReadyGroup]) -> int:
        """Train on ``batch`` (prompt groups); return the new version (the previous one + 1)."""
        ...

    def duration_ticks(self, batch: list[ReadyGroup]) -> int:
        """How many ticks that step takes (>= 1); the new version is published after them."""
        ...


@runtime_checkable
class StepRunner(Protocol):
    """The runtime's view of a trainer: a step runs between ``start`` and the ``poll`` that
    returns ``(new_version, t0, t1)`` (when it ran, on the run's clock); ``None`` until then."""

    def start(self, batch: list[ReadyGroup], now: float) -> None: ...

    def poll(self, now: float) -> tuple[int, float, float] | None: ...


class TickedTrainer:
    """A :class:`LogicalTrainer` as a :class:`StepRunner`: the step runs at ``start`` and ends
    ``duration_ticks`` ticks later."""

    def __init__(self, inner: LogicalTrainer):
        self.inner = inner
        self._job: tuple[int, float, float] | None = None

    def start(self, batch: list[ReadyGroup], now: float) -> None:
        version = self.inner.step(batch)
        self._job = (version, now, now + max(1, int(self.inner.duration_ticks(batch))))

    def poll(self, now: float) -> tuple[int, float, float] | None:
        if self._job is None or now < self._job[2]:
            return None
        job, self._job = self._job, None
        return job


class Observer(Protocol):
    """Told of every published version, inside the round that publishes it, before the trainer
    takes its next batch (metrics, evaluation, checkpoints; they may :meth:`Runtime.quiesce`)."""

    def on_publish(self, runtime: Runtime, version: int) -> None: ...


class StallError(RuntimeError):
    """The run made no progress for too long (a control-plane bug)."""


@dataclass
class RunResult:
    summary: Summary
    records: Records
    ledger: dict[int, str]  # request id -> state (with history files: the live requests only)
    states: dict[str, int] = field(default_factory=dict)  # requests per state, all of the run


class Runtime:
    """Drives a backend and a trainer under one mode; see the module docstring."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        group_size: int,
        backend: RolloutBackend,
        trainer: LogicalTrainer,
        prompts: PromptStream,
        *,
        clock: LogicalClock | WallClock | None = None,
    ):
        self.cfg = cfg
        self.clock = clock or LogicalClock()
        self.mode: Mode = mode_for(cfg)  # the mode object
        self.group_size = group_size
        self.backend = backend
        self.trainer = trainer if isinstance(trainer, StepRunner) else TickedTrainer(trainer)
        self.window = VersionWindow(self.mode.k, self.mode.per_step)
        self.queue = TransferQueue(group_size)
        self.manager = RolloutManager(
            group_size, prompts, self.window, self.queue, admission=cfg.admission
        )
        infos, tokens = backend.groups(), backend.tokens_per_slot_tick
        slots = max(g.max_slots for g in infos)
        self.records = Records(self.mode.name, len(infos), slots, tokens, clock=self.clock.kind)
        self.records.consumed = self.queue.consumed
        self.tick_index = self.steps_done = 0
        self.dispatching = True  # False while draining: no new prompts
        self.observers: list[Observer] = []
        self.trainer_host = 0  # the process of the trainer (weights it sends count as moves)
        self.stopping = False  # no new train step (a stop was asked): the running one ends
        self.stopped = False  # the last run() ended early on a stop request
        self.at_step_end = False  # the observers of a published step are running (_publish)
        self._step_limit: int | None = None  # wall clock: no step beyond the run's target
        self.max_steps: int | None = None  # no step beyond this many, on either clock
        self._held = False  # wall clock: the groups are paused (between runs)
        self._train: tuple[float, int, int] | None = None  # (start, new version, max staleness)
        self.engine_steps = 0  # wall clock: engine steps reported by all groups
        # staleness_k: auto (orchestrator/staleness.py): time the idle trainer waited for the
        # window since the last publish, when the last publish and round were, the controller
        self._blocked = 0.0
        self._last_publish = 0.0
        self._last_round: float | None = None
        self.adaptive = DriftK(min(cfg.k_min, self.mode.k), self.mode.k, ess_min=cfg.ess_min)
        if self.mode.adapts_k:  # an auto K starts at its smallest and grows when it pays
            self.window.set_k(self.adaptive.k_min)

    # -- one tick --------------------------------------------------------------------------------

    def tick(self) -> None:
        self.clock.begin_round(self.tick_index)
        t = self.clock.now()
        if self._train is not None:
            done = self.trainer.poll(t)
            if done is not None:
                self._publish(t, *done)
        limit = min(n for n in (self._step_limit, self.max_steps, float("inf")) if n is not None)
        if self._train is None and not self.stopping and self.steps_done < limit:
            self._maybe_train(t)
        if self.mode.adapts_k:
            self._count_wait(t)
        infos = self.mode.route(self, t, self.backend.groups())
        self.manager.admit(self.backend, infos)
        self._step_backend(t)

    def _step_backend(self, t: float) -> None:
        """Step the backend; finished requests to the transfer queue (those of discarded prompt
        groups that ended while being interrupted are dropped); the round's record."""
        cluster = ClusterTick(
            self.tick_index,
            self.manager.pending_count(),
            self.manager.in_flight,
            self.queue.num_ready,
            self._train is not None,
            self.window.latest,
            self.window.num_live(),
            t,
        )
        events = self.backend.step()
        self.engine_steps += sum(g.activity in ("prefill", "decode") for g in events.groups)
        for fr in events.finished:
            if self.manager.status.get(fr.request_id) == DISCARDED:
                continue
            self.manager.on_finished(fr, t)
        self._take_recovered(t, events)
        self.records.add_tick(events, cluster)
        self.tick_index += 1

    def _take_recovered(self, t: float, events: StepEvents) -> None:
        """Requests of groups that failed wait again, first in line, for a group of their own
        version (those of discarded prompt groups are dropped); health changes are recorded."""
        for h in events.health:
            self.records.health.append((t, h.group, h.state, h.reason))
        by_version: dict[int, list] = {}
        for p in events.recovered:
            if self.manager.status.get(p.request_id) == DISCARDED:
                continue
            by_version.setdefault(p.versions[-1], []).append(p)
            self.records.recoveries.append((t, p.request_id, p.source))
        for version, partials in by_version.items():
            self.manager.requeue(partials, version)

    @contextmanager
    def quiesce(self) -> Iterator[None]:
        """Hold the run still: every group stops once its queued work (loads, moves in flight)
        is done, and what it reported is taken in, so the control plane and the engines agree
        (checkpoints, evaluation). A no-op on the logical clock, which is still between ticks."""
        held = not self._held and self._hold()
        try:
            yield
        finally:
            if held:
                self._release()

    def _hold(self) -> bool:
        """Pause every group and take in what they reported; whether it did (nothing runs beside
        the control loop on a clock that is not ``concurrent``)."""
        if not self.clock.concurrent:  # (kept: the one rule of holding a run still)
            return False
        self.backend.pause()
        self._held = True
        self._step_backend(self.clock.now())
        return True

    def _release(self) -> None:
        self.backend.resume()
        self._held = False

    def _publish(self, t: float, version: int, t0: float, t1: float) -> None:
        start, expected, maxst = self._train
        if version != expected:
            raise RuntimeError(f"trainer returned version {version}, expected {expected}")
        self.window.publish(version)
        self.backend.publish(version)
        self.steps_done += 1
        n = self.records.steps[-1].prompt_groups if self.records.steps else 0
        start, t = t0, t1  # when the step really ran (a ticked step: its start and end ticks)
        self.records.steps[-1] = StepRecord(start, t, version, n, maxst)
        self._train = None
        if self.mode.adapts_k:
            self._adapt_k(t, version)
        self.mode.on_publish(self, t, version)
        self.records.flush()  # (attached to history files: the records so far go to disk)
        # the state is now a step's end, as a checkpoint saves it; it stays so when an observer
        # raises (the round goes no further): the run can then be saved before it stops
        self.at_step_end = True
        for obs in self.observers:
            obs.on_publish(self, version)
        self.at_step_end = False

    def _count_wait(self, t: float) -> None:
        """Adaptive K: this round counts as waiting for the window when the trainer is idle with
        a full batch ready (the oldest version has not drained)."""
        dt = self.clock.round_length(t, self._last_round)
        self._last_round = t
        if self._train is None and self.queue.num_ready >= self.cfg.train_batch_prompts:
            self._blocked += dt

    def _adapt_k(self, t: float, version: int) -> None:
        """``staleness_k: auto``: re-choose the bound from the drift the step measured (the
        trainer's ``drift()``: tokens and ESS per lag) and the share of the step's interval the
        trainer waited for the window (orchestrator/staleness.py); recorded with its reason."""
        span = t - self._last_publish
        share = self._blocked / span if span > 0 else 0.0
        inner = getattr(self.trainer, "inner", self.trainer)
        measured = getattr(inner, "drift", None)
        signal = measured() if callable(measured) else None
        tokens, ess = signal if signal is not None else ([], [])
        d = self.adaptive.step(version, self.window.target_k, tokens, ess, share)
        self.window.set_k(d.k)
        self.records.k_log.append((t, *d.as_row()))
        self._blocked, self._last_publish = 0.0, t

    def _maybe_train(self, t: int) -> None:
        tbs = self.cfg.train_batch_prompts
        self.mode.before_batch(self, t)
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
        maxst = max(v - rg.version for rg in batch)
        self._train = (t, v + 1, maxst)
        self.records.steps.append(StepRecord(t, t, v + 1, len(batch), maxst))
        self.trainer.start(batch, t)

    # -- group versions and dispatch -------------------------------------------------------------

    def switch_empty_groups(self, t: float, infos: list[GroupInfo]) -> list[GroupInfo]:
        """Every group that holds no request, and whose version no pending request needs,
        switches to the newest version; returns the groups as they are now."""
        latest, host = self.window.latest, {g.group: g.host for g in infos}
        empty = [
            g.group
            for g in infos
            if g.version != latest and not g.requests and not self.manager.pending_count(g.version)
        ]
        for group in empty:
            self.send_weights(t, group, latest, TRAINER, host)
        return self.backend.groups() if empty else infos

    def send_weights(self, t: float, group: int, version: int, source: Source, host: dict) -> None:
        """Load ``version`` onto the empty ``group`` from ``source`` (``TRAINER`` or a group
        holding it), recorded; ``host``: group -> process (a move between processes counts)."""
        self.backend.set_version(group, version, source)
        self.records.transfers.append((t, group, version))
        src = -1 if source == TRAINER else source
        if (self.trainer_host if src < 0 else host[src]) != host[group]:
            self.records.cross_host.append((t, "weights", src, group, 1))

    def discard(self, t: float, prompt_groups: list[int]) -> None:
        """Abort ``prompt_groups`` (running members interrupted, the rest dropped), counted."""
        if prompt_groups:
            self.records.discards.append((t, self.manager.abort(self.backend, prompt_groups)))

    # -- state -----------------------------------------------------------------------------------

    STATE_FORMAT = 1

    def state_dict(self) -> dict:
        """The control plane as plain data, between rounds: window, transfer queue, ledger and
        pending requests, records, counters, the logical trainer's running step, and the mode's
        own keys (``dora``: its planner's). On the wall clock no train step may be running (the
        run publishes it first)."""
        job = None
        if self._train is not None:
            if not isinstance(self.trainer, TickedTrainer):
                raise RuntimeError("a train step is running: publish it before saving")
            job = self.trainer._job
        self.records.flush(keep_last_step=self._train is not None)
        waited = (self._blocked, self._last_publish, self._last_round)
        return {
            "format": self.STATE_FORMAT,
            "clock": self.clock.kind,
            "mode": self.mode.name,
            "tick_index": self.tick_index,
            "steps_done": self.steps_done,
            "dispatching": self.dispatching,
            "train": self._train,
            "train_job": job,
            **self.mode.state_dict(),
            "adaptive": (*waited, self.adaptive.state_dict()),
            "engine_steps": self.engine_steps,
            "window": self.window.state_dict(),
            "queue": self.queue.state_dict(),
            "manager": self.manager.state_dict(),
            "records": self.records,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != self.STATE_FORMAT:
            raise ValueError(
                f"control-plane state of format {state.get('format')!r}; this version reads "
                f"format {self.STATE_FORMAT}"
            )
        self.tick_index, self.steps_done = state["tick_index"], state["steps_done"]
        self.dispatching, self._train = state["dispatching"], state["train"]
        self.mode.load_state_dict(state)
        adaptive = state["adaptive"]
        self._blocked, self._last_publish, self._last_round = adaptive[:3]
        if isinstance(adaptive[3], dict):  # (a checkpoint of before staleness_k: auto has none)
            self.adaptive.load_state_dict(adaptive[3])
        self.engine_steps = state["engine_steps"]
        if isinstance(self.trainer, TickedTrainer):
            self.trainer._job = state["train_job"]
        elif self._train is not None:
            raise ValueError(
                "the saved state has a train step running, which only a logical run can continue"
            )
        self.window.load_state_dict(state["window"])
        # a resume may change the mode, K or batch sizes: the bound is this run's K (an auto
        # K keeps the saved one within this run's k_max); resume.check_restored refuses a K the
        # groups in flight cannot be consumed within
        adapt, w, k = self.mode.adapts_k, self.window, self.mode.k
        w.k = min(w.k, k) if adapt else k
        w.target_k = min(w.target_k, w.k) if adapt else k
        self.records = state["records"]
        self.records.mode = self.mode.name  # a resume may change the mode
        self.queue.consumed = self.records.consumed
        self.queue.load_state_dict(state["queue"])
        self.manager.load_state_dict(state["manager"])
        self.clock.start(offset=self.records.latest_time())

    # -- running ---------------------------------------------------------------------------------

    def done_draining(self) -> bool:
        busy = self.manager.in_flight or self.queue.num_ready or self.manager.pending_count()
        return self._train is None and not busy

    def run(
        self,
        num_steps: int,
        *,
        drain: bool = False,
        max_ticks: int = 1_000_000,
        stall_s: float = 600.0,
        should_stop: Callable[[], bool] | None = None,
    ) -> RunResult:
        """The one loop: round after round until ``num_steps`` more train steps have been
        published (observers see each one); with ``drain``, then stop dispatching and go on until
        every dispatched request has been consumed (or discarded). When ``should_stop()`` turns
        true, no new train step starts, the running one is published, and the run returns early
        (``stopped`` is set). A run that makes no progress for ``max_ticks`` rounds (logical) or
        ``stall_s`` seconds (wall) raises :class:`StallError`."""
        target = self.steps_done + num_steps
        # a ticked step in progress is part of the saved state; a worker's step must end, so
        # none starts beyond the target
        ticked = isinstance(self.trainer, TickedTrainer)
        self.stopped = self.at_step_end = False
        self._step_limit = None if ticked or drain else target
        if self.tick_index == 0:
            self.clock.start()  # the run's time starts with its first round
        if self._held:
            self._release()
        progress = self._progress()
        last_change = time.monotonic()
        try:
            while self.steps_done < target or (drain and not self.done_draining()):
                if self.steps_done >= target:
                    self.dispatching = False
                if should_stop is not None and not self.stopping and should_stop():
                    self.stopping = self.stopped = True
                if self.stopping and (self._train is None or ticked):
                    break
                self.tick()
                now = self._progress()
                if now != progress:
                    progress, last_change = now, time.monotonic()
                self._guard(max_ticks, stall_s, last_change)
            self._hold()  # between runs the groups wait (evaluation, checkpoints, the end)
        finally:
            self.stopping = False
            self._step_limit = None
        self.records.flush(keep_last_step=self._train is not None)
        records = self.records.full()  # (attached: read back from the history files)
        summary = records.summary(min(target, self.steps_done))  # published steps only
        return RunResult(summary, records, self.manager.ledger(), self.manager.state_counts())

    def stream_history(self, run_dir, resume: bool = False) -> list[str]:
        """Keep the run's history in ``run_dir``'s files instead of memory: the records are
        flushed there at every published version (:meth:`Records.attach`), and requests leave
        the ledger once consumed (counted). ``resume``: continue the files of the checkpoint
        this runtime was restored from. Returns history files found shorter than expected."""
        self.manager.keep_ended = False
        self.manager.forget_ended()
        return self.records.attach(run_dir, resume=resume)

    def _progress(self) -> tuple[int, int, int]:
        return (self.steps_done, self.records.consumed_count, self.manager.dispatched_prompt_groups)

    def _guard(self, max_ticks: int, stall_s: float, last_change: float) -> None:
        idle_s = time.monotonic() - last_change
        limit = self.clock.stall(self.tick_index, idle_s, max_ticks, stall_s)
        if limit is not None:
            raise StallError(
                f"{self.mode.name}: no end after {limit}: steps {self.steps_done}, "
                f"window v{self.window.latest} open {self.window.live_versions()}, "
                f"in flight {self.manager.in_flight}, ready {self.queue.num_ready}, "
                f"pending {self.manager.pending_by_version()}, training {self._train}"
            )
