"""The :class:`Trainer`: it owns the train state and the jitted step of :mod:`dora_jax.train.step`
(compiled once per batch shape: in line, adopted, or ahead on a worker thread), packs batches for
it and exports params for the rollout groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import ModelConfig, TrainConfig
from dora_jax.model.params import Params, init_params
from dora_jax.sharding import Rules, use_rules
from dora_jax.train import step as steps
from dora_jax.train.batch import NoShapeFits, TrainBatch, chunked_shape, pack_batch
from dora_jax.train.compile_ahead import ShapeCompiler
from dora_jax.train.state import TrainState, init_state, model_params, state_shardings


class Trainer:
    """Owns the train state and the jitted step (compiled once per length bucket).

    With a ``mesh`` (axes ``("data", "model")``) the params, optimizer moments and reference
    params are sharded by their logical axes under ``rules`` (default :func:`trainer_rules`),
    batch token arrays are sharded over ``data`` (per-sample arrays replicated) and the step is
    jitted with these in/out shardings and the state donated. Without a mesh it runs on the
    default device.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        params: Params | None = None,
        key: jax.Array | None = None,
    ):
        self.model_cfg, self.train_cfg, self.mesh = model_cfg, train_cfg, mesh
        self.traces = 0  # how often the step was traced (a recompilation check for tests)
        # (samples, rows, seq_len) -> a compiled step: adopted, or compiled ahead
        self._aot: dict[tuple[int, int, int], Any] = {}
        self._inline: set[tuple[int, int, int]] = set()  # shapes the jitted step compiled
        self._ahead: ShapeCompiler | None = None
        self.fallback_batches = 0  # batches run in a bigger shape while theirs compiled
        self._export = jax.jit(lambda s: jax.tree.map(jnp.copy, model_params(s)))
        if params is None:
            params = init_params(model_cfg, key if key is not None else jax.random.key(0))

        def make_state(p: Params) -> TrainState:
            return init_state(p, model_cfg, train_cfg)

        if mesh is not None and rules is None:
            rules = steps.default_rules(mesh)
        self.rules = rules
        self._batch_sh: Any = None
        init_jit, step_jit = {}, {}  # on a mesh: the shardings
        if mesh is not None:
            st_sh = state_shardings(model_cfg, train_cfg, mesh, rules)
            self._batch_sh = steps.batch_shardings(mesh, rules, model_cfg, train_cfg)
            rep = NamedSharding(mesh, PartitionSpec())
            init_jit = {"out_shardings": st_sh}
            step_jit = {"in_shardings": (st_sh, self._batch_sh), "out_shardings": (st_sh, rep)}
        self._init = jax.jit(make_state, **init_jit)
        self.state = self._init(params)
        self._step = jax.jit(self._traced_step, donate_argnums=0, **step_jit)

    def adopt_compiled(self, compiled: Any, rows: int, seq_len: int) -> None:
        """Run batches of ``rows x seq_len`` with ``compiled``: :func:`lower_train_step` for this
        trainer's configs, mesh and rules, compiled (e.g. by the memory plan), so the step is not
        compiled twice."""
        if self.mesh is None:
            raise ValueError("only a trainer on a mesh can adopt a compiled step")
        samples = compiled.args_info[0][1].rewards.shape[0]  # the batch's sample count
        self.adopt((samples, rows, seq_len), compiled)

    def compile_ahead(self, num_samples: int | None = None) -> None:
        """From now on compile new batch shapes on a worker thread and run a batch whose shape
        is not compiled yet in the smallest compiled shape that holds it
        (:mod:`dora_jax.train.compile_ahead`; for the wall clock: which shape a batch gets
        depends on timing). Only packed batches without a fixed row count change shape. Under
        ``train.microbatch_tokens`` with ``num_samples`` given, every bucket's shape is queued
        now (they are known in advance: one per bucket)."""
        if self._ahead is not None:
            return
        self._ahead = ShapeCompiler(self.compile_shape)
        if num_samples is not None and self.train_cfg.microbatch_tokens:
            for T in reversed(self.train_cfg.length_buckets):
                key = (
                    num_samples,
                    chunked_shape(self.train_cfg, T, self.row_multiple, num_samples)[0],
                    T,
                )
                if key not in self._aot:
                    self._ahead.request(key)

    def compile_shape(self, key: tuple[int, int, int]) -> Any:
        """The step for batches of ``key`` = (samples, rows, seq_len), compiled from abstract
        values (the same lowering on every process of a mesh that spans several)."""
        state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state
        )
        mult = 1 if self.mesh is None else steps.data_multiple(self.mesh)
        batch = steps.abstract_batch(self.model_cfg, self.train_cfg, *key, mult)
        if self._batch_sh is not None:
            batch = jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                batch,
                self._batch_sh,
            )
        return self._step.lower(state, batch).compile()

    def adopt(self, key: tuple[int, int, int], compiled: Any) -> None:
        """Run batches of shape ``key`` with ``compiled``."""
        self._aot[key] = compiled

    def close(self) -> None:
        """Stop compiling ahead (a compilation under way finishes on its own)."""
        if self._ahead is not None:
            self._ahead.close()

    @property
    def compiled_ahead(self) -> dict[tuple[int, int, int], float]:
        """The shapes compiled on the worker thread so far, with each compilation's seconds."""
        return {} if self._ahead is None else dict(self._ahead.seconds)

    def _compiled_shapes(self) -> set[tuple[int, int, int]]:
        ahead = self._ahead.ready() if self._ahead is not None else {}
        return set(self._aot) | set(ahead) | self._inline

    def reset(self, params: Params) -> None:
        """Start over from model-dtype ``params``: version 0, fresh optimizer state (the
        compiled step is kept)."""
        self.state = self._init(params)

    def _traced_step(
        self, state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, steps.Metrics]:
        self.traces += 1
        if self.mesh is None:
            return steps.train_step(state, batch)
        with use_rules(self.mesh, self.rules):
            return steps.train_step(state, batch)

    @property
    def num_compiles(self) -> int:
        """Entries in the jitted step's cache (one per batch shape seen)."""
        return self._step._cache_size()

    @property
    def version(self) -> int:
        """Optimizer steps applied so far (blocks on the device)."""
        return int(self.state.version)

    def pack(
        self,
        trajectories: Sequence[Any],
        *,
        num_groups: int | None = None,
        version: int | None = None,
        allow_nonfinite_logprobs: bool = False,
    ) -> TrainBatch:
        """:func:`pack_batch` against ``version`` (default the optimizer's version; a caller
        that counts skipped steps as versions passes its own), checking the row count."""

        def pack(shapes=None) -> TrainBatch:
            return pack_batch(
                trajectories,
                self.train_cfg,
                allow_nonfinite_logprobs=allow_nonfinite_logprobs,
                trainer_version=self.version if version is None else version,
                num_groups=num_groups,
                row_multiple=self.row_multiple,
                vocab_size=self.model_cfg.vocab_size,
                routes_shape=steps.routes_shape(self.model_cfg),
                shapes=shapes,
            )

        batch = pack()
        key = _shape_key(batch)
        cfg = self.train_cfg
        if (
            self._ahead is not None
            and cfg.packing == "tokens"
            and not cfg.pack_rows
            and key not in self._compiled_shapes()
        ):
            self._ahead.request(key)
            ready = [(B, T) for S, B, T in self._compiled_shapes() if S == key[0]]
            try:
                batch = pack(ready)  # the best compiled shape, while this one compiles
                self.fallback_batches += 1
            except NoShapeFits:  # none holds it: the step waits for its compilation
                pass
        self.check_batch(batch)
        return batch

    @property
    def row_multiple(self) -> int:
        """A batch's row count is a multiple of this: microbatches x data (x expert)."""
        data = 1 if self.mesh is None else steps.data_multiple(self.mesh)
        return self.train_cfg.microbatches * data

    def check_batch(self, batch: TrainBatch) -> None:
        """``ValueError`` unless the rows split into microbatches spread over ``data``."""
        mult = self.row_multiple
        if batch.num_rows % mult:
            raise ValueError(
                f"{batch.num_rows} batch rows must be a multiple of microbatches x data (x expert) "
                f"= {mult}; set train.pack_rows or the number of prompt groups accordingly"
            )

    def step(self, batch: TrainBatch) -> steps.Metrics:
        """Apply one step; returns the metrics as device arrays (not yet synced)."""
        self.check_batch(batch)
        if self._batch_sh is not None:
            batch = jax.device_put(batch, self._batch_sh)
        key = _shape_key(batch)
        step = self._aot.get(key)
        if step is None and self._ahead is not None:
            step = self._ahead.get(key)  # waits if it is compiling
        if step is None:
            step = self._step
            self._inline.add(key)
        self.state, metrics = step(self.state, batch)
        return metrics

    def host_state(self) -> TrainState:
        """The train state as host arrays (what a multi-process run's checkpoint saves)."""
        return jax.device_get(self.state)

    def load_host_state(self, host: Any, checkpoint: tuple[Any, int] | None = None) -> None:
        """Place ``host`` (host arrays shaped like the state) in the state's shardings.
        ``checkpoint`` (directory, step) says where it was read (for a trainer whose other
        processes read their own shards there)."""
        self.state = jax.device_put(host, jax.tree.map(lambda a: a.sharding, self.state))

    def export_params(self, shardings: Params | None = None) -> Params:
        """A fresh copy of the params in ``model.param_dtype`` (the state's own buffers are
        donated to the next step), e.g. for a weight transfer to rollout groups; placed in
        ``shardings`` when given (default: the trainer's)."""
        out = self._export(self.state)
        return out if shardings is None else jax.device_put(out, shardings)


def _shape_key(batch: TrainBatch) -> tuple[int, int, int]:
    return batch.num_samples, batch.num_rows, batch.seq_len
