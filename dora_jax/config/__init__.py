"""Experiment configuration: typed frozen dataclasses, YAML presets, dotted overrides."""

from dora_jax.config.loading import dump_yaml, from_dict, load_config, to_dict
from dora_jax.config.schema import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ExperimentConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OrchestratorConfig,
    RolloutConfig,
    RolloutMeshConfig,
    RopeScalingConfig,
    TrainConfig,
    TrainerMeshConfig,
    WarmStartConfig,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "ExperimentConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OrchestratorConfig",
    "RolloutConfig",
    "RolloutMeshConfig",
    "RopeScalingConfig",
    "TrainConfig",
    "TrainerMeshConfig",
    "WarmStartConfig",
    "EvalConfig",
    "dump_yaml",
    "from_dict",
    "load_config",
    "to_dict",
]
