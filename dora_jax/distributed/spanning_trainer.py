"""A trainer mesh that spans processes: process 0 leads, the other processes holding trainer devices
follow in lock-step.

On JAX's multi-controller runtime every process that owns devices of a mesh must launch each
computation on that mesh itself, in the same order as the others, or the collectives inside it
never meet. Process 0 runs the control plane and decides when the trainer steps; before each
computation on the trainer mesh, :class:`LeadTrainer` sends the same call, with its host inputs
(the packed batch), to every follower over the ordered channel, then runs it itself.
:class:`FollowTrainer` replays the calls on a thread of its own, in order. The calls:

- ``init``: build the trainer from the starting policy (the random init of the seed, or a Hugging
  Face directory every trainer process reads: ``model.hf_path`` or the warm start's cache);
- ``step``: one train step on a packed batch;
- ``export``: the new params gathered onto every trainer device, one tensor at a time; process 0
  keeps the copy on its own first trainer device, which is what rollout groups load and
  checkpoints save;
- ``gather``: the train state gathered likewise, tensor by tensor into process 0's host memory,
  for its checkpoint;
- ``restore``: each process reads a checkpoint's train state from the run directory (a
  filesystem every trainer host sees) and places its own shards.

A follower whose call fails ends its process with a message; process 0's watchdog then stops the
run naming it (a collective would otherwise wait for it for ever).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.model import abstract_params, param_axes
from dora_jax.model.hf_checkpoint import policy_params
from dora_jax.model.params import Params
from dora_jax.sharding import trainer_rules, tree_shardings
from dora_jax.train import TrainBatch, Trainer


def build_trainer(cfg, mesh, source: dict) -> Trainer:
    """The trainer of ``cfg`` on ``mesh`` from the starting policy ``source`` (``{"hf": path or
    None}``: a Hugging Face directory, or the random init of ``cfg.seed``). Every trainer process
    calls it at the same point."""
    rules = trainer_rules(cfg.mesh.trainer)
    shardings = tree_shardings(param_axes(cfg.model), abstract_params(cfg.model), rules, mesh)
    params = policy_params(cfg.model, cfg.seed, shardings, source.get("hf"))
    return Trainer(cfg.model, cfg.train, mesh=mesh, params=params, rules=rules)


def _gather(mesh) -> Callable[[Any], Any]:
    """A jitted copy of one array onto every device of ``mesh`` (an all-gather)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def gather_leaves(gather: Callable[[Any], Any], tree: Any, take: Callable[..., Any],
                  *rest: Any) -> Any:  # fmt: skip
    """``take`` of each leaf of ``tree`` gathered onto every trainer device (and of the matching
    leaves of the trees ``rest``), one leaf after the other, so a device holds one whole leaf at
    a time, not the whole tree. The lead and the followers walk the same tree in the same
    order."""
    return jax.tree.map(lambda x, *r: take(gather(x), *r), tree, *rest)


def batch_message(batch: TrainBatch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None}  # fmt: skip


def _mine(x: jax.Array) -> jax.Array:
    """This process's first copy of an array replicated over a mesh that spans processes: an
    array on one of its own devices."""
    return x.addressable_shards[0].data


class LeadTrainer:
    """Process 0's trainer when the trainer mesh spans processes. It has the calls of
    :class:`~dora_jax.train.Trainer` that the run uses; those that compute on the trainer mesh are
    sent to the followers first."""

    def __init__(self, trainer: Trainer, send: Callable[[dict], None]):
        self.trainer, self._send = trainer, send
        self._gather = _gather(trainer.mesh)
        # a call is sent and dispatched under this lock: two threads of this process (the
        # trainer's worker, the control loop saving a checkpoint) never interleave their calls
        # differently here and on the followers
        self._lock = threading.Lock()

    @classmethod
    def start(cls, cfg, mesh, source: dict, send: Callable[[dict], None]) -> LeadTrainer:
        """Have the followers build their part of the trainer, and build process 0's."""
        send({"do": "init", "source": source})
        return cls(build_trainer(cfg, mesh, source), send)

    def __getattr__(self, name: str) -> Any:  # state, pack, version, adopt_compiled, mesh...
        return getattr(self.trainer, name)

    def step(self, batch: TrainBatch) -> Any:
        self.trainer.check_batch(batch)
        with self._lock:
            self._send({"do": "step", "batch": batch_message(batch)})
            return self.trainer.step(batch)

    def export_params(self, shardings: Params | None = None) -> Params:
        """The params gathered from every process onto process 0: whole on its first trainer
        device, or placed tensor by tensor in ``shardings`` (e.g. the rollout groups' layout on
        process 0's devices: then no device of process 0 ever holds more than one whole tensor
        beyond its share)."""
        with self._lock:
            self._send({"do": "export"})
            params = self.trainer.export_params()
            if shardings is None:
                return gather_leaves(self._gather, params, _mine)
            place = lambda x, s: jax.device_put(_mine(x), s)  # noqa: E731
            return gather_leaves(self._gather, params, place, shardings)

    def host_state(self) -> Any:
        """The whole train state as host arrays on process 0 (gathered from every process)."""
        with self._lock:
            self._send({"do": "gather"})
            return gather_leaves(self._gather, self.trainer.state, lambda x: np.asarray(_mine(x)))

    def load_host_state(self, host: Any, checkpoint: tuple[Path, int] | None = None) -> None:
        """Place the train state ``host``, read from ``checkpoint`` (directory, step): the
        followers read the same checkpoint and place their shards."""
        if checkpoint is None:
            raise ValueError("a trainer spanning processes restores from a checkpoint only")
        directory, step = checkpoint
        with self._lock:
            self._send({"do": "restore", "directory": str(directory), "step": int(step)})
            self.trainer.load_host_state(host)


class FollowTrainer:
    """A follower's part of the trainer: the lead's calls, replayed in order on one thread."""

    def __init__(self, cfg, mesh, index: int):
        self.cfg, self.mesh, self.index = cfg, mesh, index
        self.trainer: Trainer | None = None
        self._gather = _gather(mesh)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="follow-trainer")

    def handle(self, msg: dict) -> None:
        self._pool.submit(self._run, msg)

    def _run(self, msg: dict) -> None:
        try:
            self._apply(msg)
        except BaseException as e:  # noqa: BLE001 - the lead would wait for us for ever
            traceback.print_exc()
            print(f"error: process {self.index}: the trainer's {msg.get('do')!r} call failed "
                  f"({type(e).__name__}: {e}); this process stops", file=sys.stderr,
                  flush=True)  # fmt: skip
            os._exit(3)

    def _apply(self, msg: dict) -> None:
        do = msg["do"]
        if do == "init":
            self.trainer = build_trainer(self.cfg, self.mesh, msg["source"])
            return
        t = self.trainer
        if do == "step":
            jax.block_until_ready(t.step(TrainBatch(**msg["batch"])))
        elif do == "export":
            gather_leaves(self._gather, t.export_params(), jax.block_until_ready)
        elif do == "gather":
            gather_leaves(self._gather, t.state, jax.block_until_ready)
        elif do == "restore":
            from dora_jax.checkpoint import read_train_state

            t.load_host_state(read_train_state(Path(msg["directory"]), msg["step"], t.state))
        else:
            raise ValueError(f"unknown trainer call {do!r}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
