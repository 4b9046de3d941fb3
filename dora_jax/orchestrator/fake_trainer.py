"""A trainer stand-in whose step takes a configurable number of ticks, and a one-call fake run."""

from __future__ import annotations

from dataclasses import dataclass

from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator.fake_backend import FakeBackend, FakeBackendConfig
from dora_jax.orchestrator.rollout_manager import SyntheticPrompts
from dora_jax.orchestrator.runtime import RunResult, Runtime
from dora_jax.orchestrator.staleness import DriftModel, lag_tokens_of
from dora_jax.orchestrator.transfer_queue import ReadyGroup


class FakeTrainer:
    """Counts versions and remembers every batch; a step lasts ``step_ticks`` plus
    ``ticks_per_ktoken`` per thousand response tokens in the batch. With ``drift`` it reports
    each step's drift signal as that model says (:meth:`drift`, read by ``staleness_k: auto``)."""

    def __init__(
        self,
        step_ticks: int = 8,
        ticks_per_ktoken: float = 0.0,
        version: int = 0,
        drift: DriftModel | None = None,
    ):
        if step_ticks < 1 or ticks_per_ktoken < 0:
            raise ValueError("need step_ticks >= 1 and ticks_per_ktoken >= 0")
        self.step_ticks = step_ticks
        self.ticks_per_ktoken = ticks_per_ktoken
        self.version = version
        self.batches: list[tuple[int, tuple[int, ...]]] = []  # (version, request ids)
        self.drift_model = drift
        self._drift: tuple[list[int], list[float]] | None = None

    def step(self, batch: list[ReadyGroup]) -> int:
        ids = tuple(t.request_id for rg in batch for t in rg.trajectories)
        self.batches.append((self.version, ids))
        if self.drift_model is not None:
            lags = lag_tokens_of(batch, self.version)
            self._drift = self.drift_model.signal(len(self.batches) - 1, lags)
        self.version += 1
        return self.version

    def drift(self) -> tuple[list[int], list[float]] | None:
        """The last step's response tokens and ESS per lag (None without a drift model)."""
        return self._drift

    def duration_ticks(self, batch: list[ReadyGroup]) -> int:
        tokens = sum(rg.response_tokens for rg in batch)
        return self.step_ticks + int(self.ticks_per_ktoken * tokens / 1000)


@dataclass(frozen=True)
class FakeRun:
    result: RunResult
    runtime: Runtime
    trainer: FakeTrainer
    backend: FakeBackend


def run_fake(
    cfg: OrchestratorConfig,
    group_size: int,
    backend_cfg: FakeBackendConfig,
    *,
    num_steps: int,
    step_ticks: int = 8,
    prompt_len: tuple[int, int] = (16, 128),
    drain: bool = False,
    max_ticks: int = 1_000_000,
    trainer: FakeTrainer | None = None,
) -> FakeRun:
    """Run ``cfg.mode`` on the fake backend with a fake trainer (``trainer``, default one of
    ``step_ticks``) for ``num_steps`` steps."""
    backend = FakeBackend(backend_cfg)
    trainer = trainer or FakeTrainer(step_ticks)
    prompts = SyntheticPrompts(backend_cfg.seed, *prompt_len)
    runtime = Runtime(cfg, group_size, backend, trainer, prompts)
    result = runtime.run(num_steps, drain=drain, max_ticks=max_ticks)
    return FakeRun(result, runtime, trainer, backend)
