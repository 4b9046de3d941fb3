"""Logical axis names -> mesh axes, one rule set per role (trainer, rollout group).

Model code names axes logically (``("batch", "seq", "embed")``); only this module knows how a role
lays them on its mesh. A dimension whose size does not divide by its mesh axes is replicated
instead (so a tiny test model still runs on a wide mesh); :func:`spec_for` reports that choice
through ``dropped``, and :func:`tree_shardings` warns (:class:`ShardingWarning`) naming the
parameter and the mesh axis, since a replicated weight costs the memory of an unsharded one.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import TrainerMeshConfig

Rules = Mapping[str, str | tuple[str, ...] | None]
LogicalAxes = tuple[str | None, ...]


def _rules(batch: str | tuple[str, ...] | None, embed: str | None, *replicated: str) -> dict:
    """Both roles: heads/ffn/vocab over ``model`` (TP), MoE experts over ``expert``, sequence,
    head_dim, layers, norms and ``replicated`` replicated."""
    return {
        "batch": batch,
        "embed": embed,
        "experts": "expert",
        **dict.fromkeys(("vocab", "q_heads", "kv_heads", "mlp"), "model"),
        **dict.fromkeys(("seq", "head_dim", "layers", "norm", *replicated), None),
    }


def trainer_rules(cfg: TrainerMeshConfig) -> dict[str, str | tuple[str, ...] | None]:
    """Trainer mesh ``("data", "expert", "model")``: batch over data (and expert); with ``fsdp``
    the params' embed dimension is also sharded over data. The expert axis carries the batch too,
    so outside the MoE blocks its devices are data parallel."""
    return _rules(("data", "expert"), "data" if cfg.fsdp else None)


def rollout_rules() -> dict[str, str | None]:
    """Rollout group mesh ``("data", "expert", "model")`` with data = 1 (the rest is replicated
    over it). KV pages shard over kv heads, so every group must use the same layout for peer
    moves."""
    return _rules(None, None, "pages", "page_slot")


def spec_for(
    axes: LogicalAxes,
    rules: Rules,
    mesh: Mesh,
    shape: Sequence[int] | None = None,
    dropped: list[str] | None = None,
) -> PartitionSpec:
    """PartitionSpec for one array. Unknown logical names raise; a mesh axis is used at most once
    per array; a dimension not divisible by its mesh axes is replicated (listed in ``dropped``)."""
    used: set[str] = set()
    out: list[Any] = []
    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule (rules: {sorted(rules)})")
        target = rules[name]
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape.get(a, 2) != 1)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if shape is not None and mesh_axes and shape[i] % size != 0:
            if dropped is not None:
                where = "x".join(mesh_axes)
                dropped.append(
                    f"dimension {i} ({name}, size {shape[i]}) over mesh axis '{where}' ({size})"
                )
            mesh_axes = ()
        used.update(mesh_axes)
        if not mesh_axes or size == 1:
            out.append(None)
        else:
            out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


class ShardingWarning(UserWarning):
    """A parameter dimension does not divide by its mesh axis and is replicated instead."""


def tree_shardings(axes_tree: Any, shapes_tree: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for a pytree of logical-axes tuples and a matching tree of shaped leaves.
    A dimension replicated because it does not divide by its mesh axis is reported with a
    :class:`ShardingWarning` naming the leaf (e.g. ``layers/wq``) and the axis."""
    dropped: list[str] = []

    def one(path: Any, axes: LogicalAxes, leaf: Any) -> NamedSharding:
        mine: list[str] = []
        spec = spec_for(axes, rules, mesh, leaf.shape, mine)
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        dropped.extend(f"{name}: {d}" for d in mine)
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(
        one, axes_tree, shapes_tree, is_leaf=lambda x: isinstance(x, tuple)
    )
    if dropped:
        axes = dict(mesh.shape)
        warnings.warn(
            f"mesh {axes}: replicated instead of sharded (size % mesh axis size != 0): "
            + "; ".join(dropped),
            ShardingWarning,
            stacklevel=2,
        )
    return out


_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "dora_jax_sharding_rules", default=None
)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within this block (at trace time), :func:`constrain` pins activations to ``mesh``."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside :func:`use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(axes, rules, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
