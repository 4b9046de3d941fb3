"""Run reports from :class:`~dora_jax.orchestrator.records.Records`: timeline, summary, curves.

- :func:`plot_timeline`: groups x time, each cell coloured by the policy version the group holds
  (the paper's Figure 6 view), with the trainer's steps, weight transfers and migrations.
- :func:`write_summary`: ``summary.json`` + ``summary.md`` (throughput, bubble, phase fractions,
  staleness histogram, data movement, reward curve, overheads).
(Curves against consumed samples are in :mod:`dora_jax.curves`.)

Phase fractions (:func:`phase_fractions`), over the ticks ``[0, H)`` of the summary horizon: a
tick is *training* when some train step's span ``[start, end)`` (a ``StepRecord``) covers it, and
*rolling out* when at least one group prefills, decodes or holds a request (weight transfers alone
do not count). ``rollout_only`` = rolling out and not training, ``overlap`` = both,
``train_only`` = training with every group idle or receiving weights, ``neither`` = the rest.
The four fractions sum to 1; each is a share of ticks, or of seconds when per-tick durations are
given. Figures are drawn with ``matplotlib.figure.Figure`` (Agg; no pyplot, no display, and
the caller's matplotlib backend is left alone).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from dora_jax.health_marks import draw_health
from dora_jax.metrics import json_safe
from dora_jax.orchestrator.backend import ACTIVITIES
from dora_jax.orchestrator.clock import CLOCKS
from dora_jax.orchestrator.records import (
    Records,
    Summary,
    intersection_length,
    merge_intervals,
)
from dora_jax.orchestrator.transfer_queue import ConsumedRecord

# tab10 without its grey (grey means "weight transfer"); versions cycle through these colours
PALETTE = np.array([c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7])
IDLE_RGB = np.array([1.0, 1.0, 1.0])
TRANSFER_RGB = np.array([0.42, 0.42, 0.42])
TINT = 0.5  # prefill / waiting cells: the version colour blended this much toward white
MAX_COLS = 2400  # image columns; longer runs are area-averaged down to this many
MIGRATE_RGB = np.array([0.15, 0.15, 0.15])
ENV_WAIT_RGB = np.array([0.95, 0.76, 0.05])  # gold: no tab10 version colour is near it
_ACT = {a: i for i, a in enumerate(ACTIVITIES)}
_IDLE, _PREFILL, _DECODE, _TRANSFER, _MIGRATE, _ENV_WAIT = (
    _ACT[a] for a in ("idle", "prefill", "decode", "transfer", "migrate", "env_wait")
)


def version_color(version: int) -> tuple[float, float, float]:
    """The timeline colour of ``version`` (the palette repeats every ``len(PALETTE)`` versions)."""
    return tuple(PALETTE[version % len(PALETTE)])


def _grid(records: Records, end: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(version, activity code, active)``, each ``[groups, ticks]``, from the group ticks."""
    rows = records.groups[:end]
    t, g = len(rows), records.num_groups
    if any(len(r) != g for r in rows):
        raise ValueError(f"every tick must record {g} groups")

    def col(i: int, dtype: type, f=None) -> np.ndarray:
        it = map(itemgetter(i), chain.from_iterable(rows))
        return np.fromiter(map(f, it) if f else it, dtype=dtype, count=t * g).reshape(t, g).T

    return col(1, np.int64), col(2, np.int8, _ACT.__getitem__), col(3, np.int64)


def _time_edges(n: int, tick_seconds: list[float] | None) -> np.ndarray:
    if tick_seconds is None:
        return np.arange(n + 1, dtype=np.float64)
    dt = np.asarray(tick_seconds, dtype=np.float64)
    if dt.shape != (n,) or np.any(dt < 0) or not np.all(np.isfinite(dt)):
        raise ValueError(f"tick_seconds needs {n} finite durations >= 0, got shape {dt.shape}")
    if n and dt.sum() <= 0:
        raise ValueError("tick_seconds sum to 0")
    return np.concatenate([[0.0], np.cumsum(dt)])


def _column_means(edges: np.ndarray, rgb: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``[len(cols) - 1, 3]``: the time-weighted mean colour over each ``[cols[c], cols[c + 1])``,
    where ``rgb[i]`` fills ``[edges[i], edges[i + 1])``."""
    area = np.concatenate([np.zeros((1, 3)), np.cumsum(rgb * np.diff(edges)[:, None], axis=0)])
    width = np.diff(cols)
    return np.stack([np.diff(np.interp(cols, edges, area[:, c])) / width for c in range(3)], axis=1)


def _image(version, act, active, edges: np.ndarray, ncols: int, waits=None) -> np.ndarray:
    """``[groups, ncols, 3]`` RGB: each column the time-weighted mean colour of what it spans;
    ``waits`` (``[groups, ticks]``, shares of each tick): that much of a cell turns to the
    environment-wait colour."""
    p = len(PALETTE)
    lut = np.concatenate(
        [
            [IDLE_RGB, TRANSFER_RGB],
            PALETTE,
            PALETTE * (1 - TINT) + TINT,
            [MIGRATE_RGB],
            [ENV_WAIT_RGB],
        ]
    )
    busy = (act == _DECODE) | (act == _PREFILL) | ((act == _IDLE) & (active > 0))
    idx = np.where(act == _TRANSFER, 1, np.where(act == _MIGRATE, 2 + 2 * p, 0))
    idx = np.where(act == _ENV_WAIT, 3 + 2 * p, idx)
    idx = np.where(busy, 2 + version % p + p * (act != _DECODE), idx)
    cols = np.linspace(edges[0], edges[-1], ncols + 1)
    rgb = lut[idx]
    if waits is not None:
        f = np.clip(waits, 0.0, 1.0)[:, :, None]
        rgb = (1.0 - f) * rgb + f * ENV_WAIT_RGB
    img = np.empty((version.shape[0], ncols, 3))
    for g in range(version.shape[0]):
        img[g] = _column_means(edges, rgb[g], cols)
    return np.clip(img, 0.0, 1.0)


def _span_image(records: Records, end: float, ncols: int, start: float = 0.0) -> np.ndarray:
    """Wall clock: ``[groups, ncols, 3]`` RGB over ``[start, end)`` seconds from each group's
    spans (each column the time-weighted mean colour; time outside every span is idle, white)."""
    cols = np.linspace(start, end, ncols + 1)
    img = np.ones((records.num_groups, ncols, 3))
    by_group: list[list] = [[] for _ in range(records.num_groups)]
    for g in records.spans:
        if g.t0 < end and g.t1 > g.t0:
            by_group[g.group].append(g)
    p = len(PALETTE)
    for gi, spans in enumerate(by_group):
        if not spans:
            continue
        spans.sort(key=lambda x: x.t0)
        edges, colors, t = [start], [], start
        for x in spans:
            a, b = max(x.t0, t), min(x.t1, end)
            if b <= a:
                continue
            if a > t:
                edges.append(a)
                colors.append(IDLE_RGB)
            base = PALETTE[x.version % p]
            rgb = {
                "decode": base,
                "prefill": base * (1 - TINT) + TINT,
                "transfer": TRANSFER_RGB,
                "migrate": MIGRATE_RGB,
                "env_wait": ENV_WAIT_RGB,
            }.get(x.activity, IDLE_RGB)
            edges.append(b)
            colors.append(rgb)
            t = b
        if t < end:
            edges.append(end)
            colors.append(IDLE_RGB)
        img[gi] = _column_means(np.asarray(edges), np.asarray(colors), cols)
    return np.clip(img, 0.0, 1.0)


class _Layout(NamedTuple):
    """What a timeline draws: lanes, the x range, the lanes' image, where a record's time sits
    on the x axis, the versions shown, whether x is seconds, and where the health marks end."""

    ngroups: int
    nticks: int
    x0: float
    x1: float
    img: np.ndarray | None
    x_at: Callable[[float], float]
    versions: set[int]
    seconds: bool
    health_end: float


def _span_layout(
    records: Records, span: tuple[float, float] | None, max_cols: int, tick_seconds: Any, waits: Any
) -> _Layout:
    """Wall-clock records: x is seconds; each group's spans where they happened."""
    x0, x1 = 0.0, max(records.horizon(), max((s.end for s in records.steps), default=0.0))
    x1 = x1 or 1.0
    if span is not None:
        x0, x1 = float(span[0]), float(span[1])
    img = _span_image(records, x1, max_cols, x0) if records.spans else None
    versions = {g.version for g in records.spans if g.activity != "idle"}
    ngroups, nticks = records.num_groups, len(records.cluster)
    return _Layout(ngroups, nticks, x0, x1, img, float, versions, True, x1)


def _tick_layout(
    records: Records,
    span: tuple[float, float] | None,
    max_cols: int,
    tick_seconds: list[float] | None,
    waits: np.ndarray | None,
) -> _Layout:
    """Logical-clock records: one column per tick, or seconds when ``tick_seconds`` is given;
    ``waits`` (``[ticks, groups]``): each group's share of each tick spent waiting on its
    conversations' environment (the simulator's), drawn in that colour."""
    version, act, active = _grid(records)
    ngroups, last = version.shape
    edges = _time_edges(last, tick_seconds)
    a, b = (0, last) if span is None else (max(0, int(span[0])), min(last, int(span[1])))
    shown = max(0, b - a)
    x0, x1 = (float(edges[a]), float(edges[b])) if shown else (0.0, 1.0)
    ncols = max(1, min(shown, max_cols) if tick_seconds is None else max_cols)
    img = None
    if shown:
        w = None if waits is None else np.asarray(waits)[a:b].T
        img = _image(version[:, a:b], act[:, a:b], active[:, a:b], edges[a : b + 1], ncols, w)

    def x_at(tick: float) -> float:
        return float(edges[min(max(int(tick), 0), last)]) if last else 0.0

    seen = act[:, a:b] != _IDLE
    versions = set(int(v) for v in np.unique(version[:, a:b][seen])) if shown else set()
    return _Layout(ngroups, shown, x0, x1, img, x_at, versions, tick_seconds is not None, last)


_TIMELINES = {"logical": _tick_layout, "wall": _span_layout}  # by Records.clock


def plot_timeline(
    records: Records,
    path: str | Path,
    *,
    title: str = "",
    tick_seconds: list[float] | None = None,
    max_cols: int = MAX_COLS,
    span: tuple[float, float] | None = None,
    waits: np.ndarray | None = None,
) -> Path:
    """Write a PNG: one lane per rollout group over time, coloured by the version it holds.

    Full colour: decoding; light shade: prefilling, or holding requests that wait (migration in
    transit); grey: receiving weights; white: idle; hatching: a group out of the run
    (``health_marks.py``). Black ``>`` marks where a weight transfer started on a group; the
    "migrations" lane marks each migration with a ``v`` sized by its request count; the "trainer"
    lane shows each train step's span, coloured and labelled by the version it produces. x is the
    tick, or seconds when ``tick_seconds`` (one duration per recorded tick) is given or the
    records are on the wall clock (each lane then shows every engine step, weight load (grey) and
    KV move (near-black) of its group where it happened). Runs longer than ``max_cols`` columns
    are area-averaged (a column's colour is the mean over the time it covers): 100k ticks x 128
    groups render as one image. ``span``: draw only ``[start, end)`` (ticks or seconds).
    ``waits`` (logical records, ``[ticks, groups]``): the share of each tick a group idled while
    its conversations waited on their environment (the simulator's), drawn in gold.
    """
    path = Path(path)
    lay = _TIMELINES[records.clock](records, span, max_cols, tick_seconds, waits)
    ngroups, nticks, x0, x1, img, x_at, versions = lay[:7]
    lanes_in = float(np.clip(0.2 * ngroups, 1.6, 16.0))  # inches for the group lanes
    fig = Figure(figsize=(14, lanes_in + 1.9), dpi=110, layout="constrained")
    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.6, lanes_in])
    if img is not None:
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(x0, x1, ngroups - 0.5, -0.5))
    versions |= {s.version for s in records.steps}
    # header lanes: trainer (y = 0), one bar per step coloured by the version it produces, and
    # migrations (y = 1), one marker per migration sized by its request count
    width = x1 - x0
    for s in records.steps:
        a, b = x_at(s.start), x_at(s.end)
        if b <= a:
            continue
        top.broken_barh(
            [(a, b - a)],
            (-0.4, 0.8),
            facecolors=version_color(s.version),
            edgecolors="white",
            linewidth=0.6,
        )
        if (b - a) / width > 0.018 and x0 <= (a + b) / 2 <= x1:
            top.text(
                (a + b) / 2,
                0.0,
                f"v{s.version}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                fontweight="bold",
                clip_on=True,
            )
    if records.migrations:
        mx = [x_at(t) for t, _ in records.migrations]
        ms = [min(10 + 8 * n, 80) for _, n in records.migrations]
        top.scatter(mx, [1] * len(mx), marker="v", s=ms, c="black", linewidths=0, zorder=3)
    top.axhline(0.5, color="0.75", lw=0.5)
    top.set(yticks=[0, 1], yticklabels=["trainer", "migrations"], ylim=(1.5, -0.5))
    top.tick_params(labelsize=8, length=0, labelbottom=False)
    # weight transfers: a marker where each one started, on its group's lane
    if records.transfers:
        tx = [x_at(t) for t, _, _ in records.transfers]
        ty = [g for _, g, _ in records.transfers]
        ax.scatter(tx, ty, marker=">", s=14, c="black", linewidths=0, zorder=3)

    step = max(1, math.ceil(ngroups / 32))
    gticks = list(range(0, ngroups, step))
    xlabel = "time (s)" if lay.seconds else "tick"
    ax.set(yticks=gticks, yticklabels=[f"g{g}" for g in gticks], ylim=(ngroups - 0.5, -0.5))
    ax.set(xlim=(x0, x1), xlabel=xlabel, ylabel="rollout group")
    ax.tick_params(axis="y", labelsize=7 if ngroups > 16 else 8)
    head = title or f"{records.mode}: rollout groups by policy version"
    extent = f"{x1 - x0:.1f} s" if lay.seconds else f"{nticks} ticks"
    top.set_title(f"{head}  ({ngroups} groups, {extent}, {len(records.steps)} steps)")

    handles = _legend(sorted(versions))
    handles += draw_health(ax, records.health, lay.health_end, x_at)  # groups out of the run
    ncol = 1 if len(handles) * 0.15 < lanes_in + 0.6 else 2
    fig.legend(handles=handles, loc="outside right upper", fontsize=7, frameon=False, ncol=ncol)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _legend(versions: list[int]) -> list[Any]:
    p = len(PALETTE)
    handles: list[Any] = []
    for k in sorted({v % p for v in versions}):  # colours repeat every p versions
        vs = [v for v in versions if v % p == k]
        label = ", ".join(f"v{v}" for v in vs[:3]) + (", ..." if len(vs) > 3 else "")
        handles.append(Patch(color=version_color(k), label=label))
    handles += [
        Patch(color=tuple(PALETTE[0] * (1 - TINT) + TINT), label="light: prefill / waiting"),
        Patch(color=tuple(TRANSFER_RGB), label="weight transfer"),
        Patch(color=tuple(MIGRATE_RGB), label="KV move"),
        Patch(color=tuple(ENV_WAIT_RGB), label="environment wait"),
        Patch(facecolor="white", edgecolor="0.6", label="idle"),
        Line2D([], [], marker=">", color="black", ls="", ms=5, label="transfer start"),
        Line2D([], [], marker="v", color="black", ls="", ms=5, label="migration (size: n)"),
    ]
    return handles


def tick_durations(records: Records, reduce: str = "max") -> list[float]:
    """Seconds per tick from the groups' ``time_s``: ``"max"`` when groups run in parallel (the
    tick lasts as long as its slowest group), ``"sum"`` when they share one device in turn."""
    f = {"max": max, "sum": sum}[reduce]
    return [float(f((g.time_s for g in row), default=0.0)) for row in records.groups]


def phase_fractions(
    records: Records, end: int | None = None, tick_seconds: list[float] | None = None
) -> dict[str, float]:
    """Shares of ``rollout_only``, ``overlap``, ``train_only`` and ``neither`` over the ticks
    ``[0, end)`` (all recorded ticks if None; seconds on the wall clock); see the module doc.
    Weighted by ``tick_seconds`` (one per recorded tick) when given."""
    return _PHASES[records.clock](records, end, tick_seconds)


PHASE_NAMES = ("rollout_only", "overlap", "train_only", "neither")


def _tick_phases(
    records: Records, end: int | None, tick_seconds: list[float] | None
) -> dict[str, float]:
    n = len(records.groups) if end is None else min(end, len(records.groups))
    if n == 0:
        return dict.fromkeys(PHASE_NAMES, 0.0)
    _, act, active = _grid(records, n)
    rolling = ((act == _PREFILL) | (act == _DECODE) | (active > 0)).any(axis=0)
    training = np.zeros(n, dtype=bool)
    for s in records.steps:
        training[max(s.start, 0) : min(s.end, n)] = True
    w = np.diff(_time_edges(len(records.groups), tick_seconds))[:n]
    total = w.sum() or 1.0
    parts = (rolling & ~training, rolling & training, ~rolling & training, ~rolling & ~training)
    return {k: float(w[m].sum() / total) for k, m in zip(PHASE_NAMES, parts, strict=True)}


def _span_phases(records: Records, end: float | None, tick_seconds: Any) -> dict[str, float]:
    """Wall-clock records: seconds, from the groups' spans and the steps' spans."""
    h = records.horizon() if end is None else end
    roll = merge_intervals(
        [
            (g.t0, min(g.t1, h))
            for g in records.spans
            if g.activity in ("prefill", "decode") and g.t0 < h
        ]
    )
    train = merge_intervals([(s.start, min(s.end, h)) for s in records.steps if s.start < h])
    both = intersection_length(roll, train)
    r, t = sum(b - a for a, b in roll), sum(b - a for a, b in train)
    parts = (r - both, both, t - both, max(h - r - t + both, 0.0))
    return {k: v / h if h > 0 else 0.0 for k, v in zip(PHASE_NAMES, parts, strict=True)}


_PHASES = {"logical": _tick_phases, "wall": _span_phases}  # by Records.clock


def _horizon(summary: Summary) -> float:
    """The summary's horizon: seconds on the wall clock, else ticks."""
    return CLOCKS[summary.clock].horizon(summary)


def consumed_in(records: Records, summary: Summary) -> list[ConsumedRecord]:
    """The consumed trajectories ``summary`` counts (same rule as ``Records.summary``)."""
    end = _horizon(summary)
    steps_in = [s for s in records.steps if s.end <= end]
    if not steps_in:
        return []
    last = steps_in[-1].version
    return [c for c in records.consumed if c.tick < end and c.trainer_version < last]


def reward_stats(rewards: list[tuple[int, float]]) -> dict[str, Any]:
    """``(step, value)`` points -> the curve, and the means of its first and last ``n_avg``
    finite points, ``n_avg = max(1, points // 5)`` (the first and last fifth of the run): the
    one definition of "start -> end" for the summary and the terminal."""
    pts = [(int(s), float(r)) for s, r in rewards]
    finite = [r for _, r in pts if math.isfinite(r)]
    n = max(1, len(finite) // 5)
    start = sum(finite[:n]) / n if finite else math.nan
    end = sum(finite[-n:]) / n if finite else math.nan
    return {"curve": pts, "n_avg": n, "start": start, "end": end, "delta": end - start}


def write_summary(
    run_dir: str | Path,
    *,
    summary: Summary,
    records: Records,
    rewards: list[tuple[int, float]],
    wall_s: float,
    overheads: dict[str, float] | None = None,
    extra: dict | None = None,
    tick_seconds: list[float] | None = None,
    held_out: list[dict] | None = None,
) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.md`` to ``run_dir``; return their paths.

    Counts follow ``summary`` (its horizon of ``summary.ticks`` ticks); per-second throughput
    divides them by ``wall_s``. ``rewards``: ``(step, mean reward)``; start / end are the means of
    the first / last ``n`` finite points, ``n = max(1, len // 5)`` (:func:`reward_stats`). Each
    ``<name>_s`` entry of ``overheads`` is also given as ``<name>_frac = seconds / wall_s``. The
    markdown embeds ``timeline.png`` (write it with :func:`plot_timeline`).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    consumed = consumed_in(records, summary)
    hist = dict(sorted(Counter(c.staleness for c in consumed).items()))
    phases = phase_fractions(records, _horizon(summary), tick_seconds)
    per_s = wall_s if wall_s > 0 else math.nan
    oh = {
        k: v
        for k, v in (overheads or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    oh_frac = {f"{k[:-2]}_frac": v / per_s for k, v in oh.items() if k.endswith("_s")}
    mig_events = sum(1 for t, _ in records.migrations if t < _horizon(summary))
    reward = reward_stats(rewards)
    data = {
        "mode": summary.mode,
        "clock": summary.clock,
        "wall_s": wall_s,
        "ticks": summary.ticks,
        "steps": summary.steps,
        "throughput": {
            "trajectories": summary.trajectories,
            "tokens": summary.tokens,
            "traj_per_tick": CLOCKS[summary.clock].per_tick(summary.traj_per_tick),
            "tokens_per_tick": CLOCKS[summary.clock].per_tick(summary.tokens_per_tick),
            "traj_per_s": summary.trajectories / per_s,
            "tokens_per_s": summary.tokens / per_s,
        },
        "bubble": summary.bubble,
        "overlap": summary.overlap,
        "group_idle": list(summary.group_idle),
        "utilisation": summary.utilisation,
        "rollout_only_frac": phases["rollout_only"],
        "phases": phases,
        "staleness_hist": hist,
        "staleness_mean": summary.staleness_mean,
        "staleness_max": summary.staleness_max,
        "migrated_requests": summary.migrated,
        "migration_events": mig_events,
        "weight_transfers": summary.weight_transfers,
        "reprefill_tokens": summary.reprefill_tokens,
        "discarded": summary.discarded,
        "reward": reward,
        "held_out_eval": held_out or [],
        "overheads": {**oh, **oh_frac},
        "summary": asdict(summary),
        "extra": extra or {},
    }
    jpath, mpath = run_dir / "summary.json", run_dir / "summary.md"
    jpath.write_text(json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")
    mpath.write_text(_markdown(data, summary, oh_frac))
    return jpath, mpath


def _f(x: Any, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if pct:
        return f"{100 * x:.1f} %"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _by_source(s: Summary) -> str:
    return ", ".join(f"{n} from {k}" for k, n in sorted(s.recovered.items())) or "0"


def _short(v: Any) -> str:
    if isinstance(v, list | tuple) and len(v) > 10:
        return f"{len(v)} items (see summary.json)"
    return str(v)


def _markdown(d: dict, s: Summary, oh_frac: dict[str, float]) -> str:
    th, ph, rw = d["throughput"], d["phases"], d["reward"]
    horizon = CLOCKS[s.clock].describe(s)
    rows = [
        ("mode / clock", f"{s.mode} / {s.clock}"),
        ("horizon / train steps / wall time", f"{horizon} / {s.steps} / {_f(d['wall_s'])} s"),
        ("trajectories / tokens consumed", f"{s.trajectories} / {s.tokens}"),
        ("trajectories per tick / per s", f"{_f(th['traj_per_tick'])} / {_f(th['traj_per_s'])}"),
        ("tokens per tick / per s", f"{_f(th['tokens_per_tick'])} / {_f(th['tokens_per_s'])}"),
        ("bubble (idle group time)", _f(s.bubble, True)),
        ("trainer-busy time with rollout decoding", _f(s.overlap, True)),
        ("idle share per group", ", ".join(_f(x, True) for x in s.group_idle)),
        ("rollout-only time", _f(ph["rollout_only"], True)),
        (
            "overlap / train-only / neither",
            " / ".join(_f(ph[k], True) for k in ("overlap", "train_only", "neither")),
        ),
        ("decode slot utilisation", _f(s.utilisation, True)),
        ("staleness mean / max", f"{_f(s.staleness_mean)} / {s.staleness_max}"),
        ("max live versions / max version span", f"{s.max_live_versions} / {s.max_version_span}"),
        ("migrated requests (events)", f"{s.migrated} ({d['migration_events']})"),
        ("weight transfers", str(s.weight_transfers)),
        ("re-prefill tokens", str(s.reprefill_tokens)),
        ("discarded requests", str(s.discarded)),
        ("failed rollout groups / requests recovered", f"{s.group_failures} / {_by_source(s)}"),
        ("plans (mean / max ms)", f"{s.plans} ({_f(s.plan_ms_mean)} / {_f(s.plan_ms_max)})"),
        (
            f"reward start -> end (mean of {rw['n_avg']} steps)",
            f"{_f(rw['start'])} -> {_f(rw['end'])}",
        ),
    ]
    ev = d["held_out_eval"]
    if ev:
        rows.append(
            (
                f"held-out solved, step {ev[0]['step']} -> {ev[-1]['step']}",
                f"{_f(ev[0]['solved'])} -> {_f(ev[-1]['solved'])} "
                f"(evaluations: {', '.join(_f(e['solved']) for e in ev)})",
            )
        )
        for name in ev[-1].get("at_k", {}):  # mean@k, pass@j with several samples per problem
            first, last = ev[0]["at_k"].get(name), ev[-1]["at_k"][name]
            rows.append(
                (
                    f"held-out {name}, step {ev[0]['step']} -> {ev[-1]['step']}",
                    f"{_f(first)} -> {_f(last)}",
                )
            )
    errors = (d.get("extra") or {}).get("reward_errors_by_kind")
    if errors:
        rows.append(
            (
                "reward function failures (reward 0)",
                ", ".join(f"{k} {n}" for k, n in errors.items()),
            )
        )
    rows += [(f"overhead: {k[:-5]}", f"{_f(v, True)} of wall time") for k, v in oh_frac.items()]
    out = [f"# Run summary: {s.mode}", "", "| metric | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", "![timeline](timeline.png)", "", "## Staleness of consumed trajectories", ""]
    n = sum(d["staleness_hist"].values())
    out += ["| staleness | trajectories | share |", "|---|---|---|"]
    out += [f"| {k} | {c} | {_f(c / n, True)} |" for k, c in d["staleness_hist"].items()]
    if d["extra"]:
        out += ["", "## Extra", ""] + [f"- {k}: {_short(v)}" for k, v in d["extra"].items()]
    out += [
        "",
        "## Definitions",
        "",
        f"Counts cover the summary horizon ({horizon}), up to the end of the last train step; "
        "per-second figures divide them by the run's wall time.",
        "",
        "- bubble: group-ticks in which a group is idle (holds no request, receives no weights) "
        "over all group-ticks.",
        "- rollout-only time: share of ticks in which no train step runs (no StepRecord span "
        "[start, end) covers the tick) while at least one group prefills, decodes or holds a "
        "request. overlap: both run; train-only: the trainer runs, every group is idle or "
        "receiving weights; neither: the rest. The four shares sum to 100 %.",
        "- staleness: trainer version at the update minus the trajectory's version.",
        "- overheads: seconds of each kind over the run's wall time.",
        "",
    ]
    return "\n".join(out)


def window(records: Records, t0: float, t1: float) -> Records:
    """Wall clock: the records of ``[t0, t1)`` seconds, shifted to start at 0 (a readable view of
    a stretch of a long run)."""

    def cut(t: float) -> bool:
        return t0 <= t < t1

    return replace(
        records,
        spans=[
            g._replace(t0=max(g.t0, t0) - t0, t1=min(g.t1, t1) - t0)
            for g in records.spans
            if g.t1 > t0 and g.t0 < t1
        ],
        cluster=[c._replace(time=c.time - t0) for c in records.cluster if cut(c.time)],
        steps=[
            replace(s, start=max(s.start, t0) - t0, end=min(s.end, t1) - t0)
            for s in records.steps
            if s.end > t0 and s.start < t1
        ],
        plans=[replace(p, tick=p.tick - t0) for p in records.plans if cut(p.tick)],
        transfers=[(t - t0, g, v) for t, g, v in records.transfers if cut(t)],
        migrations=[(t - t0, n) for t, n in records.migrations if cut(t)],
        discards=[(t - t0, n) for t, n in records.discards if cut(t)],
        consumed=[replace(c, tick=c.tick - t0) for c in records.consumed if cut(c.tick)],
        cross_host=[(t - t0, *rest) for t, *rest in records.cross_host if cut(t)],
    )


def head(records: Records, ticks: float) -> Records:
    """The first ``ticks`` ticks (seconds, on the wall clock) of ``records`` (for a readable
    close-up of a long run)."""
    return replace(
        records,
        groups=records.groups[: int(ticks)],
        spans=[g for g in records.spans if g.t0 < ticks],
        cluster=[c for c in records.cluster if c.time < ticks],  # (logical: time is the tick)
        steps=[s for s in records.steps if s.start < ticks],
        plans=[p for p in records.plans if p.tick < ticks],
        transfers=[t for t in records.transfers if t[0] < ticks],
        migrations=[m for m in records.migrations if m[0] < ticks],
        discards=[d for d in records.discards if d[0] < ticks],
        consumed=[c for c in records.consumed if c.tick < ticks],
    )
