"""Curves against consumed samples: one line per run (:func:`reward_curve_plot`), or several
seeds per run with their mean and its standard-error band (:func:`seed_band`,
:func:`seed_band_plot`). Drawn with ``matplotlib.figure.Figure`` (Agg; no pyplot)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure


def reward_curve_plot(
    curves: dict[str, list[tuple[int, float]]],
    path: str | Path,
    xlabel: str = "consumed samples",
    *,
    ylabel: str = "mean reward",
    title: str = "",
) -> Path:
    """Write a PNG with one line per label of ``curves`` (``(x, mean reward)`` points; NaNs are
    left out), e.g. to compare the convergence of several modes."""
    path = Path(path)
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for label, pts in curves.items():
        pts = sorted((x, y) for x, y in pts if math.isfinite(y))
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, ms=3, lw=1.4, label=label)
    return _save_curves(fig, ax, path, bool(curves), xlabel=xlabel, ylabel=ylabel, title=title)


def seed_band(
    curves: list[list[tuple[float, float]]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The mean over seeds' ``(x, y)`` curves at the first curve's x values (the others
    interpolated there), and the standard error of that mean (None for one curve)."""
    xs = np.array([x for x, _ in curves[0]], float)
    ys = np.array([np.interp(xs, *np.array(sorted(c), float).T) for c in curves])
    se = ys.std(axis=0, ddof=1) / math.sqrt(len(curves)) if len(curves) > 1 else None
    return xs, ys.mean(axis=0), se


def seed_band_plot(
    runs: dict[str, list[list[tuple[int, float]]]],
    path: str | Path,
    xlabel: str = "consumed samples",
    *,
    ylabel: str = "mean reward",
    title: str = "",
) -> Path:
    """Write a PNG with, per label of ``runs`` (one ``(x, y)`` curve per seed), each seed's
    curve as a thin line and the mean over seeds as a thick one with a band of one standard
    error of that mean. Seeds' curves are compared at the first seed's x values (interpolated
    where a seed has other x values)."""
    path = Path(path)
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, seeds) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        curves = [sorted((x, y) for x, y in c if math.isfinite(y)) for c in seeds]
        curves = [c for c in curves if c]
        if not curves:
            continue
        for c in curves:
            ax.plot(*zip(*c, strict=True), color=color, lw=0.6, alpha=0.35)
        xs, mean, se = seed_band(curves)
        ax.plot(xs, mean, color=color, lw=1.8, label=f"{label} (mean of {len(curves)})")
        if se is not None:
            ax.fill_between(xs, mean - se, mean + se, color=color, alpha=0.2, lw=0)
    return _save_curves(fig, ax, path, bool(runs), xlabel=xlabel, ylabel=ylabel, title=title)


def _save_curves(fig: Figure, ax: Any, path: Path, legend: bool, **labels: str) -> Path:
    """Label, grid and legend a curve plot and write it as a PNG."""
    ax.set(**labels)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
