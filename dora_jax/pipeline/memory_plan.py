"""The memory plan: what every device will hold, computed before anything is allocated.

Per device, in bytes:

- the train state on the trainer mesh: the optimizer's copy of the params (float32 master
  weights, or the params themselves), Adam's moments, the KL reference params;
- the policy exports the trainer keeps for the rollout side, one per live version: the window
  holds at most ``staleness_k + 1`` versions (model dtype, trainer sharding; a multi-process run
  on accelerators keeps them in the rollout groups' layout on process 0's first ``tp`` devices,
  see :func:`exports_in_group_layout`; a trainer spanning processes gathers each export onto
  every trainer device one tensor at a time and keeps process 0's copy, whole, on its first
  trainer device);
- the engines' params: one copy per version an engine can serve, at most ``min(engines on the
  device, staleness_k + 1)``; none when the device is a trainer device with the same layout
  (``device_put`` onto the same devices and layout aliases the trainer's export);
- the engines' KV caches (``2 x L x num_pages x Z x K/tp x H`` each) and the held-out
  evaluator's engine (its params unless aliased, and its cache);
- transients: the compiled train step's temporaries at the longest bucket a sample can need, and
  the compiled engine prefill/decode steps' temporaries, from XLA's memory analysis of an
  abstract compilation (``jax.ShapeDtypeStruct`` inputs: nothing is allocated). On the logical
  clock one at a time (the control thread runs the train step and the engine steps one after the
  other: the largest counts); on the wall clock (``orchestrator.clock: wall``) the trainer and
  every group run on their own worker threads, so on a device they share, the train step's and
  each engine's step temporaries are counted together.

The limit per device is ``mesh.device_memory_gib`` or what the device reports; CPU devices report
nothing and share the host's memory, so on CPUs the devices the run uses (trainer and rollout
groups, however many fake devices the process has) are checked together: their sum against the
host's available memory (``mesh.device_memory_gib`` sets a per-device limit instead). A device
over ``memory_utilization x limit`` is refused with a message saying what to change.
``rollout.num_pages: null`` is sized here: as many pages as fit in what is left on the fullest
device (like vLLM's ``gpu_memory_utilization``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dora_jax.config import ExperimentConfig
from dora_jax.config.schema import replace as config_replace
from dora_jax.mesh import Meshes, build_meshes, make_mesh, processes
from dora_jax.model.params import abstract_params, dtype_of, param_axes
from dora_jax.orchestrator.clock import CLOCKS
from dora_jax.rollout.attention import resolve_impl
from dora_jax.rollout.steps import kv_cache_dtype, lower_steps
from dora_jax.sharding import rollout_rules, trainer_rules, tree_shardings
from dora_jax.train.batch import choose_bucket, chunked_shape, row_ladder
from dora_jax.train.state import init_state, state_shardings, uses_master
from dora_jax.train.step import lower_train_step

GiB = 1 << 30
TRANSIENT = "transient"  # logical clock: the largest one counts; wall clock: summed


class MemoryPlanError(ValueError):
    """The config does not fit the devices' memory (the message says what to change)."""


@dataclass(frozen=True)
class Item:
    device: int  # index into jax.devices()
    what: str
    bytes: int
    kind: str = "resident"  # or TRANSIENT


@dataclass
class MemoryPlan:
    items: list[Item]
    limit: int | None  # bytes per device, None: unknown
    utilization: float
    limit_source: str  # where the limit comes from
    num_pages: int  # KV pages per engine, resolved
    pages_sized: bool  # num_pages came from the plan (rollout.num_pages: null)
    train_bucket: tuple[int, int]  # (rows, seq_len) the train step was compiled for
    notes: list[str] = field(default_factory=list)
    train_step: Any = None  # the compiled step at train_bucket (a Trainer can adopt it)
    concurrent: bool = False  # wall clock: transients of one device can be live at once
    shared: bool = False  # CPU devices: one memory (the host's), the limit is for them all

    def devices(self) -> list[int]:
        return sorted({i.device for i in self.items})

    def pools(self) -> dict[str, list[int]]:
        """Devices checked together against the limit: each device on its own, or every
        device at once when they share the host's memory (CPU devices)."""
        if self.shared:
            return {f"the host (CPU devices {_ids(self.devices())})": self.devices()}
        return {f"device {d}": [d] for d in self.devices()}

    def total(self, devices: list[int]) -> int:
        """Resident bytes plus the transients of each device (the largest one, or all of them
        when ``concurrent``), summed over ``devices``."""
        out = 0
        for d in devices:
            mine = [i for i in self.items if i.device == d]
            out += sum(i.bytes for i in mine if i.kind != TRANSIENT)
            transients = [i.bytes for i in mine if i.kind == TRANSIENT]
            out += sum(transients) if self.concurrent else max(transients, default=0)
        return out

    @property
    def budget(self) -> int | None:
        return None if self.limit is None else int(self.limit * self.utilization)

    def over(self) -> list[tuple[str, int]]:
        if self.budget is None:
            return []
        return [(p, t) for p, ds in self.pools().items() if (t := self.total(ds)) > self.budget]

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (bytes)."""
        return {
            "limit_bytes_per_device": self.limit,
            "limit_source": self.limit_source,
            "memory_utilization": self.utilization,
            "num_pages": self.num_pages,
            "num_pages_sized_from_memory": self.pages_sized,
            "transients_summed": self.concurrent,
            "train_bucket_rows_x_tokens": list(self.train_bucket),
            "devices": {
                d: {
                    "total_bytes": self.total([d]),
                    "items": [
                        {"what": i.what, "bytes": i.bytes, "transient": i.kind == TRANSIENT}
                        for i in self.items
                        if i.device == d
                    ],
                }
                for d in self.devices()
            },
            "fits": not self.over(),
            "notes": self.notes,
        }

    def table(self) -> str:
        rule = (
            "summed (wall clock: the trainer and every group step at once)"
            if self.concurrent
            else "the largest counts (logical clock: one step at a time)"
        )
        lines = [f"memory plan (GiB per device; transients: {rule}):"]
        for d in self.devices():
            mine = [i for i in self.items if i.device == d]
            lines.append(f"  device {d}: {self.total([d]) / GiB:.2f}")
            for i in mine:
                tag = " (transient)" if i.kind == TRANSIENT else ""
                lines.append(f"    {i.bytes / GiB:9.3f}  {i.what}{tag}")
        if self.limit is not None:
            each = f"for all {len(self.devices())} devices" if self.shared else "per device"
            lines.append(
                f"  limit: {self.limit / GiB:.2f} GiB {each} ({self.limit_source}), planned "
                f"up to {self.utilization:.0%} = {self.budget / GiB:.2f} GiB"
            )
            if self.shared:
                lines.append(f"  all devices: {self.total(self.devices()) / GiB:.2f}")
        else:
            lines.append("  limit: unknown (set mesh.device_memory_gib to check the plan)")
        if self.num_pages:
            pages = "sized from the memory left" if self.pages_sized else "rollout.num_pages"
            lines.append(f"  KV pages per engine: {self.num_pages} ({pages})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the largest device's planned total against its limit, and whether it fits
        (the full plan is :meth:`table`)."""
        if not self.items:
            return "memory plan: nothing placed"
        if self.shared:
            total = self.total(self.devices())
            head = f"memory plan: {_size(total)} on {len(self.devices())} CPU devices"
        else:
            device = max(self.devices(), key=lambda d: self.total([d]))
            total = self.total([device])
            head = f"memory plan: at most {_size(total)} per device (device {device})"
        if self.budget is None:
            return f"{head}; limit unknown (set mesh.device_memory_gib to check the plan)"
        verdict = "ok" if total <= self.budget else "over"
        return (
            f"{head} against {_size(self.budget)} ({self.utilization:.0%} of "
            f"{_size(self.limit)}, {self.limit_source}): {verdict}"
        )

    def write(self, path: str | Path) -> Path:
        """The full plan (:meth:`table`) as a text file; returns its path."""
        path = Path(path)
        path.write_text(self.table() + "\n")
        return path

    def check(self) -> None:
        """:class:`MemoryPlanError` when a pool is over budget, naming what to change."""
        over = self.over()
        if not over:
            return
        pool, total = max(over, key=lambda x: x[1])
        raise MemoryPlanError(
            f"the memory plan does not fit: {pool} needs {total / GiB:.2f} GiB, over "
            f"{self.utilization:.0%} of {self.limit / GiB:.2f} GiB, {self.limit_source} "
            "(mesh.memory_utilization x mesh.device_memory_gib)\n"
            f"{_advice(self, self.pools()[pool])}\n{self.table()}"
        )


def _ids(ids: list[int]) -> str:
    """``0-3`` for a run of consecutive ids, else ``0, 2, 5``."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _advice(plan: MemoryPlan, devs: list[int], *more: str) -> str:
    """Two lines: the three largest items on ``devs``, and what to change (then ``more``)."""
    mine = [i for i in plan.items if i.device in devs]
    items = sorted(mine, key=lambda i: i.bytes, reverse=True)[:3]
    out: list[str] = []
    for i in items:
        w = i.what
        if w.startswith("train step"):
            rows, T = plan.train_bucket
            out.append(
                f"the train step at {rows} rows x {T} tokens: raise train.microbatches, or "
                "lower rollout.max_prompt_len + max_new_tokens (the bucket they need) or "
                "train.length_buckets (model.remat: nested and model.seq_chunk also shrink it)"
            )
        elif w.startswith("KV"):
            out.append("lower rollout.num_pages (or set it to null to size it from memory)")
        elif w.startswith("engine step"):
            out.append("lower rollout.max_slots or rollout.prefill_chunk")
        elif w.startswith("optimizer") or w.startswith("train params"):
            out.append(
                "train.fp32_master_weights=false, or shard the trainer wider "
                "(mesh.trainer.model, mesh.trainer.fsdp)"
            )
        elif w.startswith("exports") or w.startswith("engine params"):
            out.append(
                "lower orchestrator.staleness_k (fewer live versions) or give the "
                "rollout groups their own devices"
            )
        elif w.startswith("evaluator"):
            out.append(
                "lower eval.num_prompts or eval.samples_per_prompt (or num_prompts 0: "
                "no held-out evaluation)"
            )
    if plan.shared:
        out.append("or free memory on the host (the plan takes what it has available now)")
    fixes = list(dict.fromkeys(out)) or ["use a larger device or fewer devices' worth of work"]
    largest = "; ".join(f"{i.what} {i.bytes / GiB:.2f} GiB" for i in items)
    return f"largest items: {largest}\nto change: {'; '.join([*fixes, *more])}"


def exports_in_group_layout() -> bool:
    """A multi-process run on accelerators exports each version after version 0 in the rollout
    groups' layout on process 0's first ``mesh.rollout.tp`` devices, where the other processes
    pull it from (``GRPOTrainer.export_shardings``); on CPUs the processes exchange host copies
    and the exports keep the trainer's layout."""
    return jax.process_count() > 1 and jax.local_devices()[0].platform != "cpu"


def _per_device(abstract, shardings) -> dict[int, int]:
    """Bytes each device holds of a pytree of abstract arrays placed with ``shardings``."""
    ids = {d: i for i, d in enumerate(jax.devices())}
    out: dict[int, int] = defaultdict(int)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        n = math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        for d in s.device_set:
            out[ids[d]] += n
    return dict(out)


def _mesh_ids(mesh: Mesh) -> list[int]:
    ids = {d: i for i, d in enumerate(jax.devices())}
    return [ids[d] for d in mesh.devices.flat]


def device_limit(cfg: ExperimentConfig) -> tuple[int | None, str, bool]:
    """``(bytes, where that figure comes from, shared)``: ``mesh.device_memory_gib`` per device,
    else the device's ``bytes_limit``; CPU devices report nothing and share the host, so the
    limit is the host's available memory for all the devices the run uses together
    (``shared``: the plan checks their sum; the config can set a per-device figure instead)."""
    if cfg.mesh.device_memory_gib is not None:
        return int(cfg.mesh.device_memory_gib * GiB), "mesh.device_memory_gib", False
    devices = jax.devices()
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"reported by {devices[0].device_kind}", False
    if devices[0].platform == "cpu":
        host = host_memory()
        if host is not None:
            return host, "the host's available memory, shared by its CPU devices", True
    return None, "unknown", False


def host_memory() -> int | None:
    """The host's available memory (``MemAvailable``, Linux), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def longest_bucket(cfg: ExperimentConfig) -> int:
    """The longest train bucket a batch can need: the one a sample of ``max_prompt_len +
    max_new_tokens`` tokens falls into (longer buckets are never used), or the largest."""
    r, buckets = cfg.rollout, cfg.train.length_buckets
    try:
        return choose_bucket(r.max_prompt_len + r.max_new_tokens, buckets)
    except ValueError:
        return buckets[-1]


def _evaluates(cfg: ExperimentConfig) -> bool:
    e = cfg.eval
    return e.num_prompts > 0 and (cfg.data.task == "arithmetic" or e.path is not None)


def plan_memory(cfg: ExperimentConfig, meshes: Meshes | None = None) -> MemoryPlan:
    """The plan for ``cfg`` (its model already resolved from ``model.hf_path``)."""
    m, t, r, o = cfg.model, cfg.train, cfg.rollout, cfg.orchestrator
    meshes = meshes or build_meshes(cfg.mesh)
    limit, limit_source, shared = device_limit(cfg)
    items: list[Item] = []
    notes: list[str] = []
    live = o.k_bound + 1
    model_bytes = np.dtype(dtype_of(m.param_dtype)).itemsize

    # trainer state
    tmesh = meshes.trainer
    rules = trainer_rules(cfg.mesh.trainer)
    st_sh = state_shardings(m, t, tmesh, rules)
    state = jax.eval_shape(lambda p: init_state(p, m, t), abstract_params(m))
    master = " (float32 master)" if uses_master(m, t) else ""
    state_bytes: dict[int, int] = defaultdict(int)
    for what, a, s in (
        (f"train params{master}", state.params, st_sh.params),
        (f"optimizer moments ({t.adam_moment_dtype})", state.opt_state, st_sh.opt_state),
        ("KL reference params", state.ref_params, st_sh.ref_params),
    ):
        if a is None:
            continue
        for d, n in _per_device(a, s).items():
            items.append(Item(d, what, n))
            state_bytes[d] += n
    p_abs = abstract_params(m)
    t_sh = tree_shardings(param_axes(m), p_abs, rules, tmesh)
    export = _per_device(p_abs, t_sh)
    spanning = len(processes(tmesh)) > 1
    if spanning:
        # a trainer spanning processes gathers each export (and a checkpoint's state) onto
        # every trainer device one tensor at a time; process 0 keeps one copy (below)
        def size(a) -> int:
            return math.prod(a.shape) * np.dtype(a.dtype).itemsize

        whole = sum(size(a) for a in jax.tree.leaves(p_abs))
        largest = max(size(a) for a in jax.tree.leaves(state))
        for d in _mesh_ids(tmesh):
            items.append(
                Item(d, "a tensor gathered from every process (the largest)", largest, TRANSIENT)
            )
    if exports_in_group_layout():
        # version 0 in the trainer's layout (a spanning trainer's: whole on process 0's first
        # trainer device), every later one in the groups' layout on process 0's first tp
        # devices (counted as if all K + 1 live versions were there at once)
        r_mesh = cfg.mesh.rollout
        e_mesh = make_mesh(jax.local_devices()[: r_mesh.group_size], 1, r_mesh.tp, r_mesh.expert)
        e_sh = tree_shardings(param_axes(m), p_abs, rollout_rules(), e_mesh)
        first = {_mesh_ids(tmesh)[0]: whole} if spanning else export
        for d, n in first.items():
            items.append(Item(d, f"exports (version 0, {n / GiB:.2f} GiB)", n))
        for d, n in _per_device(p_abs, e_sh).items():
            items.append(
                Item(
                    d,
                    f"exports ({live} live versions x {n / GiB:.2f} GiB, the "
                    "groups' layout for the other processes)",
                    live * n,
                )
            )
    elif spanning:
        items.append(
            Item(
                _mesh_ids(tmesh)[0],
                f"exports ({live} live versions x "
                f"{whole / GiB:.2f} GiB, whole, on process 0's first trainer device)",
                live * whole,
            )
        )
    else:
        for d, n in export.items():
            items.append(Item(d, f"exports ({live} live versions x {n / GiB:.2f} GiB)", live * n))

    # engines
    trainer_ids = set(_mesh_ids(tmesh))
    t_layout = (cfg.mesh.trainer.data, cfg.mesh.trainer.expert, cfg.mesh.trainer.model)
    per_device_groups = Counter(d for g in meshes.groups for d in _mesh_ids(g))
    g_sh = [tree_shardings(param_axes(m), p_abs, rollout_rules(), g) for g in meshes.groups]
    aliased = []
    for d, n_groups in per_device_groups.items():
        g_index = next(i for i, g in enumerate(meshes.groups) if d in _mesh_ids(g))
        per = _per_device(p_abs, g_sh[g_index])[d]
        same = d in trainer_ids and set(_mesh_ids(meshes.groups[g_index])) == trainer_ids
        if same and t_layout == (1, cfg.mesh.rollout.expert, cfg.mesh.rollout.tp):
            aliased.append(d)
            continue
        copies = min(n_groups, live)
        items.append(
            Item(d, f"engine params ({copies} version(s) x {per / GiB:.2f} GiB)", copies * per)
        )
    if aliased:
        notes.append(
            f"engines on device(s) {aliased} share the trainer's exports (same "
            "devices and layout: no copy)"
        )

    # rollout step temporaries: one engine at a time per device, or (wall clock) every engine of
    # the device at once, each stepping on its own worker thread (kept: the plan sums them then)
    concurrent = CLOCKS[o.clock].concurrent
    with warnings.catch_warnings():  # the engine warns when it is built
        warnings.simplefilter("ignore")
        impl, interpret = resolve_impl(r.attention_impl, None)
    shapes = dataclasses.replace(r, num_pages=2, temperature=1.0, top_k=0, top_p=1.0)
    eng_tmp = _engine_temporaries(m, shapes, meshes.groups[0], impl, interpret)
    for d, n_groups in per_device_groups.items():
        n = n_groups if concurrent else 1
        at_once = f", {n} engines at once" if n > 1 else ""
        items.append(
            Item(d, f"engine step temporaries (prefill/decode{at_once})", n * eng_tmp, TRANSIENT)
        )

    # train step temporaries at the longest bucket a batch can need
    S = o.train_batch_prompts * t.group_size
    tm = cfg.mesh.trainer
    T = longest_bucket(cfg)
    if t.microbatch_tokens:  # room for one sample per row, in whole microbatches
        rows = chunked_shape(t, T, tm.data * tm.expert, S)[0]
    elif t.packing == "tokens" and not t.pack_rows:  # the ladder's largest: one sample per row
        rows = row_ladder(t.microbatches * tm.data * tm.expert, S)[-1]
    else:
        rows = t.pack_rows or S
    compiled = compiled_train_step(m, t, tmesh, cfg.mesh.trainer, S, rows, T)
    ma = compiled.memory_analysis()
    # the step's arguments are the state (counted above) and this device's part of the batch
    batch_bytes = max(ma.argument_size_in_bytes - state_bytes[min(trainer_ids)], 0)
    step = ma.temp_size_in_bytes + batch_bytes
    for d in trainer_ids:
        items.append(
            Item(
                d,
                f"train step temporaries ({rows} rows x {T} tokens, "
                + (
                    f"microbatches of {t.microbatch_tokens} tokens per device)"
                    if t.microbatch_tokens
                    else f"{t.microbatches} microbatch(es))"
                ),
                step,
                TRANSIENT,
            )
        )

    # evaluator: one engine on the first trainer device
    ev = _mesh_ids(tmesh)[0]
    eval_pages = 0
    if _evaluates(cfg):
        slots = min(64, cfg.eval.num_prompts * cfg.eval.samples_per_prompt)  # as Evaluator's
        eval_pages = slots * -(-(r.max_prompt_len + r.max_new_tokens) // r.page_size) + 1
        if t_layout != (1, 1, 1):
            per = sum(math.prod(a.shape) for a in jax.tree.leaves(p_abs)) * model_bytes
            items.append(Item(ev, "evaluator params (one full copy)", per))
        items.append(
            Item(ev, f"evaluator KV ({eval_pages} pages)", eval_pages * _page_bytes(cfg, 1))
        )

    # KV caches
    page = _page_bytes(cfg, cfg.mesh.rollout.tp)
    plan = MemoryPlan(
        items,
        limit,
        cfg.mesh.memory_utilization,
        limit_source,
        0,
        False,
        (rows, T),
        notes,
        compiled,
        concurrent,
        shared,
    )
    if r.num_pages is None:
        plan.num_pages, plan.pages_sized = _size_pages(plan, per_device_groups, page, cfg), True
    else:
        plan.num_pages = r.num_pages
    for d, n_groups in per_device_groups.items():
        items.append(
            Item(
                d,
                f"KV caches ({n_groups} engine(s) x {plan.num_pages} pages)",
                n_groups * plan.num_pages * page,
            )
        )
    return plan


@functools.lru_cache(maxsize=8)
def compiled_train_step(m, t, mesh: Mesh, mesh_cfg, num_samples: int, rows: int, seq_len: int):
    """:func:`lower_train_step` compiled (cached per process: the same config compiles once)."""
    low = lower_train_step(
        m,
        t,
        mesh,
        num_samples=num_samples,
        rows=rows,
        seq_len=seq_len,
        rules=trainer_rules(mesh_cfg),
    )
    return low.compile()


@functools.lru_cache(maxsize=8)
def _engine_temporaries(m, r, mesh: Mesh, impl: str, interpret: bool) -> int:
    out = 0
    for low in lower_steps(m, r, mesh, impl=impl, interpret=interpret):
        out = max(out, low.compile().memory_analysis().temp_size_in_bytes)
    return out


def _page_bytes(cfg: ExperimentConfig, tp: int) -> int:
    """K and V of one page of every layer, on one device of a group of ``tp`` devices."""
    m, r = cfg.model, cfg.rollout
    itemsize = np.dtype(kv_cache_dtype(m, jax.devices()[0].platform)).itemsize
    kv_heads = -(-m.num_kv_heads // tp)
    return 2 * m.num_layers * r.page_size * kv_heads * m.resolved_head_dim * itemsize


def _size_pages(plan: MemoryPlan, groups: dict[int, int], page: int, cfg: ExperimentConfig) -> int:
    r = cfg.rollout
    need = -(-(r.max_prompt_len + r.max_new_tokens) // r.page_size) + 1
    if plan.budget is None:
        raise MemoryPlanError(
            "rollout.num_pages is null but no device memory is known to size it from: set "
            "mesh.device_memory_gib or rollout.num_pages"
        )
    best = None
    for pool, devs in plan.pools().items():
        engines = sum(groups.get(d, 0) for d in devs)
        if not engines:
            continue
        free = plan.budget - plan.total(devs)
        pages = free // (engines * page)
        best = pages if best is None else min(best, pages)
        if pages < need:
            raise MemoryPlanError(
                f"rollout.num_pages: {pool} has {max(free, 0) / GiB:.2f} GiB left for the KV "
                f"caches of {engines} engine(s), {max(pages, 0)} pages each, fewer than the "
                f"{need} one request of max_prompt_len + max_new_tokens needs\n"
                f"{_advice(plan, devs, 'shorten the requests')}\n{plan.table()}"
            )
    return int(best if best is not None else 2)


def resolve(cfg: ExperimentConfig, plan: MemoryPlan) -> ExperimentConfig:
    """``cfg`` with the plan's ``rollout.num_pages``."""
    if cfg.rollout.num_pages == plan.num_pages:
        return cfg
    return config_replace(cfg, rollout=config_replace(cfg.rollout, num_pages=plan.num_pages))
