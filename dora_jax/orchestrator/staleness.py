"""Adaptive staleness (beyond the paper): the bound K chosen per train step within the user's.

The paper's limitation (sec. 5) is a K fixed by hand. With ``orchestrator.adaptive_k`` the
runtime re-chooses K after every train step, between ``adaptive_k_min`` and ``staleness_k`` (the
user's bound, never exceeded), by comparing two costs in one unit, a share of a step:

- the **cost of waiting** for the oldest version: the share of the step's interval (publish to
  publish) the trainer sat idle with a full batch ready because the window's oldest version had
  not drained (``wait_share``): time a larger K might have saved;
- the **staleness effect**: ``staleness_cost`` per unit of mean staleness of the batch the step
  consumed, the share of a step's progress one unit of staleness costs the learning. It is
  measured by the user (the paper's appendix C.1 bounds it by the on-policy improvement rate per
  step); a trainer may report a live estimate through an optional ``staleness_effect()`` method.

Each step scores the K it ran under: ``cost = wait_share + staleness_cost * mean staleness``,
kept as a moving average per K (:class:`AdaptiveK`). The next K is the one of ``K - 1, K, K + 1``
(within the bounds) with the lowest average cost, a neighbour not tried for ``revisit`` steps
first (K + 1 when the step waited more than one unit of staleness costs, else K - 1): the cost
of a K shows only some steps later (dispatch runs K steps ahead) and drifts with the workload.
A lower K applies at once to dispatch, and to consumption as soon as the prompt groups already
dispatched fit it (:meth:`VersionWindow.set_k`); the first ``warmup`` steps (an empty cluster: no
waiting, no staleness) are not scored. One step at a time, so a burst of waiting cannot swing K
across its range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveK:
    """Per-K moving averages of the step cost, and the choice of the next K."""

    k_min: int
    k_max: int
    alpha: float = 0.3  # weight of the newest step in a K's moving average
    warmup: int = 2  # steps not scored
    revisit: int = 6  # a K not run for this many steps is tried again (its cost has aged)
    costs: dict[int, float] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # K -> step it was last scored at
    seen: int = 0

    def observe(self, k: int, wait_share: float, staleness: float, staleness_cost: float) -> float:
        """Score the step that ran under ``k``; return its cost."""
        cost = wait_share + staleness_cost * staleness
        self.seen += 1
        if self.seen <= self.warmup:
            return cost
        old = self.costs.get(k)
        self.costs[k] = cost if old is None else (1 - self.alpha) * old + self.alpha * cost
        self.last[k] = self.seen
        return cost

    def choose(self, k: int, wait_share: float, staleness_cost: float) -> int:
        """The K for the next step (see the module doc)."""
        near = [x for x in (k - 1, k, k + 1) if self.k_min <= x <= self.k_max]
        if self.seen <= self.warmup:
            return k
        untried = [x for x in near if self.seen - self.last.get(x, -self.revisit) >= self.revisit]
        if untried:
            up = wait_share > staleness_cost
            for x in (k + 1, k - 1) if up else (k - 1, k + 1):
                if x in untried:
                    return x
            return untried[0]
        return min(near, key=lambda x: (self.costs[x], x))
