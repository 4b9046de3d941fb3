"""The ``mesh`` section: which devices hold the trainer and the rollout groups, and how each
splits them (data, expert and tensor-parallel axes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dora_jax.config.errors import check as _check
from dora_jax.config.errors import check_positive


@dataclass(frozen=True)
class TrainerMeshConfig:
    """The trainer submesh: ``devices`` is a slice ``"start:stop"`` of the global device list."""

    devices: str = "0:4"
    data: int = 2  # data-parallel axis size
    model: int = 2  # tensor-parallel axis size
    fsdp: bool = False  # also shard the embed dimension of params over the data axis
    # expert-parallel axis size (MoE experts split over it; the batch too, like data)
    expert: int = 1

    def __post_init__(self):
        check_positive(self, "data", "model", "expert")


@dataclass(frozen=True)
class RolloutMeshConfig:
    """Rollout groups cut from the device slice ``devices``, each ``tp`` devices wide.

    If the slice holds ``groups * tp`` devices, groups get disjoint devices (disaggregated). If it
    holds exactly ``tp`` devices, all groups share them (colocated: several engines per device).
    """

    devices: str = "4:8"
    groups: int = 4
    tp: int = 1
    # expert-parallel axis of each group (MoE experts split over it): a group is expert x tp
    # devices wide; KV pages stay sharded over kv heads on the tp axis only
    expert: int = 1

    def __post_init__(self):
        check_positive(self, "groups", "tp", "expert")

    @property
    def group_size(self) -> int:
        """Devices per rollout group."""
        return self.expert * self.tp


@dataclass(frozen=True)
class MeshConfig:
    trainer: TrainerMeshConfig = field(default_factory=TrainerMeshConfig)
    rollout: RolloutMeshConfig = field(default_factory=RolloutMeshConfig)
    # Memory of one device for the memory plan (pipeline/memory_plan.py). None: what the device
    # reports (GPU/TPU); each of n CPU devices gets 1/n of the host's available memory.
    device_memory_gib: float | None = None
    # The share of that memory the plan may fill (the rest: framework overhead, fragmentation,
    # what the plan does not count); a config over it is refused before anything runs.
    memory_utilization: float = 0.9

    def __post_init__(self):
        _check(
            self.device_memory_gib is None or self.device_memory_gib > 0,
            "device_memory_gib",
            f"must be > 0 or null, got {self.device_memory_gib}",
        )
        _check(
            0 < self.memory_utilization <= 1,
            "memory_utilization",
            f"must be in (0, 1], got {self.memory_utilization}",
        )
