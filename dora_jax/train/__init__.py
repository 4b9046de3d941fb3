"""GRPO training on the trainer submesh: advantages, policy loss, chunked logprobs, batch packing,
train state and the jitted step. Never imports ``rollout`` or ``orchestrator``."""

from dora_jax.train.advantages import group_advantages
from dora_jax.train.batch import TrainBatch, Trajectory, choose_bucket, pack_batch
from dora_jax.train.logprobs import chunked_logprobs, token_logprobs
from dora_jax.train.losses import (
    Surrogate,
    aggregate,
    clipped_surrogate,
    importance_ratio,
    kl_k3,
    masked_mean,
    token_weights,
)
from dora_jax.train.state import (
    TrainState,
    init_state,
    lr_schedule,
    make_optimizer,
    model_params,
    state_shardings,
    uses_master,
)
from dora_jax.train.step import train_step, train_step_with_grads
from dora_jax.train.trainer import Trainer

__all__ = [
    "Surrogate",
    "TrainBatch",
    "TrainState",
    "Trainer",
    "Trajectory",
    "aggregate",
    "choose_bucket",
    "chunked_logprobs",
    "clipped_surrogate",
    "group_advantages",
    "importance_ratio",
    "init_state",
    "kl_k3",
    "lr_schedule",
    "make_optimizer",
    "masked_mean",
    "model_params",
    "pack_batch",
    "state_shardings",
    "token_logprobs",
    "token_weights",
    "train_step",
    "train_step_with_grads",
    "uses_master",
]
