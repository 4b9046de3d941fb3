"""Run one mode of a simulation and turn its records into figures in modeled seconds.

Figures are taken over the train steps ``warmup+1 .. steps`` (the first steps of every mode start
from an empty cluster): from the end of step ``warmup`` to the end of step ``steps``.

- ``step_s``: that span / its steps. ``rollout_only_s``: the part of it in which the trainer is
  idle, waiting for data (the paper's "rollout-only" phase, the part not overlapped with training),
  per step; ``rollout_only_frac`` = rollout_only_s / step_s.
- ``tokens_per_s``: response tokens of the trajectories those steps consumed / the span.
- ``bubble``: idle group-seconds / group-seconds (a group with nothing to run).
- overheads, as shares of group-seconds (the names of ``records.Summary`` and of a real run's
  summary): ``weight_transfer_frac`` (weight transfers), ``migration_frac`` (incoming KV of
  migrated requests), ``reprefill_frac`` (prefilling again what was computed before);
  ``plan_frac``: wall time of the planner / the span (the control plane's decisions).
- staleness of the consumed trajectories, discarded requests, migrated requests; plans per
  trigger.
- the **step decomposition** (``gpu_*_s``): every GPU-second of the span by what the GPU did,
  per step and divided by the cluster's GPUs, so the six add up to ``step_s``: rollout while
  requests wait for a slot (``gpu_rollout_full_s``: the groups run at full batch), rollout while
  nothing waits (``gpu_rollout_tail_s``: the batch drains, finished requests are not replaced),
  re-prefill (``gpu_reprefill_s``), training (``gpu_train_s``), weight and KV moves
  (``gpu_moves_s``), and idle rollout or trainer GPUs (``gpu_idle_s``).
- with a ``turns`` section, ``conversations``: turns, environment time, requests waiting on their
  environment and the KV they hold, model tokens per second
  (:class:`~dora_jax.sim.conversations.ConversationFigures`); None otherwise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from dora_jax.orchestrator.records import plan_counts
from dora_jax.orchestrator.runtime import RunResult, Runtime
from dora_jax.orchestrator.staleness import DriftModel
from dora_jax.sim.backend import CATEGORIES, DECODE, PREFILL, SimBackend
from dora_jax.sim.config import SimConfig
from dora_jax.sim.conversations import ConversationFigures, Conversations, conversation_figures
from dora_jax.sim.cost_model import CostModel, MeasuredCost
from dora_jax.sim.hardware import get_hardware
from dora_jax.sim.models import get_model
from dora_jax.sim.trainer import SimTrainer
from dora_jax.sim.workload import ResponseLengths, SimPrompts


@dataclass(frozen=True)
class SimMetrics:
    mode: str
    placement: str
    groups: int
    steps: int
    step_s: float
    rollout_only_s: float
    rollout_only_frac: float
    train_s: float  # mean modeled train step (experience preparation included)
    tokens_per_s: float
    trajectories_per_s: float
    bubble: float
    weight_transfer_frac: float
    migration_frac: float
    reprefill_frac: float
    prefill_frac: float
    plan_frac: float
    plan_ms_mean: float
    plans: int
    staleness_mean: float
    staleness_max: int
    max_version_span: int
    discarded: int
    migrated: int
    weight_transfers: int
    ticks: int
    wall_s: float
    gpus: int = 0
    gpu_rollout_full_s: float = 0.0
    gpu_rollout_tail_s: float = 0.0
    gpu_reprefill_s: float = 0.0
    gpu_train_s: float = 0.0
    gpu_moves_s: float = 0.0
    gpu_idle_s: float = 0.0
    plans_by_trigger: dict = field(default_factory=dict)
    plans_moving: int = 0
    plan_ms_max: float = 0.0
    conversations: ConversationFigures | None = None  # runs with a turns section

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SimRun:
    cfg: SimConfig
    mode: str
    placement: str
    result: RunResult
    backend: SimBackend
    trainer: SimTrainer
    runtime: Runtime
    metrics: SimMetrics


def cost_model(cfg: SimConfig) -> CostModel | MeasuredCost:
    c = cfg.cluster
    if c.hardware == "cpu":
        return MeasuredCost.from_file(cfg.calibration_path())
    return CostModel(
        get_model(cfg.model), get_hardware(c.hardware), c.rollout_tp, cfg.efficiency, c.mem_util
    )


def balanced_trainer_gpus(cfg: SimConfig) -> int:
    """The trainer size (whole nodes, leaving whole rollout groups) that maximizes
    ``min(rollout tokens/s, training tokens/s)`` at steady state, from the cost model alone:

    - a rollout group keeps ``n = min(max_slots, watermark * KV capacity / r)`` requests, ``r``
      the mean KV a request in flight *reserves* under the admission rule, ``max(context, prompt
      + reserve)`` averaged over its life (a young request reserves more than it holds); it
      samples ``n / t_step(n, n c)`` tokens/s, ``c`` the mean context of a request in flight,
      ``prompt + E[L^2] / (2 E[L])`` (in-flight requests are length-biased and half done);
    - the trainer consumes ``TBS * G * E[L]`` response tokens per ``train_step_s``.

    (A first version divided the capacity by ``c``, leaving out the reservation: its rollout
    estimate was 15-25% above what the paper configs' dora runs achieve, so the split it chose
    left the trainer waiting a fifth of the time.)
    """
    cm, c, o = cost_model(cfg), cfg.cluster, cfg.orchestration
    lengths = ResponseLengths(cfg.response, o.group_size, cfg.run.seed)
    resp = lengths.sample(o.train_batch_prompts).ravel().astype(np.float64)
    prompts = SimPrompts(cfg.prompt, cfg.run.seed)
    plen = np.array([prompts.next_prompt().prompt_len for _ in range(len(resp))], np.float64)
    ctx = plen.mean() + (resp**2).mean() / (2.0 * resp.mean())
    # a request of length L spends its life uniformly over contexts prompt + x, x in [0, L],
    # reserving prompt + max(x, reserve): length-biased over the requests in flight
    rsv = float(o.kv_admit_reserve_tokens)
    short = np.minimum(resp, rsv)
    held = rsv * short + (resp**2 - short**2) / 2.0  # integral of max(x, rsv) over [0, L]
    reserved = plen.mean() + held.sum() / resp.sum()
    n = min(c.max_slots, o.kv_admit_watermark * cm.kv_capacity_tokens / reserved)
    per_group = n / float(cm.decode_step_s(n, n * ctx))
    node = get_hardware(c.hardware).devices_per_node
    best, best_rate = 0, -1.0
    for tg in range(node, c.total_gpus, node):
        if (c.total_gpus - tg) % c.rollout_tp:
            continue
        roll = (c.total_gpus - tg) // c.rollout_tp * per_group
        train = resp.sum() / cm.train_step_s(resp + plen, tg)
        if min(roll, train) > best_rate:
            best, best_rate = tg, min(roll, train)
    if not best:
        raise ValueError(f"no node-granular split of {c.total_gpus} devices fits rollout_tp")
    return best


def resolve(cfg: SimConfig) -> SimConfig:
    """``cfg`` with ``cluster.trainer_gpus = 0`` replaced by the balanced split."""
    if cfg.cluster.trainer_gpus:
        return cfg
    return replace(cfg, cluster=replace(cfg.cluster, trainer_gpus=balanced_trainer_gpus(cfg)))


def build(
    cfg: SimConfig, mode: str, placement: str = "disaggregated"
) -> tuple[Runtime, SimBackend, SimTrainer]:
    """The runtime, backend and trainer of one (mode, placement) of ``cfg``."""
    cfg = resolve(cfg)
    if placement not in ("disaggregated", "colocated"):
        raise ValueError(f"placement must be disaggregated or colocated, got {placement!r}")
    if placement == "colocated" and cfg.cluster.shared_rollout_device:
        raise ValueError(
            "cluster.shared_rollout_device: the groups share a device only apart "
            "from the trainer (disaggregated)"
        )
    cost = cost_model(cfg)
    r, o = cfg.run, cfg.orchestration
    lengths = ResponseLengths(cfg.response, o.group_size, r.seed)
    conversations = Conversations(cfg.turns, lengths, r.seed) if cfg.turns else None
    backend = SimBackend(
        cost,
        cfg.cluster.rollout_groups(placement),
        lengths,
        tick_s=r.tick_s,
        max_slots=cfg.cluster.max_slots,
        page_size=cfg.cluster.page_size,
        max_prompt_len=cfg.prompt.max_tokens,
        admit_watermark=o.kv_admit_watermark,
        admit_reserve_tokens=o.kv_admit_reserve_tokens,
        conversations=conversations,
        shared_device=cfg.cluster.shared_rollout_device,
        failures=cfg.failures,
        rollout_tp=cfg.cluster.rollout_tp,
    )
    colocated = backend if placement == "colocated" else None
    devices = cfg.cluster.training_gpus(placement)
    d = cfg.drift
    drift = DriftModel(d.coefficient, d.stress_start, d.stress_steps, d.stress_factor)
    trainer = SimTrainer(
        cost, devices, r.tick_s, colocated_with=colocated, clock=backend, drift=drift
    )
    prompts = SimPrompts(cfg.prompt, r.seed)
    runtime = Runtime(o.for_run(mode, r.tick_s), o.group_size, backend, trainer, prompts)
    return runtime, backend, trainer


def simulate(cfg: SimConfig, mode: str, placement: str = "disaggregated") -> SimRun:
    """Run ``mode`` for ``cfg.run.steps`` train steps and compute its figures."""
    cfg = resolve(cfg)
    runtime, backend, trainer = build(cfg, mode, placement)
    t0 = time.perf_counter()
    result = runtime.run(cfg.run.steps, max_ticks=cfg.run.max_ticks)
    wall = time.perf_counter() - t0
    m = metrics(cfg, mode, placement, result, backend, trainer, wall)
    return SimRun(cfg, mode, placement, result, backend, trainer, runtime, m)


def metrics(
    cfg: SimConfig,
    mode: str,
    placement: str,
    result: RunResult,
    backend: SimBackend,
    trainer: SimTrainer,
    wall_s: float = 0.0,
) -> SimMetrics:
    """Figures over steps ``warmup+1 .. steps`` (module docstring)."""
    rec, dt = result.records, cfg.run.tick_s
    w, n = cfg.run.warmup_steps, min(cfg.run.steps, len(rec.steps))
    if n <= w:
        raise ValueError(f"{mode}: only {n} steps ran, need more than warmup={w}")
    t0 = rec.steps[w - 1].end if w else 0
    t1 = rec.steps[n - 1].end
    span = (t1 - t0) * dt
    steps = n - w
    v_lo = rec.steps[w].version - 1  # the trainer version of the first step in the window
    v_hi = rec.steps[n - 1].version
    consumed = [c for c in rec.consumed if v_lo <= c.trainer_version < v_hi]
    idle_trainer = sum(1 for c in rec.cluster[t0:t1] if not c.training)  # ticks
    per_tick = np.asarray(backend.seconds[t0:t1]).reshape(-1, len(CATEGORIES))
    secs = per_tick.sum(axis=0)
    gs = max(span * backend.num_groups, 1e-12)
    cat = dict(zip(CATEGORIES, secs.tolist(), strict=True))
    plans = [p for p in rec.plans if t0 <= p.tick < t1]
    # the step decomposition: GPU-seconds by kind, per step, over the cluster's GPUs
    gpus = cfg.cluster.total_gpus
    trainer_gpus = 0 if placement == "colocated" else cfg.cluster.trainer_gpus
    waiting = np.array([c.pending > 0 for c in rec.cluster[t0:t1]], bool)
    rolling = per_tick[:, PREFILL] + per_tick[:, DECODE]
    training = (t1 - t0 - idle_trainer) * dt * trainer_gpus  # 0 when colocated
    per = cfg.cluster.rollout_tp / (gpus * steps)
    decomposition = {
        "gpu_rollout_full_s": float(rolling[waiting].sum()) * per,
        "gpu_rollout_tail_s": float(rolling[~waiting].sum()) * per,
        "gpu_reprefill_s": cat["reprefill"] * per,
        "gpu_train_s": cat["train"] * per + training / (gpus * steps),
        "gpu_moves_s": (cat["transfer"] + cat["migrate"]) * per,
        "gpu_idle_s": cat["idle"] * per + idle_trainer * dt * trainer_gpus / (gpus * steps),
    }
    st = [c.staleness for c in consumed]
    tr = [s for s in trainer.steps if v_lo < s.version <= v_hi]
    return SimMetrics(
        mode=mode,
        placement=placement,
        groups=backend.num_groups,
        steps=steps,
        step_s=span / steps,
        rollout_only_s=idle_trainer * dt / steps,
        rollout_only_frac=idle_trainer / max(t1 - t0, 1),
        train_s=float(np.mean([s.seconds for s in tr])) if tr else 0.0,
        tokens_per_s=sum(c.response_len for c in consumed) / span,
        trajectories_per_s=len(consumed) / span,
        bubble=cat["idle"] / gs,
        weight_transfer_frac=cat["transfer"] / gs,
        migration_frac=cat["migrate"] / gs,
        reprefill_frac=cat["reprefill"] / gs,
        prefill_frac=cat["prefill"] / gs,
        plan_frac=sum(p.ms for p in plans) / 1e3 / span,
        plan_ms_mean=float(np.mean([p.ms for p in plans])) if plans else 0.0,
        plans=len(plans),
        staleness_mean=float(np.mean(st)) if st else 0.0,
        staleness_max=max(st, default=0),
        max_version_span=max((c.version_span for c in consumed), default=0),
        discarded=sum(k for t, k in rec.discards if t0 <= t < t1),
        migrated=sum(k for t, k in rec.migrations if t0 <= t < t1),
        weight_transfers=sum(1 for t, _, _ in rec.transfers if t0 <= t < t1),
        ticks=len(rec.groups),
        wall_s=wall_s,
        gpus=gpus,
        **decomposition,
        **plan_counts(plans),
        plan_ms_max=max((p.ms for p in plans), default=0.0),
        conversations=conversation_figures(backend, rec, consumed, t0, t1, span)
        if backend.conversations is not None
        else None,
    )
