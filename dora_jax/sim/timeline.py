"""The timeline of a simulated run with conversations: the real runs' picture (one lane per
rollout group over modeled time, coloured by the version it holds; the trainer's steps on top),
with the time a group spends idle while its requests wait on their environments drawn in its
own colour (the ``env_wait`` activity; :attr:`~dora_jax.sim.waiting.WaitingRequests.env_wait_s`).

The colours are those of :func:`dora_jax.report.plot_timeline`: full version colour decoding,
light prefilling or holding requests that wait for something else, grey receiving weights,
near-black moving KV, white idle; environment waits are gold. A column of the image is the
time-weighted mean colour of the ticks it covers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dora_jax.report import (
    ENV_WAIT_RGB,
    IDLE_RGB,
    MAX_COLS,
    MIGRATE_RGB,
    PALETTE,
    TINT,
    TRANSFER_RGB,
    version_color,
)

ACTIVITIES = ("idle", "prefill", "decode", "transfer", "migrate", "env_wait")


def _cells(rows, env_s: np.ndarray, tick_s: float) -> np.ndarray:
    """``[groups, ticks, 3]`` colours of the group ticks ``rows`` (``GroupTick`` tuples), each
    ``env_s / tick_s`` of the way to the environment-wait colour."""
    version = np.array([[g.version for g in row] for row in rows], np.int64).T
    act = np.array([[g.activity for g in row] for row in rows]).T
    active = np.array([[g.active for g in row] for row in rows], np.int64).T
    base = PALETTE[version % len(PALETTE)]
    light = base * (1 - TINT) + TINT
    rgb = np.broadcast_to(IDLE_RGB, base.shape).copy()
    holding = (act == "prefill") | ((act == "idle") & (active > 0))
    rgb[holding] = light[holding]
    rgb[act == "decode"] = base[act == "decode"]
    rgb[act == "transfer"] = TRANSFER_RGB
    rgb[act == "migrate"] = MIGRATE_RGB
    f = np.clip(env_s.T / tick_s, 0.0, 1.0)[:, :, None]
    return (1.0 - f) * rgb + f * ENV_WAIT_RGB


def _columns(cells: np.ndarray, ncols: int) -> np.ndarray:
    """Average equal-length ticks into ``ncols`` columns."""
    ticks = cells.shape[1]
    col = np.minimum(np.arange(ticks) * ncols // ticks, ncols - 1)
    out = np.zeros((cells.shape[0], ncols, 3))
    np.add.at(out, (slice(None), col), cells)
    return out / np.bincount(col, minlength=ncols)[None, :, None]


def conversation_timeline_png(run, path: str | Path, span: tuple[int, int]) -> Path:
    """Write the PNG of a :class:`~dora_jax.sim.run.SimRun` with conversations over ticks
    ``span`` (:func:`dora_jax.sim.report.timeline_png` gives it), x in modeled seconds."""
    cfg, rec, backend = run.cfg, run.result.records, run.backend
    dt = cfg.run.tick_s
    a, b = int(max(0, span[0])), int(min(len(rec.groups), span[1]))
    if b <= a:
        raise ValueError(f"no ticks to draw in [{a}, {b})")
    env = np.asarray(backend.waiting.env_wait_s[a:b]).reshape(b - a, backend.num_groups)
    img = _columns(_cells(rec.groups[a:b], env, dt), min(b - a, MAX_COLS))
    ngroups = backend.num_groups
    lanes_in = float(np.clip(0.2 * ngroups, 1.6, 16.0))
    fig = Figure(figsize=(14, lanes_in + 1.6), dpi=110, layout="constrained")
    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.35, lanes_in])
    x0, x1 = a * dt, b * dt
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=(x0, x1, ngroups - 0.5, -0.5))
    versions = {g.version for row in rec.groups[a:b] for g in row if g.active}
    for s in rec.steps:
        lo, hi = max(s.start, a) * dt, min(s.end, b) * dt
        if hi > lo:
            top.broken_barh(
                [(lo, hi - lo)],
                (-0.4, 0.8),
                facecolors=version_color(s.version),
                edgecolors="white",
                linewidth=0.6,
            )
            versions.add(s.version)
    top.set(yticks=[0], yticklabels=["trainer"], ylim=(0.5, -0.5))
    top.tick_params(labelsize=8, length=0, labelbottom=False)
    moves = [(t * dt, g) for t, g, _ in rec.transfers if a <= t < b]
    if moves:
        ax.scatter(*zip(*moves, strict=True), marker=">", s=14, c="black", linewidths=0, zorder=3)
    step = max(1, -(-ngroups // 32))
    ticks = list(range(0, ngroups, step))
    ax.set(
        yticks=ticks,
        yticklabels=[f"g{g}" for g in ticks],
        ylim=(ngroups - 0.5, -0.5),
        xlim=(x0, x1),
        xlabel="modeled time (s)",
        ylabel="rollout group",
    )
    m = run.metrics
    top.set_title(f"{cfg.name}: {m.mode} ({m.placement}), {ngroups} groups, conversations")
    handles = [Patch(color=version_color(v), label=f"v{v}") for v in sorted(versions)[:12]]
    handles += [
        Patch(color=tuple(PALETTE[0] * (1 - TINT) + TINT), label="light: prefill / holding"),
        Patch(color=tuple(ENV_WAIT_RGB), label="environment wait"),
        Patch(color=tuple(TRANSFER_RGB), label="weight transfer"),
        Patch(color=tuple(MIGRATE_RGB), label="KV move"),
        Patch(facecolor="white", edgecolor="0.6", label="idle"),
    ]
    fig.legend(handles=handles, loc="outside right upper", fontsize=7, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
