"""Typed, frozen configuration of one simulation, loaded from YAML (``configs/sim/*.yaml``).

Every assumption the paper leaves open (placement, TP degree, batch sizes, maximum response
length, efficiencies) is a field here, so a config file states them all. Unknown keys and bad
values raise :class:`~dora_jax.config.schema.ConfigError` naming the dotted field, through the
project's generic loader (:func:`dora_jax.config.loading.from_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

from dora_jax.config import schema
from dora_jax.config.errors import ConfigError
from dora_jax.config.errors import check as _check
from dora_jax.config.loading import load_dataclass
from dora_jax.orchestrator.modes import MODES
from dora_jax.sim.hardware import HARDWARE
from dora_jax.sim.models import MODELS

COLOCATABLE = ("sync", "partial", "oversample")  # modes whose rollout can pause while training


def _positive(obj: object, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v > 0, n, f"must be > 0, got {v}")


def _at_least(obj: object, low: float, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v >= low, n, f"must be >= {low}, got {v}")


def _fraction(obj: object, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(0 < v <= 1, n, f"must be in (0, 1], got {v}")


@dataclass(frozen=True)
class ClusterConfig:
    """Devices and how they are split. ``disaggregated``: ``trainer_gpus`` train, the rest roll
    out in groups of ``rollout_tp``; ``colocated``: every device does both, in turn."""

    hardware: str = "h800"
    total_gpus: int = 64
    trainer_gpus: int = 32  # 0: the balanced split (run.balanced_trainer_gpus)
    rollout_tp: int = 4
    max_slots: int = 1024  # concurrent requests per engine (verl's rollout max_num_seqs default)
    page_size: int = 16  # KV page (vLLM's default block size)
    mem_util: float = 0.8  # HBM share the engine takes (DAPO 32B recipe gpu_memory_utilization)
    # the rollout groups time-share one device (disaggregated only): each tick goes to the
    # groups with work, water-filled by their work (SimBackend), as the CPU preset's four
    # groups share one core in the two-process arrangement of benchmarks/bench_wallclock.py
    shared_rollout_device: bool = False

    def __post_init__(self):
        _check(
            self.hardware in HARDWARE or self.hardware == "cpu",
            "hardware",
            f"unknown preset {self.hardware!r}; expected one of {', '.join(HARDWARE)}, or 'cpu' "
            "(measured constants: SimConfig.calibration)",
        )
        _positive(self, "total_gpus", "rollout_tp", "max_slots", "page_size")
        _fraction(self, "mem_util")
        _check(
            0 <= self.trainer_gpus < self.total_gpus,
            "trainer_gpus",
            f"must be in [0, total_gpus) (0: balanced split), got {self.trainer_gpus}",
        )
        _check(
            self.total_gpus % self.rollout_tp == 0,
            "total_gpus",
            f"{self.total_gpus} is not a multiple of rollout_tp = {self.rollout_tp}",
        )
        _check(
            (self.total_gpus - self.trainer_gpus) % self.rollout_tp == 0,
            "trainer_gpus",
            f"total_gpus - trainer_gpus = {self.total_gpus - self.trainer_gpus} is not a "
            f"multiple of rollout_tp = {self.rollout_tp}",
        )

    def rollout_groups(self, placement: str) -> int:
        gpus = self.total_gpus if placement == "colocated" else self.total_gpus - self.trainer_gpus
        return gpus // self.rollout_tp

    def training_gpus(self, placement: str) -> int:
        return self.total_gpus if placement == "colocated" else self.trainer_gpus


@dataclass(frozen=True)
class EfficiencyConfig:
    """Achieved fractions of peak and fixed latencies: the cost model's free parameters. Each
    default is argued in ``docs/simulator.md``; none is fitted to the paper's results."""

    hbm: float = 0.8  # decode HBM bandwidth achieved (FlashMLA: 3000 of 3350 GB/s on H800)
    decode_mfu: float = 0.5  # FLOP/s achieved when a decode step is compute-bound
    prefill_mfu: float = 0.5  # FLOP/s achieved by prefill
    train_mfu: float = 0.35  # trainer MFU (Megatron-Core's best case on H100 is 0.47)
    comm: float = 0.8  # achieved / spec link bandwidth (DeepSeek-V3: 160 of 200 GB/s NVLink)
    step_overhead_s: float = 0.002  # per engine step: scheduling, sampling, launch
    allreduce_latency_s: float = 1e-5  # per TP all-reduce
    weight_sync_latency_s: float = 0.5  # per weight transfer: setup, resharding
    kv_transfer_latency_s: float = 0.005  # per migration call: RPC + handshake
    prefill_chunk_tokens: int = 8192  # tokens per prefill forward (verl max_num_batched_tokens)
    train_step_overhead_s: float = 5.0  # optimizer step, gradient sync, bookkeeping
    exp_prep_forwards: int = 1  # forward passes before training (old log-probs; +1 with a KL ref)

    def __post_init__(self):
        _fraction(self, "hbm", "decode_mfu", "prefill_mfu", "train_mfu", "comm")
        _at_least(self, 0, "step_overhead_s", "allreduce_latency_s", "weight_sync_latency_s")
        _at_least(self, 0, "kv_transfer_latency_s", "train_step_overhead_s")
        _positive(self, "prefill_chunk_tokens")
        _at_least(self, 0, "exp_prep_forwards")


@dataclass(frozen=True)
class ResponseConfig:
    """Response lengths (tokens). ``lognormal``: ``median`` and ``p99_ratio`` = p99 / median;
    ``mixture``: that body plus a share ``tail_weight`` from a second log-normal
    (``tail_median``, ``tail_p99_ratio``); ``file``: measured lengths, one integer per line.
    ``prompt_corr``: share of the log-length variance common to a prompt group (its
    difficulty: hard prompts get long answers from all ``G`` samples). Capped at ``max_tokens``."""

    kind: Literal["lognormal", "mixture", "file"] = "lognormal"
    median: float = 1400.0
    p99_ratio: float = 12.0
    max_tokens: int = 20480
    tail_weight: float = 0.0
    tail_median: float = 8000.0
    tail_p99_ratio: float = 3.0
    path: str | None = None
    prompt_corr: float = 0.5

    def __post_init__(self):
        _positive(self, "median", "max_tokens", "tail_median")
        _at_least(self, 1, "p99_ratio", "tail_p99_ratio")
        _check(
            0 <= self.tail_weight < 1, "tail_weight", f"must be in [0, 1), got {self.tail_weight}"
        )
        _check(0 <= self.prompt_corr <= 1, "prompt_corr", "must be in [0, 1]")
        _check(self.kind != "file" or bool(self.path), "path", "kind 'file' needs a path")


@dataclass(frozen=True)
class ObservationConfig:
    """Tokens of one environment turn (a tool's answer, a game's reply) appended to a
    conversation: log-normal (``median``, ``p99_ratio`` = p99 / median), clipped to
    ``[1, max_tokens]``."""

    median: float = 200.0
    p99_ratio: float = 5.0
    max_tokens: int = 4096

    def __post_init__(self):
        _positive(self, "median", "max_tokens")
        _at_least(self, 1, "p99_ratio")


@dataclass(frozen=True)
class LatencyConfig:
    """Seconds one environment call takes (modeled time). ``lognormal``: ``median_s`` and
    ``p99_ratio``; ``file``: measured seconds, one number per line, at ``path``. Capped at
    ``max_s`` (the environment's per-call timeout). ``per_prompt``: call ``t`` takes the same
    time in every member of a prompt group (a pure function of the problem and the call's
    number, as the built-in ``tool_arithmetic``'s latency is); else each member draws its own.
    ``workers``: calls run on that many environment workers, each one call at a time (a real
    run's ``env.workers``): a conversation is given the worker holding the fewest live
    conversations when it is first submitted and keeps it, and each worker takes its calls in
    the order their turns ended; a call's time counts from when its worker starts it. 0: every
    call starts when its turn ends (as many workers as calls)."""

    kind: Literal["lognormal", "file"] = "lognormal"
    median_s: float = 1.0
    p99_ratio: float = 30.0
    max_s: float = 600.0
    path: str | None = None
    per_prompt: bool = False
    workers: int = 0

    def __post_init__(self):
        _positive(self, "median_s", "max_s")
        _at_least(self, 1, "p99_ratio")
        _check(self.kind != "file" or bool(self.path), "path", "kind 'file' needs a path")
        _check(self.workers >= 0, "workers", f"must be >= 0 (0: unlimited), got {self.workers}")


@dataclass(frozen=True)
class TurnsConfig:
    """Multi-turn (agentic) conversations: a trajectory alternates model turns and environment
    turns. Model turns per trajectory: ``kind`` ``lognormal`` (``median``, ``p99_ratio``),
    rounded, or ``file`` (measured turn counts, one integer per line at ``path``, drawn by
    quantile from their own distribution), in ``[1, max_turns]``; ``prompt_corr`` is the
    share of its (normal) variance that is the prompt's difficulty (the same difficulty that
    lengthens responses: hard prompts get more and longer turns). Each model turn's length is
    drawn from ``response`` (per turn); each environment turn takes ``latency`` seconds and
    appends ``observation`` tokens. A trajectory whose response (model and observation
    tokens) reaches ``max_total_tokens`` ends there."""

    kind: Literal["lognormal", "file"] = "lognormal"
    path: str | None = None
    median: float = 4.0
    p99_ratio: float = 10.0
    max_turns: int = 64
    prompt_corr: float = 0.5
    max_total_tokens: int = 32768
    observation: ObservationConfig = field(default_factory=ObservationConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)

    def __post_init__(self):
        _check(self.median >= 1, "median", f"must be >= 1 (turns), got {self.median}")
        _at_least(self, 1, "p99_ratio", "max_turns")
        _check(0 <= self.prompt_corr <= 1, "prompt_corr", "must be in [0, 1]")
        _positive(self, "max_total_tokens")
        _check(self.kind != "file" or bool(self.path), "path", "kind 'file' needs a path")


@dataclass(frozen=True)
class PromptConfig:
    """Prompt lengths (tokens): log-normal, clipped to ``[min_tokens, max_tokens]``."""

    median: float = 200.0
    p99_ratio: float = 3.0
    min_tokens: int = 16
    max_tokens: int = 2048  # DAPO recipe max_prompt_length

    def __post_init__(self):
        _positive(self, "median", "min_tokens")
        _at_least(self, 1, "p99_ratio")
        _check(self.max_tokens >= self.min_tokens, "max_tokens", "must be >= min_tokens")


# orchestrator fields the simulator sets for each run (OrchestrationConfig.for_run), and why
_PER_RUN = {
    "mode": "each run's mode is one of run.modes",
    "clock": "the simulator runs on the logical clock",
    "plan_period_ticks": "the simulator takes plan_period_s (modeled seconds)",
}


@dataclass(frozen=True)
class OrchestrationConfig(schema.OrchestratorConfig):
    """The orchestrator's own config (its fields, ``planner`` switches and checks), with the
    simulator's defaults and the fields only a simulation has. A run's config is :meth:`for_run`
    (``mode`` from ``run.modes``, ``plan_period_ticks`` from ``plan_period_s``), checked at load
    for every mode run as a real run checks it: the simulator refuses what a real run refuses
    (``sync``/``oversample`` run at K = 0 and ``one_step`` at K = 1 whatever ``staleness_k``
    says; ``one_step`` needs it >= 1; ``auto`` is for ``dora`` alone)."""

    clock: schema.Clock = "logical"
    train_batch_prompts: int = 512  # TBS (DAPO recipe train_prompt_bsz)
    rollout_batch_prompts: int = 768  # RBS
    kv_pressure_threshold: float = 0.95
    group_size: int = 16  # G (DAPO recipe n_resp_per_prompt)
    plan_period_s: float = 30.0  # modeled seconds between periodic plans
    # the engine's admission (SimBackend): admit while the KV a group reserves stays under this
    # share of its capacity, each request reserving kv_admit_reserve_tokens of room to grow
    kv_admit_watermark: float = 0.85
    kv_admit_reserve_tokens: int = 2048

    def __post_init__(self):
        super().__post_init__()
        default = {f.name: f.default for f in fields(self)}
        for name, why in _PER_RUN.items():
            value = getattr(self, name)
            _check(value == default[name], name, f"{why}: leave it out, got {value!r}")
        _positive(self, "group_size", "plan_period_s", "kv_admit_reserve_tokens")
        _fraction(self, "kv_admit_watermark")

    def for_run(self, mode: str, tick_s: float) -> schema.OrchestratorConfig:
        """The orchestrator config of one run of ``mode``, ``tick_s`` modeled seconds a tick."""
        own = {f.name: getattr(self, f.name) for f in fields(schema.OrchestratorConfig)}
        own.update(mode=mode, plan_period_ticks=max(1, round(self.plan_period_s / tick_s)))
        return schema.OrchestratorConfig(**own)


@dataclass(frozen=True)
class RunConfig:
    steps: int = 30  # train steps per mode
    warmup_steps: int = 5  # the figures are taken over steps warmup+1 .. steps
    tick_s: float = 1.0  # modeled seconds per tick (see docs/simulator.md, "Time")
    seed: int = 0
    modes: tuple[str, ...] = MODES  # run disaggregated
    colocated: tuple[str, ...] = ("sync", "partial")  # also run colocated
    timeline_steps: int = 6  # train steps shown in each timeline plot, after the warm-up
    max_ticks: int = 5_000_000

    def __post_init__(self):
        _positive(self, "steps", "tick_s", "max_ticks")
        _check(0 <= self.warmup_steps < self.steps, "warmup_steps", "must be in [0, steps)")
        for m in self.modes:
            known = get_args(schema.Mode)  # (registered modes included)
            _check(m in known, "modes", f"unknown mode {m!r}; expected some of {known}")
        for m in self.colocated:
            _check(
                m in COLOCATABLE,
                "colocated",
                f"{m!r} cannot run colocated; only "
                f"{COLOCATABLE} (their rollout may pause while training)",
            )
        _at_least(self, 0, "timeline_steps")


@dataclass(frozen=True)
class FailureConfig:
    """Accelerator failures (``sim/failures.py``): each GPU fails at random, at a mean time between
    failures of ``gpu_mtbf_hours`` (an exponential law), so a rollout group of TP ``t`` fails at
    ``t`` times that rate. ``recover``: a failed group's requests start again from their prompts
    on the other groups of their version, and the group is out for ``restart_s``, then loads the
    newest version; ``stop_resume``: the whole job stops at every failure (computed from the
    run without failures, ``failures.stop_and_resume``). A trainer GPU's failure stops the job
    under both policies: ``job_restart_s`` to restart it, and on average half of
    ``checkpoint_every_s`` of work since the last checkpoint lost."""

    gpu_mtbf_hours: float = 50_000.0
    restart_s: float = 300.0
    job_restart_s: float = 600.0
    checkpoint_every_s: float = 1800.0
    seed: int = 0

    def __post_init__(self):
        _positive(self, "gpu_mtbf_hours", "restart_s", "checkpoint_every_s")
        _at_least(self, 0, "job_restart_s")


@dataclass(frozen=True)
class DriftConfig:
    """The modeled off-policy drift a train step would measure (``staleness_k: auto`` reads it):
    lag ``k`` reads an ESS of ``1 - c k^2``, ``c`` being ``coefficient``, times ``stress_factor^2``
    for the ``stress_steps`` train steps from ``stress_start`` (a learning rate raised that many
    times; -1: no stress). ``orchestrator/staleness.py``'s ``DriftModel``."""

    coefficient: float = 0.001
    stress_start: int = -1
    stress_steps: int = 0
    stress_factor: float = 1.0

    def __post_init__(self):
        _at_least(self, 0, "coefficient", "stress_steps")
        _positive(self, "stress_factor")


@dataclass(frozen=True)
class SimConfig:
    name: str = "sim"
    description: str = ""
    model: str = "qwen2.5-32b"
    paper_key: str | None = None  # e.g. "dense_32b.gpus_64" in paper_figures.yaml
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)
    response: ResponseConfig = field(default_factory=ResponseConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    run: RunConfig = field(default_factory=RunConfig)
    turns: TurnsConfig | None = None  # multi-turn conversations (None: one turn per request)
    failures: FailureConfig | None = None  # rollout groups that fail (None: never)
    drift: DriftConfig = field(default_factory=DriftConfig)  # read by staleness_k: auto
    # hardware 'cpu': the calibrate_cpu.json whose measured constants give every cost
    # (benchmarks/calibrate_cpu.py; a relative path is taken from the repository root)
    calibration: str | None = None

    def __post_init__(self):
        _check(
            self.model in MODELS,
            "model",
            f"unknown preset {self.model!r}; expected one of {', '.join(MODELS)}",
        )
        _check(
            self.cluster.hardware != "cpu" or bool(self.calibration),
            "calibration",
            "hardware 'cpu' needs the calibrate_cpu.json of benchmarks/calibrate_cpu.py",
        )
        for mode in dict.fromkeys(m for m, _ in self.variants()):  # each run's config is checked
            try:
                self.orchestration.for_run(mode, self.run.tick_s)
            except ConfigError as e:
                where = f" (the {mode} run of run.modes / run.colocated)"
                raise ConfigError(f"orchestration.{e.path}", e.reason + where) from None

    def calibration_path(self) -> Path | None:
        if not self.calibration:
            return None
        p = Path(self.calibration)
        return p if p.is_absolute() or p.exists() else Path(__file__).resolve().parents[2] / p

    def variants(self) -> list[tuple[str, str]]:
        """(mode, placement) pairs to run, in table order."""
        out = []
        for m in self.run.modes:
            if m in self.run.colocated:
                out.append((m, "colocated"))
            out.append((m, "disaggregated"))
        out += [(m, "colocated") for m in self.run.colocated if m not in self.run.modes]
        return out


def load_sim_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> SimConfig:
    """Defaults, then the YAML file at ``path``, then dotted ``overrides`` (``run.steps=10``,
    ``run.modes=[sync,dora]``)."""
    return load_dataclass(SimConfig, path, overrides or ())
