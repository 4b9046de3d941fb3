"""One shared device (``shared_device``: the rollout groups of the CPU preset's two-process
arrangement, four engines on one pinned core). Each tick's ``tick_s`` is divided among the groups
with work, water-filled by what each has to do (the rest of its transfers, its prefill, its
decode until its furthest turn end, at the cost model's rates; what those estimates leave over
is split evenly among them): a group alone gets the whole tick, four busy ones a quarter
each. The part of the tick a group does not get counts as idle (it waits for the device), not
as its environment wait.
"""

from __future__ import annotations

import numpy as np

from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.requests import RequestTable


def device_shares(
    requests: RequestTable,
    cost: CostModel,
    tick_s: float,
    sched: np.ndarray | None,
    away: np.ndarray,
    moving_s: np.ndarray,
    carry_s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of this tick each group gets of the one device the groups share: ``tick_s``
    water-filled by each group's work (``moving_s``, the rest of its transfers and KV imports;
    its pending prefill in one call; and decode steps until its furthest turn end at the cost
    model's step time for its batch), less what it carried over (``carry_s``); and which groups
    have work. Only the rows ``sched`` (None: all held) count; groups ``away`` (waiting for
    their weights) take no share."""
    q, w = requests, requests.width()
    valid = q.held(w)
    live = valid if sched is None else valid & sched
    pf = np.where(live, q.prefill_left[:, :w], 0)
    full = q.context(w)
    pairs = np.where(live, cost.causal_pairs(full - pf, full), 0.0)
    rem = np.where(live, q.target[:, :w] - q.generated[:, :w], 0)
    nr = (live & (rem > 0)).sum(axis=1)
    ctx = np.where(live, full, 0).sum(axis=1)
    step = cost.decode_step_s(np.maximum(nr, 1), ctx)
    need = moving_s + np.where(
        pf.sum(axis=1) > 0, cost.prefill_s(pf.sum(axis=1), pairs.sum(axis=1)), 0.0
    )
    need = need + np.where(nr > 0, step * rem.max(axis=1, initial=0), 0.0)
    need = np.where(away, 0.0, need)
    working = need > 0
    need = np.maximum(need - carry_s, 0.0)
    share = np.zeros(len(need))
    left, todo = tick_s, [int(g) for g in np.argsort(need, kind="stable") if need[g] > 0]
    for i, g in enumerate(todo):  # the smallest needs first, each up to an equal split
        share[g] = min(need[g], left / (len(todo) - i))
        left -= share[g]
    if todo and left > 0:  # what no estimate claimed (they are estimates): to all of them
        share[todo] += left / len(todo)
    return share, working
