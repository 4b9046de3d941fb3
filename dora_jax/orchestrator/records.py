"""Per-tick, per-group records and the figures that come out of them.

The same records serve every backend (fake, simulator, real engines): each tick stores what each
group did (:class:`~dora_jax.orchestrator.backend.GroupTick`) and the cluster-wide state the
runtime saw (:class:`ClusterTick`); plans, weight transfers, migrations and train steps are
logged with their tick. :meth:`Records.summary` turns them into:

- ``bubble``: idle group-ticks / group-ticks (a group is idle when it holds no request and is
  not receiving weights; requests in migration transit do not make a group idle).
- ``utilisation``: sampled tokens / (slots x tokens per slot-tick x group-ticks), the slot-level
  occupancy of decode (an engine that decodes several steps per call samples up to that many
  tokens per slot and tick).
- throughput: trajectories (and their response tokens) consumed by training per tick.
- staleness mean / max of consumed trajectories, re-prefilled tokens, discarded requests,
  migrated requests, weight transfers, plans and their planning time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from dora_jax.orchestrator.backend import GroupTick, StepEvents
from dora_jax.orchestrator.transfer_queue import ConsumedRecord


class ClusterTick(NamedTuple):
    tick: int
    pending: int  # requests dispatched, not admitted to any group
    in_flight: int  # prompt groups dispatched, not ready
    ready: int  # prompt groups ready, not consumed
    training: bool
    trainer_version: int  # the newest published version
    window_versions: int  # versions with prompt groups not yet consumed


@dataclass(frozen=True)
class StepRecord:
    start: int
    end: int
    version: int  # the version the step produced
    prompt_groups: int
    max_staleness: int


@dataclass(frozen=True)
class PlanRecord:
    tick: int
    trigger: str
    ms: float
    transfers: int
    migrated: int
    supplements: int


@dataclass(frozen=True)
class Summary:
    mode: str
    ticks: int
    steps: int
    trajectories: int
    tokens: int
    traj_per_tick: float
    tokens_per_tick: float
    bubble: float
    utilisation: float
    prefill_frac: float
    transfer_frac: float
    staleness_mean: float
    staleness_max: int
    reprefill_tokens: int
    discarded: int
    migrated: int
    weight_transfers: int
    plans: int
    plan_ms_mean: float
    plan_ms_max: float
    max_version_span: int
    max_live_versions: int  # most distinct versions running requests at once


@dataclass
class Records:
    mode: str
    num_groups: int
    max_slots: int
    tokens_per_slot_tick: int = 1
    groups: list[tuple[GroupTick, ...]] = field(default_factory=list)  # index: tick
    cluster: list[ClusterTick] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    plans: list[PlanRecord] = field(default_factory=list)
    transfers: list[tuple[int, int, int]] = field(default_factory=list)  # (tick, group, version)
    migrations: list[tuple[int, int]] = field(default_factory=list)  # (tick, requests)
    discards: list[tuple[int, int]] = field(default_factory=list)  # (tick, requests)
    consumed: list[ConsumedRecord] = field(default_factory=list)

    def add_tick(self, events: StepEvents, cluster: ClusterTick) -> None:
        if events.tick != len(self.groups) or cluster.tick != events.tick:
            raise ValueError(f"tick {events.tick} recorded out of order")
        self.groups.append(events.groups)
        self.cluster.append(cluster)

    def horizon(self, steps: int | None = None) -> int:
        """Ticks until the ``steps``-th train step ended (all recorded ticks if None)."""
        if steps is None or steps > len(self.steps):
            return len(self.groups)
        return self.steps[steps - 1].end if steps > 0 else 0

    def summary(self, steps: int | None = None) -> Summary:
        """Figures over the ticks until the ``steps``-th train step ended."""
        end = self.horizon(steps)
        steps_in = [s for s in self.steps if s.end <= end]
        last_step_version = steps_in[-1].version if steps_in else None
        consumed = [c for c in self.consumed if c.tick < end and last_step_version is not None
                    and c.trainer_version < last_step_version]  # fmt: skip
        rows = self.groups[:end]
        gt = max(1, end * self.num_groups)
        idle = prefill = transfer = tokens = reprefill = 0
        max_live = 0
        for row in rows:
            live = set()
            for g in row:
                if g.activity == "idle" and g.active == 0:
                    idle += 1
                elif g.activity == "prefill":
                    prefill += 1
                elif g.activity == "transfer":
                    transfer += 1
                if g.active:
                    live.add(g.version)
                tokens += g.tokens
                reprefill += g.reprefill_tokens
            max_live = max(max_live, len(live))
        plans = [p for p in self.plans if p.tick < end]
        st = [c.staleness for c in consumed]
        ntok = sum(c.response_len for c in consumed)
        return Summary(
            mode=self.mode,
            ticks=end,
            steps=len(steps_in),
            trajectories=len(consumed),
            tokens=ntok,
            traj_per_tick=len(consumed) / end if end else 0.0,
            tokens_per_tick=ntok / end if end else 0.0,
            bubble=idle / gt,
            utilisation=tokens / (gt * self.max_slots * self.tokens_per_slot_tick),
            prefill_frac=prefill / gt,
            transfer_frac=transfer / gt,
            staleness_mean=sum(st) / len(st) if st else 0.0,
            staleness_max=max(st, default=0),
            reprefill_tokens=reprefill,
            discarded=sum(n for t, n in self.discards if t < end),
            migrated=sum(n for t, n in self.migrations if t < end),
            weight_transfers=sum(1 for t, _, _ in self.transfers if t < end),
            plans=len(plans),
            plan_ms_mean=sum(p.ms for p in plans) / len(plans) if plans else 0.0,
            plan_ms_max=max((p.ms for p in plans), default=0.0),
            max_version_span=max((c.version_span for c in consumed), default=0),
            max_live_versions=max_live,
        )

    def timeline(self, every: int = 1, end: int | None = None) -> list[str]:
        """One line per group, one character per ``every`` ticks: the version (mod 10) while
        decoding, ``^`` prefill, ``~`` weight transfer, ``.`` idle."""
        end = len(self.groups) if end is None else end
        lines = []
        for g in range(self.num_groups):
            chars = []
            for t in range(0, end, every):
                x = self.groups[t][g]
                if x.activity == "decode":
                    chars.append(str(x.version % 10))
                else:
                    chars.append({"prefill": "^", "transfer": "~"}.get(x.activity, "."))
            lines.append(f"g{g:<3d}" + "".join(chars))
        return lines
