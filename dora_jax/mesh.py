"""The global device list cut into role submeshes: one trainer mesh and N rollout group meshes.

Every mesh has the axes ``("data", "expert", "model")`` (classic auto sharding). ``expert``
splits a mixture of experts' experts (size 1, i.e. absent in effect, for dense models). Rollout
groups all get the same mesh shape ``(1, expert, tp)`` so that weights and KV pages move between
them shard to shard (a ``device_put`` between meshes of different layouts goes through the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from dora_jax.config import ConfigError, MeshConfig

AXES = ("data", "expert", "model")


@dataclass(frozen=True)
class Meshes:
    trainer: Mesh
    groups: tuple[Mesh, ...]

    @property
    def colocated(self) -> bool:
        """True when rollout groups share devices with each other."""
        ids = [d.id for m in self.groups for d in m.devices.flat]
        return len(ids) != len(set(ids))


def parse_slice(text: str, n_devices: int, path: str) -> list[int]:
    """``"a:b"`` (either end optional) or a single index ``"i"`` -> device indices."""
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            start = int(lo) if lo.strip() else 0
            stop = int(hi) if hi.strip() else n_devices
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise ConfigError(path, f"expected a device slice like '0:4', got {text!r}") from None
    if not 0 <= start < stop <= n_devices:
        raise ConfigError(
            path, f"device slice {text!r} is out of range for {n_devices} available device(s)"
        )
    return list(range(start, stop))


def processes(mesh: Mesh) -> set[int]:
    """The processes whose devices ``mesh`` holds."""
    return {d.process_index for d in mesh.devices.flat}


def make_mesh(devices: Sequence[jax.Device], data: int, model: int, expert: int = 1) -> Mesh:
    """A ``(data, expert, model)`` mesh over ``devices`` (model the fastest-varying axis)."""
    return Mesh(np.asarray(devices, dtype=object).reshape(data, expert, model), AXES)


def build_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Meshes:
    """Cut ``devices`` (default: all local devices) as the config says; errors name the field."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    t = cfg.trainer
    t_ids = parse_slice(t.devices, n, "mesh.trainer.devices")
    if len(t_ids) != t.data * t.expert * t.model:
        names = "data x model" if t.expert == 1 else "data x expert x model"
        sizes = f"{t.data} x {t.model}" if t.expert == 1 else f"{t.data} x {t.expert} x {t.model}"
        raise ConfigError(
            "mesh.trainer.devices",
            f"slice {t.devices!r} has {len(t_ids)} device(s) but {names} = {sizes} = "
            f"{t.data * t.expert * t.model}",
        )
    trainer = make_mesh([devices[i] for i in t_ids], t.data, t.model, t.expert)

    r = cfg.rollout
    r_ids = parse_slice(r.devices, n, "mesh.rollout.devices")
    w = r.group_size  # expert x tp
    if len(r_ids) == r.groups * w:
        cuts = [r_ids[g * w : (g + 1) * w] for g in range(r.groups)]
    elif len(r_ids) == w:
        cuts = [r_ids] * r.groups  # colocated: every group's engine on the same devices
    else:
        tp = "tp" if r.expert == 1 else "expert x tp"
        width = f"{r.tp}" if r.expert == 1 else f"{r.expert} x {r.tp}"
        raise ConfigError(
            "mesh.rollout.devices",
            f"slice {r.devices!r} has {len(r_ids)} device(s); it needs groups x {tp} = "
            f"{r.groups} x {width} = {r.groups * w} (disjoint groups) or {tp} = {w} "
            "(colocated groups)",
        )
    groups = tuple(make_mesh([devices[i] for i in c], 1, r.tp, r.expert) for c in cuts)
    return Meshes(trainer=trainer, groups=groups)
