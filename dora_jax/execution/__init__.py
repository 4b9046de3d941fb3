"""Execution: the real rollout backend (engines on group submeshes) and the trainer's worker.

``backend.EngineBackend`` implements the control plane's ``RolloutBackend`` over one engine per
group, on the logical clock (every call carried out at once, one engine step per tick) or the wall
clock (a worker thread per group, ``group.ThreadGroup``); ``trainer.ThreadedTrainer`` runs train
steps on their own thread; ``payloads`` holds what requests carry through the control plane.
"""

from dora_jax.execution.backend import EngineBackend, Overheads
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.execution.trainer import ThreadedTrainer

__all__ = ["Completion", "EngineBackend", "Overheads", "PromptPayload", "ThreadedTrainer"]
