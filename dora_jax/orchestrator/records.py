"""Per-tick, per-group records and the figures that come out of them.

The same records serve every backend (fake, simulator, real engines) and both clocks. On the
logical clock each tick stores what each group did (one
:class:`~dora_jax.orchestrator.backend.GroupTick` per group) and the cluster-wide state the runtime
saw (:class:`ClusterTick`); plans, weight transfers, migrations and train steps are logged with
their tick. On the wall clock every engine step, weight load and KV move of a group is a *span*
``[t0, t1)`` in seconds (``spans``), and everything else is stamped in seconds.
:meth:`Records.summary` turns them into:

- ``bubble``: idle group-ticks / group-ticks (a group is idle when it holds no request and is
  not receiving weights; requests in migration transit do not make a group idle).
- ``prefill_frac``, ``weight_transfer_frac``, ``migration_frac``: group time prefilling,
  receiving weights, and packing / unpacking the KV of moving requests (the same names as the
  simulator's figures and the run summary's overheads).
- ``utilisation``: sampled tokens / (slots x tokens per slot-tick x group-ticks), the slot-level
  occupancy of decode (an engine that decodes several steps per call samples up to that many
  tokens per slot and tick).
- throughput: trajectories (and their response tokens) consumed by training per tick.
- staleness mean / max of consumed trajectories, re-prefilled tokens, discarded requests,
  migrated requests, weight transfers, plans and their planning time, plans per trigger and how
  many of them moved anything.
- ``overlap``: the share of the trainer's busy time (its steps' spans) during which at least one
  group was prefilling or decoding; ``group_idle``: each group's idle share of the horizon (no
  engine step, weight load or KV move). On the wall clock ``bubble`` is their mean.

Where the records live: in memory by default (the simulator, tests and short programmatic runs
read the lists directly). A run with a run directory attaches them to its history files
(:meth:`Records.attach`, :mod:`dora_jax.orchestrator.history`): the runtime then flushes them at
every published version and at every checkpoint, so the lists hold only what happened since (and
a train step still running); :meth:`Records.summary` and :meth:`Records.full` read the files
back. What a run holds in memory and writes into each checkpoint no longer grows with its age.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import astuple, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

from dora_jax.orchestrator.backend import HOST_LEAVING, GroupTick, StepEvents
from dora_jax.orchestrator.history import HistoryFiles
from dora_jax.orchestrator.transfer_queue import ConsumedRecord

# the per-event lists a flush writes to records.jsonl (``consumed`` goes to consumed.jsonl)
HISTORY_KINDS = (
    "groups",
    "spans",
    "cluster",
    "steps",
    "plans",
    "transfers",
    "migrations",
    "discards",
    "cross_host",
    "k_log",
    "health",
    "recoveries",
)


class ClusterTick(NamedTuple):
    tick: int
    pending: int  # requests dispatched, not admitted to any group
    in_flight: int  # prompt groups dispatched, not ready
    ready: int  # prompt groups ready, not consumed
    training: bool
    trainer_version: int  # the newest published version
    window_versions: int  # versions with prompt groups not yet consumed
    time: float = 0.0  # wall clock: seconds since the start (logical: the tick)


@dataclass(frozen=True)
class StepRecord:
    start: float  # tick, or seconds on the wall clock
    end: float
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
    weight_transfer_frac: float  # group time receiving weights
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
    clock: str = "logical"
    seconds: float = 0.0  # wall clock: the horizon in seconds
    traj_per_s: float = 0.0
    tokens_per_s: float = 0.0
    migration_frac: float = 0.0  # group time packing / unpacking the KV of moving requests
    overlap: float = 0.0  # share of trainer-busy time with some group prefilling or decoding
    group_idle: tuple[float, ...] = ()  # per group, idle share of the horizon
    plans_by_trigger: dict[str, int] = field(default_factory=dict)  # plans per trigger
    plans_moving: int = 0  # plans that moved weights or requests (the others changed nothing)
    cross_host_weight_transfers: int = 0  # weight loads from another process
    cross_host_migrated: int = 0  # requests moved with their KV to another process
    # staleness_k: auto: the K chosen after each step (mean, min, max, last) and the decisions
    # by reason (empty for a fixed K)
    k_chosen: dict = field(default_factory=dict)
    group_failures: int = 0  # rollout groups that failed: their engine or their process
    groups_left: int = 0  # rollout groups whose process was asked to stop (handed over)
    recovered: dict[str, int] = field(default_factory=dict)  # recovered requests per source


def _k_chosen(rows: list[tuple]) -> dict:
    """``staleness_k: auto``'s decisions (``k_log`` rows) in a few figures."""
    if not rows:
        return {}
    ks = [r[2] for r in rows]
    return {
        "mean": sum(ks) / len(ks),
        "min": min(ks),
        "max": max(ks),
        "last": ks[-1],
        "reasons": dict(Counter(r[3] for r in rows)),
    }


@dataclass
class Records:
    mode: str
    num_groups: int
    max_slots: int
    tokens_per_slot_tick: int = 1
    clock: str = "logical"
    groups: list[tuple[GroupTick, ...]] = field(default_factory=list)  # index: tick (logical)
    spans: list[GroupTick] = field(default_factory=list)  # wall clock: every group's spans
    cluster: list[ClusterTick] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    plans: list[PlanRecord] = field(default_factory=list)
    transfers: list[tuple[int, int, int]] = field(default_factory=list)  # (tick, group, version)
    migrations: list[tuple[int, int]] = field(default_factory=list)  # (tick, requests)
    discards: list[tuple[int, int]] = field(default_factory=list)  # (tick, requests)
    # moves between processes: (tick, "weights" | "kv", source group (-1: trainer), dest, n)
    cross_host: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    consumed: list[ConsumedRecord] = field(default_factory=list)
    # staleness_k: auto, one row per train step: (time, version published, K from then on,
    # reason, drift coefficient, ESS ratio predicted at that K, the step's waiting share, its
    # moving average): orchestrator/staleness.py's Decision
    k_log: list[tuple] = field(default_factory=list)
    # failed rollout groups: (time, group, state, reason) per health change, and (time, request
    # id, source) per request recovered from a failed group (backend.RECOVERY_SOURCES)
    health: list[tuple[float, int, str, str]] = field(default_factory=list)
    recoveries: list[tuple[float, int, str]] = field(default_factory=list)
    # what earlier flushes wrote to the history files (zero while the records stay in memory):
    # logical ticks, consumed trajectories, the files' lengths in bytes, the latest time seen
    ticks_flushed: int = 0
    consumed_flushed: int = 0
    history_offsets: tuple[int, int] = (0, 0)
    flushed_until: float = 0.0

    def __post_init__(self):
        self._files: HistoryFiles | None = None  # not a field: a checkpoint holds the offsets

    # -- history files ---------------------------------------------------------------------------

    def attach(self, run_dir: str | Path, resume: bool = False) -> list[str]:
        """Write the records to ``run_dir``'s history files from now on. A fresh run (``resume``
        false) starts them empty and writes what the lists hold at the next flush; a resumed run
        cuts them back to this checkpoint's lengths. Returns the names of files found shorter
        than the checkpoint says (their earlier history is gone; the run goes on)."""
        if not resume:
            self.history_offsets = (0, 0)
            self.ticks_flushed = self.consumed_flushed = 0
        self._files = HistoryFiles(run_dir, self.history_offsets if resume else None)
        self.history_offsets = self._files.offsets
        return self._files.short

    def flush(self, keep_last_step: bool = False) -> None:
        """Write what the lists hold to the history files and empty them (a no-op in memory).
        ``keep_last_step``: the last train step is still running (its record changes when it is
        published), so it stays in memory."""
        if self._files is None:
            return
        steps = self.steps[:-1] if keep_last_step else self.steps
        rows = {k: _encode(k, getattr(self, k)) for k in HISTORY_KINDS if getattr(self, k)}
        rows["steps"] = _encode("steps", steps)
        times = [c.time for c in self.cluster] + [g.t1 for g in self.spans]
        self.history_offsets = self._files.append(rows, self.consumed)
        self.flushed_until = max([self.flushed_until, *times])
        self.ticks_flushed += len(self.groups)
        self.consumed_flushed += len(self.consumed)
        for k in HISTORY_KINDS:
            if k != "steps":
                del getattr(self, k)[:]  # in place: the transfer queue shares ``consumed``
        del self.consumed[:]
        del self.steps[: len(steps)]

    def full(self) -> Records:
        """All the records of the run: the history files read back, then what is in memory
        (``self`` when nothing was flushed)."""
        if not (
            self._files
            or self.ticks_flushed
            or self.consumed_flushed
            or self.history_offsets != (0, 0)
        ):
            return self
        if self._files is None:
            raise RuntimeError(
                "these records were written to history files that are not "
                "attached: Records.attach(run_dir, resume=True) first"
            )
        flushes, consumed = self._files.read()
        out = replace(
            self,
            **{k: [] for k in (*HISTORY_KINDS, "consumed")},
            ticks_flushed=0,
            consumed_flushed=0,
            history_offsets=(0, 0),
        )
        for rows in flushes:
            for k, items in rows.items():
                getattr(out, k).extend(_decode(k, items))
        out.consumed.extend(consumed)
        for k in (*HISTORY_KINDS, "consumed"):
            getattr(out, k).extend(getattr(self, k))
        return out

    @property
    def consumed_count(self) -> int:
        """Trajectories consumed so far (flushed or not)."""
        return self.consumed_flushed + len(self.consumed)

    def latest_time(self) -> float:
        """The latest time recorded (seconds on the wall clock), flushed or not."""
        times = [c.time for c in self.cluster[-1:]] + [g.t1 for g in self.spans]
        return max([self.flushed_until, *times])

    # -- recording -------------------------------------------------------------------------------

    def add_tick(self, events: StepEvents, cluster: ClusterTick) -> None:
        self._layout.add(self, events, cluster)

    def horizon(self, steps: int | None = None) -> float:
        """Ticks (seconds on the wall clock) until the ``steps``-th train step ended (all
        recorded time if None)."""
        if steps is None or steps > len(self.steps):
            return self._layout.horizon(self)
        return self.steps[steps - 1].end if steps > 0 else 0

    def summary(self, steps: int | None = None) -> Summary:
        """Figures over the ticks (seconds) until the ``steps``-th train step ended."""
        full = self.full()
        if full is not self:
            return full.summary(steps)
        end = self.horizon(steps)
        steps_in, common = self._common(end)
        return self._layout.summary(self, end, steps_in, common)

    @property
    def _layout(self) -> type[_TickRows] | type[_Spans]:
        """How the groups' time is kept: a row per tick, or spans (the wall clock)."""
        return _LAYOUTS[self.clock]

    def _common(self, end: float) -> tuple[list[StepRecord], dict]:
        """The steps that ended by ``end``, and the summary fields both clocks count the same
        way: what those steps consumed, staleness, data movement and plans before ``end``."""
        steps_in = [s for s in self.steps if s.end <= end]
        last = steps_in[-1].version if steps_in else None
        consumed = [
            c
            for c in self.consumed
            if c.tick < end and last is not None and c.trainer_version < last
        ]
        plans = [p for p in self.plans if p.tick < end]
        st = [c.staleness for c in consumed]
        moves = [m for m in self.cross_host if m[0] < end]
        dead = [h[3] for h in self.health if h[0] < end and h[2] == "dead"]  # (the reasons)
        return steps_in, {
            "mode": self.mode,
            "steps": len(steps_in),
            "trajectories": len(consumed),
            "tokens": sum(c.response_len for c in consumed),
            "staleness_mean": sum(st) / len(st) if st else 0.0,
            "staleness_max": max(st, default=0),
            "discarded": sum(n for t, n in self.discards if t < end),
            "migrated": sum(n for t, n in self.migrations if t < end),
            "weight_transfers": sum(1 for t, _, _ in self.transfers if t < end),
            "plans": len(plans),
            "plan_ms_mean": sum(p.ms for p in plans) / len(plans) if plans else 0.0,
            "plan_ms_max": max((p.ms for p in plans), default=0.0),
            "max_version_span": max((c.version_span for c in consumed), default=0),
            "cross_host_weight_transfers": sum(1 for m in moves if m[1] == "weights"),
            "cross_host_migrated": sum(m[4] for m in moves if m[1] == "kv"),
            "group_failures": sum(1 for why in dead if HOST_LEAVING not in why),
            "groups_left": sum(1 for why in dead if HOST_LEAVING in why),
            "recovered": dict(Counter(r[2] for r in self.recoveries if r[0] < end)),
            "k_chosen": _k_chosen([r for r in self.k_log if r[0] <= end]),
            **plan_counts(plans),
        }

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


class _TickRows:
    """Logical-clock records: one row of group records per tick."""

    @staticmethod
    def add(r: Records, events: StepEvents, cluster: ClusterTick) -> None:
        expected = r.ticks_flushed + len(r.groups)
        if events.tick != expected or cluster.tick != events.tick:
            raise ValueError(f"tick {events.tick} recorded out of order")
        r.groups.append(events.groups)
        r.cluster.append(cluster)

    @staticmethod
    def horizon(r: Records) -> float:
        return len(r.groups)

    @staticmethod
    def summary(r: Records, end: int, steps_in: list[StepRecord], common: dict) -> Summary:
        rows = r.groups[:end]
        gt = max(1, end * r.num_groups)
        idle = tokens = reprefill = 0
        cat: Counter = Counter()  # group-ticks per activity, idle ones aside
        max_live = 0
        idle_by_group = [0] * r.num_groups
        busy_ticks: list[tuple[float, float]] = []
        for t, row in enumerate(rows):
            live = set()
            rolling = False
            for g in row:
                # (a group waiting on its conversations' environment idles as well)
                if (g.activity == "idle" and g.active == 0) or g.activity == "env_wait":
                    idle += 1
                    idle_by_group[g.group] += 1
                else:
                    cat[g.activity] += 1
                if g.active:
                    live.add(g.version)
                rolling = rolling or g.activity in ("prefill", "decode")
                tokens += g.tokens
                reprefill += g.reprefill_tokens
            max_live = max(max_live, len(live))
            if rolling:
                busy_ticks.append((t, t + 1.0))
        return Summary(
            ticks=end,
            traj_per_tick=common["trajectories"] / end if end else 0.0,
            tokens_per_tick=common["tokens"] / end if end else 0.0,
            bubble=idle / gt,
            utilisation=tokens / (gt * r.max_slots * r.tokens_per_slot_tick),
            prefill_frac=cat["prefill"] / gt,
            weight_transfer_frac=cat["transfer"] / gt,
            migration_frac=cat["migrate"] / gt,
            reprefill_tokens=reprefill,
            max_live_versions=max_live,
            overlap=_overlap(r.steps, end, busy_ticks),
            group_idle=tuple(n / max(end, 1) for n in idle_by_group),
            **common,
        )


class _Spans:
    """Wall-clock records: every engine step, weight load and KV move of a group as a span."""

    @staticmethod
    def add(r: Records, events: StepEvents, cluster: ClusterTick) -> None:
        r.spans.extend(events.groups)
        r.cluster.append(cluster)

    @staticmethod
    def horizon(r: Records) -> float:
        return max((g.t1 for g in r.spans), default=0.0)

    @staticmethod
    def summary(r: Records, end: float, steps_in: list[StepRecord], common: dict) -> Summary:
        spans = [g for g in r.spans if g.t0 < end]
        span = max(end, 1e-12)
        busy = [0.0] * r.num_groups
        cat = dict.fromkeys(("prefill", "transfer", "migrate"), 0.0)
        tokens = reprefill = engine_steps = 0
        for g in spans:
            dt = min(g.t1, end) - g.t0
            if g.activity not in ("idle", "env_wait"):
                busy[g.group] += dt
            if g.activity in cat:
                cat[g.activity] += dt
            if g.activity in ("prefill", "decode"):
                engine_steps += 1
            tokens += g.tokens
            reprefill += g.reprefill_tokens
        group_idle = tuple(max(0.0, 1.0 - b / span) for b in busy)
        rolling = [(g.t0, min(g.t1, end)) for g in spans if g.activity in ("prefill", "decode")]
        gs = span * r.num_groups
        return Summary(
            ticks=len(r.cluster),
            traj_per_tick=0.0,
            tokens_per_tick=0.0,
            bubble=sum(group_idle) / max(r.num_groups, 1),
            utilisation=tokens / max(engine_steps * r.max_slots * r.tokens_per_slot_tick, 1),
            prefill_frac=cat["prefill"] / gs,
            weight_transfer_frac=cat["transfer"] / gs,
            migration_frac=cat["migrate"] / gs,
            reprefill_tokens=reprefill,
            max_live_versions=_max_live(spans, r.num_groups),
            clock="wall",
            seconds=end,
            traj_per_s=common["trajectories"] / span,
            tokens_per_s=common["tokens"] / span,
            overlap=_overlap(steps_in, end, rolling),
            group_idle=group_idle,
            **common,
        )


_LAYOUTS = {"logical": _TickRows, "wall": _Spans}  # by Records.clock


def _encode(kind: str, items: list) -> list:
    """A history file's columns-free rows: each record as the list of its field values."""
    if kind == "groups":
        return [[list(g) for g in row] for row in items]
    if kind in ("steps", "plans"):
        return [list(astuple(x)) for x in items]
    return [list(x) for x in items]


_TYPES = {"spans": GroupTick, "cluster": ClusterTick, "steps": StepRecord, "plans": PlanRecord}


def _decode(kind: str, rows: list) -> list:
    if kind == "groups":
        return [tuple(GroupTick(*g) for g in row) for row in rows]
    make = _TYPES.get(kind)
    return [make(*r) if make is not None else tuple(r) for r in rows]


def plan_counts(plans: list[PlanRecord]) -> dict:
    """Plans per trigger (in order of first use) and how many moved weights or requests."""
    moving = sum(1 for p in plans if p.transfers or p.migrated)
    return {"plans_by_trigger": dict(Counter(p.trigger for p in plans)), "plans_moving": moving}


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[a, b)`` intervals as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersection_length(
    a_intervals: list[tuple[float, float]], b_intervals: list[tuple[float, float]]
) -> float:
    """Length of the intersection of two unions of intervals."""
    train, roll = merge_intervals(a_intervals), merge_intervals(b_intervals)
    both, j = 0.0, 0
    for a, b in train:
        while j < len(roll) and roll[j][1] <= a:
            j += 1
        k = j
        while k < len(roll) and roll[k][0] < b:
            both += min(b, roll[k][1]) - max(a, roll[k][0])
            k += 1
    return both


def _overlap(steps: list[StepRecord], end: float, rolling: list[tuple[float, float]]) -> float:
    """Share of the trainer's busy time (``[start, end)`` of each step, cut at ``end``) covered
    by ``rolling`` (intervals during which some group prefilled or decoded)."""
    train = merge_intervals([(s.start, min(s.end, end)) for s in steps])
    total = sum(b - a for a, b in train)
    return intersection_length(train, rolling) / total if total > 0 else 0.0


def _max_live(spans: list[GroupTick], num_groups: int) -> int:
    """Most distinct versions holding requests at one moment. A group holds its span's version
    from the start of an active span (one that held requests) until the start of its next span
    if that one is active too, else until the span's end (its last requests finished in it)."""
    by_group: list[list[GroupTick]] = [[] for _ in range(num_groups)]
    for g in spans:
        by_group[g.group].append(g)
    events: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, version)
    for own in by_group:
        own.sort(key=lambda x: x.t0)
        for g, nxt in pairwise([*own, None]):  # (each span with the next one of its group)
            if g.active:
                until = nxt.t0 if nxt is not None and nxt.active else g.t1
                events += [(g.t0, 1, g.version), (max(until, g.t0), -1, g.version)]
    live: Counter = Counter()
    best = 0
    for _, d, v in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at a tie
        live[v] += d
        if live[v] == 0:
            del live[v]
        best = max(best, len(live))
    return best
