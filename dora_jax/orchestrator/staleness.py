"""The staleness bound K chosen from measured drift (``orchestrator.staleness_k: auto``).

A fixed K is a guess: too small wastes the multi-version rollout's throughput, too large lets the
policy drift away from the versions that sampled the batch. With ``staleness_k: auto`` the runtime
re-chooses K after every train step, within ``[k_min, k_max]``, from two measurements:

- **the drift**: every train step measures, per version lag ``k`` (the trainer's version minus
  the sampling version), the normalised effective sample size of the token importance weights,
  ``ESS_k`` (1 when the trainer's policy equals the sampler's; ``dora_jax/train/step.py``). Lag 0's
  value is what engine/trainer numerics alone cost, so the drift of lag ``k`` is
  ``loss_k = 1 - ESS_k / ESS_0``. The importance weights of a policy that moved ``k`` steps have a
  spread that grows with ``k`` and a chi-square divergence that grows as ``k^2`` for small steps,
  so the step's lags are fitted to ``loss_k = c * k^2`` (token-weighted least squares) and ``c``,
  the drift coefficient, is kept as a moving average over steps;
- **what K buys**: the share of the step's interval the trainer sat idle with a full batch ready
  because the window's oldest version had not drained (``wait_share``): a long-tailed length
  distribution makes it large, a short one leaves it near 0, and only then does a larger K pay.

The rule, after ``warmup`` steps (an empty cluster has neither drift nor waiting to show):

- **lower at once** when the drift predicted at the bound breaks the budget: ``c * K^2 >
  1 - ess_min``; K drops to the largest value within it (``k_min`` at least);
- **raise by one** when the trainer waited (``wait_share >= wait_min``, averaged like ``c``), the
  next K's predicted drift is within half the budget (``c * (K + 1)^2 <= (1 - ess_min) / 2``: the
  hysteresis band between lowering and raising), and the last change is ``patience`` steps old;
- **probe** (raise by one) after ``4 * patience`` steps in a row with no lag >= 1 measured (K = 0,
  or nothing stale consumed), so an old drift estimate cannot hold K down for good;
- otherwise hold.

A lower K applies at once to dispatch (admission: fewer prompt groups on old versions) and to
consumption as soon as the prompt groups already dispatched fit it (:meth:`VersionWindow.set_k`):
nothing finished is ever discarded, and every request in flight keeps the bound it was dispatched
under. Each decision is a record (:class:`Decision`) with its reason and the figures it read.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

REASONS = ("warmup", "drift", "waiting", "probe", "hold")


def _average(old: float | None, new: float, weight: float) -> float:
    """A moving average's next value: ``new`` weighted ``weight`` (``new`` itself at first)."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True)
class Decision:
    """One step's choice of K and what it read."""

    version: int  # the version the step published
    k: int  # the bound chosen for what follows
    reason: str  # one of REASONS
    drift: float | None  # the drift coefficient c (moving average), None before any stale token
    ess_at_k: float | None  # 1 - c K^2: the ESS ratio predicted at the chosen K
    wait_share: float  # this step's
    wait_avg: float  # the moving average the rule read

    def as_row(self) -> tuple:
        return astuple(self)


@dataclass
class DriftK:
    """The controller's state and rule (see the module doc)."""

    k_min: int
    k_max: int
    ess_min: float = 0.9  # budget: the ESS ratio (to lag 0's) predicted at the bound
    wait_min: float = 0.05  # the waiting share above which a larger K is worth its drift
    warmup: int = 3  # steps before the first decision
    patience: int = 1  # steps between a change and the next raise
    alpha: float = 0.5  # weight of the newest step in the moving averages
    min_tokens: int = 32  # a lag's ESS counts only over this many tokens
    drift: float | None = None
    wait_avg: float = 0.0
    floor: float | None = None  # lag 0's ESS (moving average): the numerics' own
    seen: int = 0
    last_change: int = 0
    blind: int = 0  # steps in a row without a lag >= 1 measured

    def observe(self, lag_tokens, lag_ess) -> float | None:
        """Fold one train step's per-lag token counts and ESS into the drift coefficient;
        return the step's own fit (None: no lag with enough tokens)."""
        a = self.alpha
        if len(lag_tokens) and lag_tokens[0] >= self.min_tokens and lag_ess[0] > 0:
            self.floor = _average(self.floor, float(lag_ess[0]), a)
        floor = 1.0 if self.floor is None else self.floor
        num = den = 0.0
        for k in range(1, len(lag_tokens)):
            n = float(lag_tokens[k])
            if n < self.min_tokens:
                continue
            loss = max(0.0, 1.0 - float(lag_ess[k]) / max(floor, 1e-9))
            num += n * k * k * loss
            den += n * k**4
        if den == 0:
            return None
        c = num / den
        self.drift = _average(self.drift, c, a)
        return c

    def safe_k(self, share: float = 1.0) -> int:
        """The largest K whose predicted drift is within ``share`` of the budget."""
        if not self.drift:
            return self.k_max
        return int(math.floor(math.sqrt(share * (1 - self.ess_min) / self.drift) + 1e-9))

    def step(self, version: int, k: int, lag_tokens, lag_ess, wait_share: float) -> Decision:
        """Observe the step that published ``version`` under bound ``k``; choose the next K."""
        fresh = self.observe(lag_tokens, lag_ess) is not None
        self.seen += 1
        self.blind = 0 if fresh else self.blind + 1
        self.wait_avg = _average(self.wait_avg, wait_share, self.alpha)
        calm = self.seen - self.last_change >= self.patience
        new, reason = k, "hold"
        if self.seen <= self.warmup:
            reason = "warmup"
        elif self.drift is not None and k > self.k_min and self.drift * k * k > 1 - self.ess_min:
            new, reason = max(self.k_min, min(k - 1, self.safe_k())), "drift"
        elif (
            k < self.k_max and self.wait_avg >= self.wait_min and calm and k + 1 <= self.safe_k(0.5)
        ):
            new, reason = k + 1, "waiting"
        elif k < self.k_max and self.blind >= 4 * self.patience and calm:
            # no lag >= 1 measured for a while (K = 0, or nothing stale consumed): the drift
            # read last may be long gone; one more version of room measures it again
            new, reason = k + 1, "probe"
        if new != k:
            self.last_change = self.seen
        ess = None if self.drift is None else 1 - self.drift * new * new
        return Decision(version, new, reason, self.drift, ess, wait_share, self.wait_avg)

    def state_dict(self) -> dict:
        return {
            "drift": self.drift,
            "wait_avg": self.wait_avg,
            "floor": self.floor,
            "seen": self.seen,
            "last_change": self.last_change,
            "blind": self.blind,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("drift", "wait_avg", "floor", "seen", "last_change", "blind"):
            setattr(self, key, state[key])


@dataclass(frozen=True)
class DriftModel:
    """A stand-in for the train step's measurement, for trainers that run no model (the fake
    trainer, the simulator): a batch's lag ``k`` reads ``ESS_k = 1 - c k^2`` (at least 0), ``c``
    being ``coefficient``, times ``stress_factor^2`` for the ``stress_steps`` steps from
    ``stress_start`` (a learning rate ``f`` times larger moves the policy ``f`` times further a
    step, and the drift grows as its square)."""

    coefficient: float = 0.001
    stress_start: int = -1  # the first step of the stress (-1: none)
    stress_steps: int = 0
    stress_factor: float = 1.0

    def coefficient_at(self, step: int) -> float:
        stressed = 0 <= self.stress_start <= step < self.stress_start + self.stress_steps
        return self.coefficient * (self.stress_factor**2 if stressed else 1.0)

    def signal(self, step: int, lag_tokens: list[int]) -> tuple[list[int], list[float]]:
        """``(lag_tokens, lag_ess)`` as a train step at ``step`` (0-based) would report them."""
        c = self.coefficient_at(step)
        ess = [max(0.0, 1.0 - c * k * k) if n else 0.0 for k, n in enumerate(lag_tokens)]
        return list(lag_tokens), ess


def lag_tokens_of(batch, version: int, bins: int = 8) -> list[int]:
    """Response tokens per lag (``version`` minus the sampling version, the last bin also
    counting larger lags) of a batch of ready prompt groups."""
    out = [0] * bins
    for rg in batch:
        out[min(version - rg.version, bins - 1)] += rg.response_tokens
    return out
