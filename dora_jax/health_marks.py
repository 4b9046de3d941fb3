"""Group health on the timeline: the stretches a rollout group spent out of the run.

A group whose engine or process failed is *dead*, then *restarting* (its engine rebuilt, or its
process started again and building its engines), then, when it rejoins, *stale* while it loads
the version it is given, then *healthy* (``Records.health``: time, group, state, reason). On the
timeline each stretch not healthy is hatched over its group's lane, in the state's colour, from
its start to the next change (or the end of the run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from matplotlib.patches import Patch

# edge colours of the hatching: red (dead), orange (restarting), purple (stale)
HEALTH_RGB = {
    "dead": (0.84, 0.15, 0.16),
    "restarting": (1.0, 0.5, 0.05),
    "stale": (0.58, 0.4, 0.74),
}


def stretches(
    health: Sequence[tuple[float, int, str, str]], end: float
) -> list[tuple[int, str, float, float]]:
    """``(group, state, start, stop)`` for every stretch of a state other than healthy."""
    out = []
    by_group: dict[int, list[tuple[float, str]]] = {}
    for t, g, state, _ in sorted(health, key=lambda h: h[0]):
        by_group.setdefault(int(g), []).append((float(t), state))
    for g, changes in sorted(by_group.items()):
        after = [*changes[1:], (max(end, changes[-1][0]), "")]
        for (t0, state), nxt in zip(changes, after, strict=True):
            if state != "healthy" and nxt[0] >= t0:
                out.append((g, state, t0, nxt[0]))
    return out


def draw_health(ax: Any, health: Sequence, end: float, x_at: Callable[[float], float]) -> list:
    """Hatch every unhealthy stretch over its group's lane on ``ax``; the legend's patches for
    the states drawn (none when every group stayed healthy)."""
    seen = []
    for g, state, t0, t1 in stretches(health, end):
        a, b = x_at(t0), x_at(t1)
        width = max(b - a, 1e-9)
        color = HEALTH_RGB.get(state, (0.3, 0.3, 0.3))
        ax.broken_barh(
            [(a, width)], (g - 0.45, 0.9), facecolors="none", edgecolors=color, hatch="///", lw=0.8
        )
        if state not in seen:
            seen.append(state)
    return [
        Patch(facecolor="white", edgecolor=HEALTH_RGB.get(s, (0.3, 0.3, 0.3)), hatch="///", label=s)
        for s in seen
    ]
