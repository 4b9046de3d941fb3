"""Cluster simulator: the DORA control plane driving simulated rollout groups.

Never imports jax. ``backend.SimBackend`` implements the
:class:`~dora_jax.orchestrator.backend.RolloutBackend` interface with step times from
``cost_model.CostModel`` (hardware presets in ``hardware``, model presets in ``models``);
``trainer.SimTrainer`` steps in modeled time; ``workload`` draws response and prompt lengths;
``conversations`` the turns, observations and tool latencies of multi-turn conversations;
``config.SimConfig`` is the typed YAML config; ``run.simulate`` runs one mode; ``report`` makes
the table, JSON and timeline plots. See ``docs/simulator.md``.
"""

from dora_jax.sim.backend import CATEGORIES, SimBackend
from dora_jax.sim.config import SimConfig, load_sim_config
from dora_jax.sim.conversations import Conversations
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import HARDWARE, Hardware, get_hardware
from dora_jax.sim.models import MODELS, ModelSpec, get_model
from dora_jax.sim.run import SimMetrics, SimRun, build, cost_model, metrics, simulate
from dora_jax.sim.trainer import SimTrainer
from dora_jax.sim.workload import ResponseLengths, SimPrompts, workload_stats

__all__ = [
    "CATEGORIES",
    "HARDWARE",
    "MODELS",
    "Conversations",
    "CostModel",
    "Hardware",
    "ModelSpec",
    "ResponseLengths",
    "SimBackend",
    "SimConfig",
    "SimMetrics",
    "SimPrompts",
    "SimRun",
    "SimTrainer",
    "build",
    "cost_model",
    "get_hardware",
    "get_model",
    "load_sim_config",
    "metrics",
    "simulate",
    "workload_stats",
]
