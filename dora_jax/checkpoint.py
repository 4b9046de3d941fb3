"""Run checkpoints with orbax ``CheckpointManager``, and exact resume.

A checkpoint (one step directory) holds four items:

- ``train_state``: the trainer's state (params, optimizer state, version, skip counter), restored
  directly into the trainer's shardings;
- ``versions``: the params of every policy version the rollout side may still need (held by a
  group, or the trainer's newest), restored into the trainer's param shardings;
- ``host``: the control plane and everything in flight, as the plain-data state of each part
  (``state_dict()``), pickled: the runtime's (window, transfer queue, rollout manager with its
  ledger, records), the backend's (request table, every engine's requests with their tokens,
  logprobs and keys, and the KV pages of running requests, so a resumed request continues
  without re-prefill, bit for bit), the prompt cursor and the trainer log;
- ``config``: the resolved config (JSON).

A checkpoint is taken between control rounds with no train step running on a worker (the wall
clock quiesces the groups first: :meth:`Runtime.quiesce`).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dora_jax.config import ConfigError, ExperimentConfig, to_dict

log = logging.getLogger(__name__)
ITEMS = ("train_state", "versions", "host", "config")
# Fields whose change makes a checkpoint unusable (shapes of params or of the KV cache).
SHAPE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "param_dtype",
)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the current config."""


def _host_state(exp) -> dict[str, Any]:
    return {
        "runtime": exp.runtime.state_dict(),
        "backend": exp.backend.state_dict(),
        "prompt_cursor": exp.source.cursor,
        "reward_errors": exp.reward.errors,
        "reward_errors_by_kind": exp.reward.error_counts(),
        "undecodable_tokens": exp.grpo.undecodable_tokens,  # a cumulative metric
        "grpo_log": [
            (s.version, jax.device_get(s.metrics), s.rewards, s.trajectories, s.reward_metrics)
            for s in exp.grpo.log
        ],
        "grpo_consumed": exp.grpo.consumed,
        "wall_s": exp.wall_s,
        "versions": sorted(exp.grpo.params),
    }


class RunCheckpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        # Only process 0 writes (it holds the trainer, and the other processes' engine snapshots
        # come to it as plain data): the other processes take no part in the saves.
        mp = ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes={0} if jax.process_count() > 1 else None
        )
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            multiprocessing_options=mp,
            create=False,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        # With several processes, arrays on process 0's devices alone are "host local" to orbax:
        # they are saved as host copies and put back into their shardings on restore.
        self.host_copies = jax.process_count() > 1
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=ITEMS)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, exp) -> int:
        """Save at a tick boundary (between ``runtime.tick()`` calls), keyed by the runtime's
        tick index; a second save at the same tick is a no-op. Returns the key."""
        step = exp.runtime.tick_index
        if step in self.steps():
            return step
        host = np.frombuffer(pickle.dumps(_host_state(exp), pickle.HIGHEST_PROTOCOL), np.uint8)
        versions = {f"v{v}": p for v, p in exp.grpo.params.items()}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                train_state=ocp.args.StandardSave(self._out(exp.trainer.state)),
                versions=ocp.args.StandardSave(self._out(versions)),
                host=ocp.args.StandardSave({"blob": host}),
                config=ocp.args.JsonSave(to_dict(exp.cfg)),
            ),
        )
        return step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_latest(self, exp) -> int:
        """Restore the newest usable checkpoint into the freshly built ``exp``; a corrupt one is
        skipped with a warning in favour of the previous. Returns the step restored."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to resume from")
        errors = []
        for step in reversed(steps):
            try:
                self._restore(exp, step)
                return step
            except ConfigError:
                raise
            except Exception as e:  # a truncated or unreadable checkpoint: try the previous
                errors.append(f"step {step}: {type(e).__name__}: {e}")
                log.warning(
                    "checkpoint %s/%d is unusable (%s); trying the previous one",
                    self.directory,
                    step,
                    e,
                )
        raise CheckpointError(f"{self.directory}: no usable checkpoint:\n  " + "\n  ".join(errors))

    def _restore(self, exp, step: int) -> None:
        meta = self.manager.restore(
            step,
            args=ocp.args.Composite(config=ocp.args.JsonRestore(), host=ocp.args.StandardRestore()),
        )
        check_compatible(meta.config, exp.cfg)
        state = pickle.loads(np.asarray(meta.host["blob"]).tobytes())
        trainer = exp.trainer
        param_target = jax.tree.map(_abstract, trainer.export_params())
        targets = {
            "train_state": jax.tree.map(_abstract, trainer.state),
            "versions": {f"v{v}": param_target for v in state["versions"]},
        }
        if self.host_copies:
            host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), targets)
            arrays = self.manager.restore(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(v) for k, v in host.items()}))  # fmt: skip
            arrays = {k: jax.device_put(getattr(arrays, k), jax.tree.map(lambda a: a.sharding, v))
                      for k, v in targets.items()}  # fmt: skip
        else:
            r = self.manager.restore(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(v) for k, v in targets.items()}))  # fmt: skip
            arrays = {"train_state": r.train_state, "versions": r.versions}
        trainer.state = arrays["train_state"]
        exp.grpo.params = {int(k[1:]): v for k, v in arrays["versions"].items()}
        _relink(exp, state)

    def _out(self, tree):
        return jax.device_get(tree) if self.host_copies else tree


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _relink(exp, state: dict[str, Any]) -> None:
    from dora_jax.pipeline.grpo import StepLog

    exp.runtime.load_state_dict(state["runtime"])  # first: a wall clock continues its timeline
    exp.backend.load_state_dict(state["backend"], exp.grpo.params_for)
    exp.source.cursor = state["prompt_cursor"]
    # checkpoints from before the failure kinds counted every failure as an exception
    kinds = state.get("reward_errors_by_kind", {"exception": state["reward_errors"]})
    for k, n in kinds.items():
        exp.reward.errors_by_kind[k] = int(n)
    exp.grpo.undecodable_tokens = state.get("undecodable_tokens", 0)  # (older checkpoints: none)
    exp.grpo.log = [StepLog(*entry) for entry in state["grpo_log"]]
    exp.grpo.consumed = state["grpo_consumed"]
    exp.wall_s = state["wall_s"]


def check_compatible(saved: dict[str, Any], cfg: ExperimentConfig) -> None:
    """A resume may change run settings, never the shapes the checkpoint holds."""
    now = to_dict(cfg)
    for name in SHAPE_FIELDS:
        if saved["model"].get(name) != now["model"].get(name):
            raise ConfigError(
                f"model.{name}",
                f"the checkpoint has {saved['model'].get(name)!r} "
                f"but the config says {now['model'].get(name)!r}",
            )
    if saved["mesh"]["rollout"]["groups"] != now["mesh"]["rollout"]["groups"]:
        raise ConfigError(
            "mesh.rollout.groups",
            f"must match the checkpoint ({saved['mesh']['rollout']['groups']})",
        )
