"""The train state (an immutable pytree) and the optimizer built from :class:`TrainConfig`.

``TrainState.params`` is the copy the optimizer updates:

- with ``train.fp32_master_weights`` and a non-float32 ``model.param_dtype``, a float32 *master*
  copy; the forward pass casts it to the model's param dtype (:func:`model_params`), the gradient
  flows back to float32, and the optimizer state is float32 too;
- otherwise the params in ``model.param_dtype`` themselves (the flag is moot for float32 params).

``version`` counts optimizer steps applied (the trainer's policy version); ``skipped`` counts
steps rejected by the non-finite guard (they change nothing else). The model and train configs
are static (non-pytree) fields, so the module-level step function needs nothing but the state.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import ModelConfig, TrainConfig
from dora_jax.model.params import Params, abstract_params, dtype_of, param_axes
from dora_jax.sharding import Rules, tree_shardings

NO_DECAY = ("attn_norm", "mlp_norm", "final_norm", "bq", "bk", "bv")


@flax.struct.dataclass
class TrainState:
    params: Params  # optimizer copy: float32 master weights, or the model-dtype params
    opt_state: Any  # optax state of ``make_optimizer(train_cfg)``
    ref_params: Params | None  # frozen reference policy for the KL penalty (kl_beta > 0)
    version: jax.Array  # int32[]: optimizer steps applied
    skipped: jax.Array  # int32[]: steps skipped because the loss or gradient was not finite
    model_cfg: ModelConfig = flax.struct.field(pytree_node=False)
    train_cfg: TrainConfig = flax.struct.field(pytree_node=False)


def uses_master(model_cfg: ModelConfig, train_cfg: TrainConfig) -> bool:
    """True when the state keeps a float32 master copy of lower-precision params."""
    return train_cfg.fp32_master_weights and model_cfg.param_dtype != "float32"


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Learning rate at optimizer step ``n`` (0-based): linear warmup ``lr * (n + 1) / W`` for
    ``n < W = warmup_steps``, then ``constant`` or a cosine decay to 0 at ``total_steps``; times
    ``factor`` over ``lr_boost = (first, steps, factor)``'s steps."""
    W, total = cfg.warmup_steps, cfg.total_steps

    def boost(n: jax.Array) -> jax.Array | float:
        if not cfg.lr_boost:
            return 1.0
        first, steps, factor = cfg.lr_boost
        return jnp.where((n >= first) & (n < first + steps), factor, 1.0)

    def schedule(count: jax.Array) -> jax.Array:
        n = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (n + 1.0) / W) if W > 0 else 1.0
        if cfg.schedule == "constant":
            return cfg.lr * warm * boost(n)
        progress = jnp.clip((n - W) / max(total - W, 1), 0.0, 1.0)
        return cfg.lr * warm * boost(n) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))

    return schedule


def _decay_mask(params: Params) -> Any:
    """Weight decay on matrices only: not on norms or biases."""

    def keep(path: tuple[Any, ...], _: Any) -> bool:
        return getattr(path[-1], "key", None) not in NO_DECAY

    return jax.tree_util.tree_map_with_path(keep, params)


def _moments_in(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """``inner`` with its per-parameter state and its arithmetic in ``dtype``, whatever the
    params' dtype: gradients are cast to ``dtype`` on the way in, and the state is created from
    params cast to ``dtype`` (optax's Adam makes its second moment in the params' dtype). The
    updates come out in ``dtype``; ``optax.apply_updates`` casts the sum back to each param's."""

    def init(params: Any) -> Any:
        return inner.init(jax.tree.map(lambda p: p.astype(dtype), params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return inner.update(jax.tree.map(lambda u: u.astype(dtype), updates), state, params)

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (decoupled weight decay, masked to matrices) on the
    :func:`lr_schedule`, all in ``train.adam_moment_dtype`` (float32 by default, also for
    bfloat16 params without master weights). Pure and deterministic, so the step rebuilds it
    from the config."""
    dtype = dtype_of(cfg.adam_moment_dtype)
    chain = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(
            lr_schedule(cfg),
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            mu_dtype=dtype,
            mask=_decay_mask,
        ),
    )
    return _moments_in(chain, dtype)


def model_params(state: TrainState) -> Params:
    """The params in ``model.param_dtype`` (a cast of the master copy when there is one)."""
    dtype = dtype_of(state.model_cfg.param_dtype)
    return jax.tree.map(lambda w: w.astype(dtype), state.params)


def init_state(params: Params, model_cfg: ModelConfig, train_cfg: TrainConfig) -> TrainState:
    """A fresh state (version 0) from model-dtype ``params``; jit it with ``out_shardings`` to
    build it in place on a mesh. The KL reference policy is a copy of ``params``."""
    opt_params = params
    if uses_master(model_cfg, train_cfg):
        opt_params = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    ref = jax.tree.map(jnp.copy, params) if train_cfg.kl_beta > 0 else None
    return TrainState(
        params=opt_params,
        opt_state=make_optimizer(train_cfg).init(opt_params),
        ref_params=ref,
        version=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        model_cfg=model_cfg,
        train_cfg=train_cfg,
    )


def state_shardings(
    model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, rules: Rules
) -> TrainState:
    """A :class:`TrainState` whose leaves are ``NamedSharding``s: params (and the optimizer's
    per-param moments, and the reference params) sharded by their logical axes, scalars
    replicated."""
    abstract = abstract_params(model_cfg)
    p_sh = tree_shardings(param_axes(model_cfg), abstract, rules, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    tx = make_optimizer(train_cfg)
    abstract_opt = jax.eval_shape(tx.init, abstract)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, p_sh, transform_non_params=lambda _: replicated
    )
    return TrainState(
        params=p_sh,
        opt_state=opt_sh,
        ref_params=p_sh if train_cfg.kl_beta > 0 else None,
        version=replicated,
        skipped=replicated,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
    )
