"""A simulated trainer: a train step lasts what the cost model says for its batch.

Duration: :meth:`~dora_jax.sim.cost_model.CostModel.train_step_s` over the batch's sequences
(prompt + response tokens of every trajectory) on ``devices`` devices, experience preparation
included, rounded up to whole ticks. With colocated placement (``colocated_with``) the rollout
groups are frozen for the step's ticks: the devices are training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dora_jax.orchestrator.staleness import DriftModel, lag_tokens_of
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.sim.backend import SimBackend
from dora_jax.sim.cost_model import CostModel


@dataclass(frozen=True)
class TrainStep:
    version: int  # the version the step produced
    tick: int  # the tick it started
    seconds: float  # modeled duration (before rounding to ticks)
    ticks: int
    trajectories: int
    tokens: int  # prompt + response tokens trained on


class SimTrainer:
    """Implements the runtime's ``Trainer`` protocol with modeled durations."""

    def __init__(
        self,
        cost: CostModel,
        devices: int,
        tick_s: float,
        *,
        clock: SimBackend,
        colocated_with: SimBackend | None = None,
        drift: DriftModel | None = None,
    ):
        if devices < 1 or tick_s <= 0:
            raise ValueError("need devices >= 1 and tick_s > 0")
        self.cost, self.devices, self.tick_s = cost, devices, tick_s
        self.clock, self.colocated_with = clock, colocated_with
        self.version = 0
        self.steps: list[TrainStep] = []
        self.batches: list[tuple[int, tuple[int, ...]]] = []  # (version, request ids) per step
        self._pending: tuple[int, int] | None = None  # (id of the batch, ticks)
        self.drift_model = drift or DriftModel()
        self._drift: tuple[list[int], list[float]] | None = None

    def _measure(self, batch: list[ReadyGroup]) -> tuple[float, int, int, int]:
        lens = np.array([t.prompt_len + t.response_len for rg in batch for t in rg.trajectories])
        seconds = self.cost.train_step_s(lens, self.devices)
        ticks = max(1, math.ceil(seconds / self.tick_s - 1e-9))
        return seconds, ticks, len(lens), int(lens.sum())

    def step(self, batch: list[ReadyGroup]) -> int:
        seconds, ticks, n, tokens = self._measure(batch)
        tick = self.clock.tick
        ids = tuple(t.request_id for rg in batch for t in rg.trajectories)
        self.batches.append((self.version, ids))
        lags = lag_tokens_of(batch, self.version)
        self._drift = self.drift_model.signal(len(self.steps), lags)
        self.version += 1
        self.steps.append(TrainStep(self.version, tick, seconds, ticks, n, tokens))
        self._pending = (id(batch), ticks)
        if self.colocated_with is not None:
            self.colocated_with.freeze(tick + ticks)
        return self.version

    def drift(self) -> tuple[list[int], list[float]] | None:
        """The last step's modeled tokens and ESS per lag (``staleness_k: auto`` reads it)."""
        return self._drift

    def duration_ticks(self, batch: list[ReadyGroup]) -> int:
        if self._pending is not None and self._pending[0] == id(batch):
            return self._pending[1]
        return self._measure(batch)[1]
