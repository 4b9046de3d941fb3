"""GRPO training on the trainer submesh: advantages, policy loss, chunked logprobs, batch packing,
train state and the jitted step. Never imports ``rollout`` or ``orchestrator``."""

from dora_jax.train.batch import Trajectory, pack_batch
from dora_jax.train.logprobs import token_logprobs
from dora_jax.train.state import init_state, model_params
from dora_jax.train.step import train_step_with_grads
from dora_jax.train.trainer import Trainer

__all__ = [
    "Trainer",
    "Trajectory",
    "init_state",
    "model_params",
    "pack_batch",
    "token_logprobs",
    "train_step_with_grads",
]
