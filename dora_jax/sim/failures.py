"""Rollout groups that fail, in the simulator (``SimConfig.failures``), and what stopping the
whole job at every failure would cost instead.

Recovery in place (:class:`GroupFailures`, run by :class:`~dora_jax.sim.backend.SimBackend`),
as the real backend does for a rollout host that dies: each group's failures are a Poisson
process in modeled seconds (rate ``rollout_tp / gpu_mtbf``, drawn from ``failures.seed`` and the
group); at a failure every request the group held goes back to the control plane as recovered
from its prompt (its response is sampled again from the start, same length; the prompt's prefill
counts as re-prefill), and the group is *dead* and out of ``groups()`` for ``restart_s``, idle;
then it is *stale* while it loads the newest version from the trainer, and *healthy* once loaded.

Stop and resume (:func:`stop_and_resume`): every failure anywhere stops the job, which restarts
in ``job_restart_s`` and repeats the work since the last checkpoint (on average half of
``checkpoint_every_s``): of each ``1 / rate`` seconds between failures, ``lost`` are lost, so the
throughput is the one without failures times ``1 / (1 + rate * lost)``. The trainer's own
failures cost that under both policies (the trainer is one SPMD program).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dora_jax.orchestrator.backend import HealthChange, PartialRequest
from dora_jax.sim.config import FailureConfig
from dora_jax.sim.requests import RequestTable

HOUR = 3600.0


class FailingGroups(Protocol):
    """What :class:`GroupFailures` needs of the backend: each group's ``version``, to take
    requests back, to make a group load the newest version (returned) from the trainer, whether
    one still loads, and to make one drop its work in flight."""

    version: np.ndarray

    def interrupt(self, request_ids: list[int], discard: bool = False) -> list[PartialRequest]: ...
    def load_newest(self, group: int) -> int: ...
    def loading(self, group: int) -> bool: ...
    def halt(self, group: int) -> None: ...


class GroupFailures:
    """Failure times per group and the failed groups' state, for the groups whose requests are
    in ``requests``, in ticks of ``tick_s`` (``cfg`` None: groups never fail)."""

    def __init__(
        self, cfg: FailureConfig | None, requests: RequestTable, rollout_tp: int, tick_s: float
    ):
        self.cfg, self.requests, self.tick_s = cfg, requests, tick_s
        num_groups = len(requests.count)
        self.down_until = np.zeros(num_groups)  # modeled seconds; > now: out of the run
        self.failed = 0  # group failures so far
        self.recovered_requests = 0
        self._stale: set[int] = set()
        self._health: list[HealthChange] = []
        self._recovered: list[PartialRequest] = []
        self._next_failure = np.full(num_groups, np.inf)
        if cfg is not None:
            self._rate = rollout_tp / (cfg.gpu_mtbf_hours * HOUR)  # per group and second
            self._rng = np.random.default_rng([cfg.seed, 7919])
            self._next_failure = self._rng.exponential(1.0 / self._rate, num_groups)

    def down(self, tick: int) -> np.ndarray:
        """Which groups are out of the run at tick ``tick``."""
        return self.down_until > tick * self.tick_s

    def sendable_versions(self, version: np.ndarray, published: int, tick: int) -> frozenset[int]:
        """Versions older than the newest (``published``) that only groups out of the run hold
        (``version``: each group's): the trainer sends them for those groups' recovered
        requests."""
        down = self.down(tick)
        gone = {int(v) for v in version[down]}
        live = {int(v) for v in version[~down]}
        return frozenset(gone - live - {published})

    def due(self, tick: int, groups: FailingGroups) -> None:
        """Fail every group whose next failure time has come (before the tick's work), and bring
        back those whose restart is over."""
        if self.cfg is None:
            return
        now = tick * self.tick_s
        for g in np.flatnonzero((self.down_until > 0) & (self.down_until <= now)).tolist():
            self.down_until[g] = 0.0  # back: it loads the newest version from the trainer
            v = groups.load_newest(g)
            self._stale.add(g)
            self._health.append(HealthChange(g, "stale", f"loading v{v}"))
        for g in sorted(self._stale):
            if not groups.loading(g):
                self._stale.discard(g)
                self._health.append(HealthChange(g, "healthy", f"v{int(groups.version[g])} loaded"))
        for g in np.flatnonzero(self._next_failure <= now).tolist():
            self._next_failure[g] = now + self._rng.exponential(1.0 / self._rate)
            if self.down_until[g] > now:
                continue  # (already out)
            self._fail(g, now, groups)

    def _fail(self, g: int, now: float, groups: FailingGroups) -> None:
        self.failed += 1
        self._stale.discard(g)
        self._health.append(HealthChange(g, "dead", "simulated failure"))
        ids = self.requests.ids(g)
        v = int(groups.version[g])
        for p in groups.interrupt(ids) if ids else []:
            self.requests.restart(p.request_id)  # sampled again from the start
            again = PartialRequest(
                p.request_id, p.prompt_group, p.prompt_len, 0, (v,), p.payload, "prompt"
            )
            self._recovered.append(again)
        self.recovered_requests += len(ids)
        self.down_until[g] = now + self.cfg.restart_s
        groups.halt(g)

    def take_events(self) -> tuple[tuple, tuple]:
        """The requests recovered and the health changes since the last call."""
        recovered, health = tuple(self._recovered), tuple(self._health)
        self._recovered, self._health = [], []
        return recovered, health


@dataclass(frozen=True)
class Policies:
    """Tokens per second under each policy, and the failure rates behind them (per hour)."""

    no_failures: float
    recover_in_place: float
    stop_and_resume: float
    rollout_failures_per_hour: float
    job_failures_per_hour: float


def uptime(rate_per_s: float, lost_s: float) -> float:
    """The share of time a job that loses ``lost_s`` at each failure (Poisson, ``rate_per_s``)
    does useful work."""
    return 1.0 / (1.0 + rate_per_s * lost_s)


def stop_and_resume(
    cfg: FailureConfig,
    total_gpus: int,
    trainer_gpus: int,
    tokens_per_s_without: float,
    tokens_per_s_recovering: float,
) -> Policies:
    """Both policies' throughput: ``tokens_per_s_without`` (a run without failures) stopped at
    every failure of any GPU, against ``tokens_per_s_recovering`` (a run whose rollout groups
    failed and recovered in place) stopped only at the trainer's failures."""
    lost = cfg.job_restart_s + cfg.checkpoint_every_s / 2
    per_gpu = 1.0 / (cfg.gpu_mtbf_hours * HOUR)
    everything, trainer = total_gpus * per_gpu, trainer_gpus * per_gpu
    return Policies(
        no_failures=tokens_per_s_without,
        recover_in_place=tokens_per_s_recovering * uptime(trainer, lost),
        stop_and_resume=tokens_per_s_without * uptime(everything, lost),
        rollout_failures_per_hour=(total_gpus - trainer_gpus) * per_gpu * HOUR,
        job_failures_per_hour=everything * HOUR,
    )
