"""One shared device (``shared_device``: the rollout groups of the CPU preset's two-process
arrangement, four engines on one pinned core). Each tick's ``tick_s`` is divided among the groups
with work, water-filled by what each has to do (the rest of its transfers, its prefill, its
decode until its furthest turn end, at the cost model's rates; what those estimates leave over
is split evenly among them): a group alone gets the whole tick, four busy ones a quarter
each. The part of the tick a group does not get counts as idle (it waits for the device), not
as its environment wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dora_jax.sim.backend import SimBackend


def device_shares(
    sim: SimBackend, sched: np.ndarray | None, away: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of this tick each group gets of the one device the groups share: ``tick_s``
    water-filled by each group's work (the rest of its transfers and KV imports, its
    pending prefill in one call, and decode steps until its furthest turn end at the cost
    model's step time for its batch), less what it carried over; and which groups have
    work. Groups ``away`` (waiting for their weights) take no share."""
    w = int(sim.n.max())
    valid = sim._col[None, :w] < sim.n[:, None]
    live = valid if sched is None else valid & sched
    pf = np.where(live, sim.pf[:, :w], 0)
    full = sim.plen[:, :w] + sim.gen[:, :w]
    pairs = np.where(live, sim.cost.causal_pairs(full - pf, full), 0.0)
    rem = np.where(live, sim.target[:, :w] - sim.gen[:, :w], 0)
    nr = (live & (rem > 0)).sum(axis=1)
    ctx = np.where(live, full, 0).sum(axis=1)
    step = sim.cost.decode_step_s(np.maximum(nr, 1), ctx)
    need = (
        sim.busy
        + sim.mig
        + np.where(pf.sum(axis=1) > 0, sim.cost.prefill_s(pf.sum(axis=1), pairs.sum(axis=1)), 0.0)
    )
    need = need + np.where(nr > 0, step * rem.max(axis=1, initial=0), 0.0)
    need = np.where(away, 0.0, need)
    working = need > 0
    need = np.maximum(need - sim.carry, 0.0)
    share = np.zeros(sim.num_groups)
    left, todo = sim.tick_s, [int(g) for g in np.argsort(need, kind="stable") if need[g] > 0]
    for i, g in enumerate(todo):  # the smallest needs first, each up to an equal split
        share[g] = min(need[g], left / (len(todo) - i))
        left -= share[g]
    if todo and left > 0:  # what no estimate claimed (they are estimates): to all of them
        share[todo] += left / len(todo)
    return share, working
