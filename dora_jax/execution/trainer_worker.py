"""The trainer as one program on every process that holds devices of its mesh.

On JAX's multi-controller runtime every process that owns devices of a mesh must launch each
computation on that mesh itself, in the same order as the others, or the collectives inside it
never meet. So the trainer is driven by the trainer commands of ``commands.py`` only:
:class:`TrainerWorker` is their interpreter, the same code on every trainer process (process 0
included), and it compiles the train step itself, per batch shape, the same way on each. Process
0 holds a :class:`SpmdTrainer`: each command goes first to every other trainer process (a
``broadcast``, in order, with its host inputs: the packed batch), then runs here. The commands:

- ``StartTrainer``: build the trainer from the starting policy (the random init of the seed, or a
  Hugging Face directory every trainer process reads: ``model.hf_path`` or the warm start's cache);
- ``TrainStep``: one train step on a packed batch;
- ``ExportParams``: the new params; when the mesh spans processes, gathered onto every trainer
  device one tensor at a time, process 0 keeping its copy (on its first trainer device, or placed
  in the rollout groups' layout), which is what groups load and checkpoints save;
- ``GatherState``: the train state as host arrays on process 0, tensor by tensor (checkpoints);
- ``RestoreState``: each process reads a checkpoint's train state from the run directory (a
  filesystem every trainer host sees) and places its own shards.

The single-process trainer is the one-rank case: no broadcast, nothing gathered. A process other
than 0 whose command fails ends with a message; process 0's watchdog then stops the run naming it
(a collective would otherwise wait for it for ever).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.execution import commands as c
from dora_jax.model import abstract_params, param_axes
from dora_jax.model.hf_checkpoint import policy_params
from dora_jax.sharding import trainer_rules, tree_shardings
from dora_jax.train import Trainer


def build_trainer(cfg, mesh, source: dict, params: Any = None) -> Trainer:
    """The trainer of ``cfg`` on ``mesh`` from ``params`` (host or device arrays), else from the
    starting policy ``source`` (``{"hf": path or None}``: a Hugging Face directory, or the random
    init of ``cfg.seed``)."""
    rules = trainer_rules(cfg.mesh.trainer)
    shardings = tree_shardings(param_axes(cfg.model), abstract_params(cfg.model), rules, mesh)
    if params is None:
        params = policy_params(cfg.model, cfg.seed, shardings, (source or {}).get("hf"))
    else:
        params = jax.device_put(params, shardings)
    return Trainer(cfg.model, cfg.train, mesh=mesh, params=params, rules=rules)


_DEBUG_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def fingerprint(compiled: Any) -> str:
    """A compiled program's identity: its optimised HLO without the debug metadata (source
    locations differ between processes whose call stacks differ, not the program)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    blocks = [b for b in text.split("\n\n") if not b.startswith(_DEBUG_TABLES)]
    return hashlib.sha256("\n\n".join(blocks).encode()).hexdigest()


def _mine(x: jax.Array) -> jax.Array:
    """This process's first copy of an array replicated over a mesh that spans processes."""
    return x.addressable_shards[0].data


class TrainerWorker:
    """Carries trainer commands out on this process's devices of the trainer ``mesh``; ``lead``:
    this is process 0 (it keeps what exports and gathers return)."""

    def __init__(self, cfg, mesh, lead: bool, spans: bool, params: Any = None):
        self.cfg, self.mesh, self.lead, self.spans = cfg, mesh, lead, spans
        self.trainer: Trainer | None = None
        self._params = params  # the starting policy as arrays (one process only)
        self.export_layout: Any = None  # process 0: the rollout groups' layout of exports
        rep = NamedSharding(mesh, PartitionSpec())
        self._gather = jax.jit(lambda x: x, out_shardings=rep)  # one array onto every device
        self.applied: list[str] = []  # the commands carried out, in order
        self.fingerprints: dict[tuple[int, int, int], str] = {}  # batch shape -> executable
        self._table: dict[type, Callable[[Any], Any]] = {
            c.StartTrainer: self._start,
            c.TrainStep: self._step,
            c.ExportParams: self._export,
            c.GatherState: self._gather_state,
            c.RestoreState: self._restore,
        }

    def check(self, cmd: c.TrainerCommand) -> Callable[[Any], Any]:
        fn = self._table.get(type(cmd))
        if fn is None:
            raise ValueError(f"unknown trainer command {type(cmd).__name__}")
        return fn

    def apply(self, cmd: c.TrainerCommand) -> Any:
        fn = self.check(cmd)
        self.applied.append(type(cmd).__name__)
        return fn(cmd)

    def _start(self, cmd: c.StartTrainer) -> None:
        self.trainer = build_trainer(self.cfg, self.mesh, cmd.source, self._params)
        self._params = None

    def _step(self, cmd: c.TrainStep) -> Any:
        t = self.trainer
        if self.spans:  # every process compiles this shape itself, and runs that executable
            key = (cmd.batch.num_samples, cmd.batch.num_rows, cmd.batch.seq_len)
            if key not in self.fingerprints:
                compiled = t.compile_shape(key)
                t.adopt(key, compiled)
                self.fingerprints[key] = fingerprint(compiled)
        metrics = t.step(cmd.batch)
        return metrics if self.lead else jax.block_until_ready(metrics)

    def _leaves(self, tree: Any, take: Callable[..., Any], *rest: Any) -> Any:
        """``take`` of each leaf gathered onto every trainer device (and of the matching leaves
        of ``rest``), one leaf after the other: a device holds one whole leaf at a time."""
        return jax.tree.map(lambda x, *r: take(self._gather(x), *r), tree, *rest)

    def _export(self, cmd: c.ExportParams) -> Any:
        params = self.trainer.export_params()
        layout = self.export_layout if cmd.to_groups else None
        if not self.spans:
            return params if layout is None else jax.device_put(params, layout)
        if not self.lead:
            return self._leaves(params, jax.block_until_ready)
        if layout is None:
            return self._leaves(params, _mine)
        return self._leaves(params, lambda x, s: jax.device_put(_mine(x), s), layout)

    def _gather_state(self, cmd: c.GatherState) -> Any:
        if not self.spans:
            return jax.device_get(self.trainer.state)
        take = (lambda x: np.asarray(_mine(x))) if self.lead else jax.block_until_ready
        return self._leaves(self.trainer.state, take)

    def _restore(self, cmd: c.RestoreState) -> None:
        from dora_jax.checkpoint import read_train_state

        t = self.trainer
        t.load_host_state(read_train_state(Path(cmd.directory), cmd.step, t.state))


class SpmdTrainer:
    """Process 0's trainer: every call that computes on the trainer mesh is a command, sent to
    the other trainer processes (``broadcast``) and then run here, under one lock so two threads
    of this process (the trainer's worker, the control loop saving a checkpoint) never order
    their commands differently here and there. Host-side calls (packing a batch, the version)
    run here only."""

    def __init__(self, worker: TrainerWorker, broadcast: Callable[[Any], None] | None = None):
        self.worker, self._broadcast = worker, broadcast
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, cfg, mesh, source: dict | None = None, broadcast=None, params: Any = None
    ) -> SpmdTrainer:
        """Build the trainer on every trainer process: from ``params`` (a single process), else
        from ``source``."""
        worker = TrainerWorker(cfg, mesh, lead=True, spans=broadcast is not None, params=params)
        out = cls(worker, broadcast)
        out.run(c.StartTrainer(source))
        return out

    def run(self, cmd: c.TrainerCommand) -> Any:
        self.worker.check(cmd)  # (before the others see it)
        with self._lock:
            if self._broadcast is not None:
                self._broadcast(cmd)
            return self.worker.apply(cmd)

    @property
    def trainer(self) -> Trainer:
        return self.worker.trainer

    @property
    def spans(self) -> bool:
        return self._broadcast is not None

    # -- commands ---------------------------------------------------------------------------------
    def step(self, batch) -> Any:
        self.trainer.check_batch(batch)
        return self.run(c.TrainStep(batch))

    def export_params(self, shardings: Any = None) -> Any:
        """The params as groups load them: in the trainer's layout, or placed in ``shardings``
        (when the mesh spans processes: gathered tensor by tensor onto process 0's devices)."""
        self.worker.export_layout = shardings
        return self.run(c.ExportParams(to_groups=shardings is not None))

    def host_state(self) -> Any:
        return self.run(c.GatherState())

    def load_host_state(self, host: Any, checkpoint: tuple[Path, int] | None = None) -> None:
        """Place the train state ``host``; when the mesh spans processes every process reads its
        shards of ``checkpoint`` (directory, step) instead."""
        if not self.spans:
            self.trainer.load_host_state(host)
            return
        if checkpoint is None:
            raise ValueError("a trainer spanning processes restores from a checkpoint only")
        self.run(c.RestoreState(str(checkpoint[0]), int(checkpoint[1])))

    # -- this process only ------------------------------------------------------------------------
    @property
    def state(self) -> Any:
        return self.trainer.state

    @state.setter
    def state(self, value: Any) -> None:
        if self.spans:
            raise ValueError("a trainer spanning processes restores from a checkpoint only")
        self.trainer.state = value

    def adopt_compiled(self, compiled: Any, rows: int, seq_len: int) -> None:
        """A step compiled ahead for this trainer (one process: the memory plan's); a trainer
        spanning processes compiles on every process alike instead."""
        if not self.spans:
            self.trainer.adopt_compiled(compiled, rows, seq_len)

    def pack(self, *args, **kwargs):
        return self.trainer.pack(*args, **kwargs)

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def fallback_batches(self) -> int:
        return self.trainer.fallback_batches

    def compile_ahead(self, num_samples: int | None = None) -> None:
        self.trainer.compile_ahead(num_samples)

    @property
    def compiled_ahead(self) -> dict:
        return self.trainer.compiled_ahead

    def close(self) -> None:
        self.trainer.close()


class FollowTrainer:
    """A trainer process other than 0: process 0's commands, run in order on a thread."""

    def __init__(self, cfg, mesh):
        self.worker = TrainerWorker(cfg, mesh, lead=False, spans=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="follow-trainer")

    def handle(self, cmd: c.TrainerCommand, on_error: Callable[[BaseException], None]) -> None:
        def run() -> None:
            try:
                self.worker.apply(cmd)
            except BaseException as e:  # noqa: BLE001 - process 0 would wait for us for ever
                on_error(e)

        self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
