"""Execution: the real rollout backend (engines on group submeshes) and the trainer.

``commands`` is the one vocabulary of calls to groups and to the trainer; ``group.GroupWorker``
and ``trainer_worker.TrainerWorker`` carry them out on local devices; ``transport`` moves group
commands within a process (at once on the logical clock, on a worker thread per group on the wall
clock). ``backend.EngineBackend`` implements the control plane's ``RolloutBackend`` with them;
``trainer.ThreadedTrainer`` runs train steps on their own thread; ``payloads`` holds what requests
carry through the control plane.
"""

from dora_jax.execution.backend import EngineBackend, Overheads
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.execution.trainer import ThreadedTrainer

__all__ = ["Completion", "EngineBackend", "Overheads", "PromptPayload", "ThreadedTrainer"]
