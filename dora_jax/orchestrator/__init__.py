"""The DORA control plane: groups, versions and requests, never arrays.

``backend.RolloutBackend`` is the seam to execution (fake, simulator, real engines);
``runtime.Runtime`` is the loop that runs a mode object of ``modes.py`` over it; ``planner.plan``
is the pure load-balancing planner; ``records.Records`` holds what every group did every tick.
"""

from dora_jax.orchestrator.backend import (
    TRAINER,
    BackendError,
    FinishedRequest,
    GroupInfo,
    GroupTick,
    PartialRequest,
    RequestSpec,
    RolloutBackend,
    StepEvents,
)
from dora_jax.orchestrator.fake_backend import FakeBackend, FakeBackendConfig
from dora_jax.orchestrator.fake_trainer import FakeRun, FakeTrainer, run_fake
from dora_jax.orchestrator.modes import MODES, Mode, mode_for, register_mode
from dora_jax.orchestrator.planner import (
    Migration,
    Plan,
    PlanPolicy,
    Snapshot,
    WeightTransfer,
    allocate,
    plan,
    plan_trigger,
)
from dora_jax.orchestrator.records import Records, Summary
from dora_jax.orchestrator.rollout_manager import PromptSpec, RolloutManager, SyntheticPrompts
from dora_jax.orchestrator.runtime import LogicalTrainer, RunResult, Runtime, StallError
from dora_jax.orchestrator.transfer_queue import ReadyGroup, TransferQueue
from dora_jax.orchestrator.versions import VersionWindow, WindowError

__all__ = [
    "MODES",
    "TRAINER",
    "BackendError",
    "FakeBackend",
    "FakeBackendConfig",
    "FakeRun",
    "FakeTrainer",
    "FinishedRequest",
    "GroupInfo",
    "GroupTick",
    "Migration",
    "Mode",
    "PartialRequest",
    "Plan",
    "PlanPolicy",
    "PromptSpec",
    "ReadyGroup",
    "Records",
    "RequestSpec",
    "RolloutBackend",
    "RolloutManager",
    "RunResult",
    "Runtime",
    "Snapshot",
    "StallError",
    "StepEvents",
    "Summary",
    "SyntheticPrompts",
    "LogicalTrainer",
    "TransferQueue",
    "VersionWindow",
    "WeightTransfer",
    "WindowError",
    "allocate",
    "plan",
    "plan_trigger",
    "mode_for",
    "register_mode",
    "run_fake",
]
