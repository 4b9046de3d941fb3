"""Assemble and run one experiment from an :class:`ExperimentConfig`.

Policy (random init, a HF checkpoint, or the warm start) -> trainer on the trainer submesh ->
engines on the group submeshes (the real :class:`EngineBackend`) -> the control-plane
:class:`Runtime` in the configured mode and clock (``orchestrator.clock``: on the wall clock
every group and the trainer run on their own worker threads). :func:`run` drives the runtime's one
loop with observers for the step logs, freeing old versions and periodic checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
from jax.sharding import SingleDeviceSharding

from dora_jax.checkpoint import CheckpointError, CheckpointSaveError
from dora_jax.config import ConfigError, ExperimentConfig, from_dict
from dora_jax.data import Scorer
from dora_jax.data.prompts import PromptSource
from dora_jax.execution.backend import EngineBackend
from dora_jax.execution.trainer import ThreadedTrainer
from dora_jax.execution.trainer_worker import SpmdTrainer
from dora_jax.mesh import Meshes, build_meshes, processes
from dora_jax.model import abstract_params, param_axes
from dora_jax.model.hf_checkpoint import check_hf_checkpoint, load_hf_config, policy_params
from dora_jax.model.hf_mapping import UnsupportedModelError
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import (
    Tokenizer,
    check_vocabularies,
    eos_ids,
    load_tokenizer,
)
from dora_jax.orchestrator.clock import CLOCKS, Bus, make_clock
from dora_jax.orchestrator.modes import mode_for
from dora_jax.orchestrator.runtime import Observer, RunResult, Runtime
from dora_jax.pipeline.conversations import EnvRun, env_demonstrations, teacher_kwargs
from dora_jax.pipeline.evaluation import EvalResult, Evaluator
from dora_jax.pipeline.grpo import GRPOTrainer, StepLog, TokenizedPrompts, encode_chat
from dora_jax.pipeline.inputs import (
    ExperimentError,
    env_run,
    load_examples,
    scorers,
    task_parts,
)
from dora_jax.pipeline.inputs import evaluator as make_evaluator
from dora_jax.pipeline.memory_plan import MemoryPlan, MemoryPlanError, plan_memory
from dora_jax.pipeline.memory_plan import resolve as resolve_pages
from dora_jax.pipeline.warm_start import warm_start
from dora_jax.platform import cpu_bfloat16_note, release_free_memory
from dora_jax.resume import changes as resume_changes
from dora_jax.sharding import tree_shardings

__all__ = ["Experiment", "ExperimentError", "build", "load_examples", "run"]


@dataclass
class Experiment:
    cfg: ExperimentConfig
    meshes: Meshes
    tokenizer: Tokenizer
    reward: Scorer
    source: PromptSource
    grpo: GRPOTrainer
    backend: EngineBackend
    runtime: Runtime
    warm_start_losses: list[float] = field(default_factory=list)
    evaluator: Evaluator | None = None  # held-out evaluation (eval.num_prompts > 0)
    memory_plan: MemoryPlan | None = None
    wall_s: float = 0.0
    stopped: bool = False  # the last run() ended early on a stop request
    prompts: TokenizedPrompts | None = None  # the runtime's prompt source
    long_prompt_lines: list[int] = field(default_factory=list)  # JSONL lines left out as too long
    env: EnvRun | None = None  # multi-turn environments (env.spec): pool, turn driver, prompts

    @property
    def trainer(self) -> SpmdTrainer:
        return self.grpo.trainer

    def close(self) -> None:
        """Stop the worker threads of a wall-clock run and the reward workers."""
        self.backend.close()
        if isinstance(self.runtime.trainer, ThreadedTrainer):
            self.runtime.trainer.close()
        self.reward.close()
        if self.env is not None:
            self.env.close()
        self.trainer.close()

    # -- what a checkpoint holds (dora_jax.checkpoint calls these) ------------------------------

    @property
    def steps_done(self) -> int:
        """Train steps published: a checkpoint's key."""
        return self.runtime.steps_done

    @property
    def tick(self) -> int:
        return self.runtime.tick_index

    def state_dict(self) -> dict:
        """The host state, ``{component: its state}``: the control plane, the engines with
        everything in flight, the trainer's step logs, the scorer's counts, the prompt cursor."""
        return {
            "runtime": self.runtime.state_dict(),
            "backend": self.backend.state_dict(),
            "grpo": self.grpo.state_dict(),
            "reward": self.reward.state_dict(),
            "prompts": self.prompts.state_dict(),
            "run": {"wall_s": self.wall_s},
        }

    def load_state_dict(self, state: dict) -> None:
        """The inverse of :meth:`state_dict`, after :meth:`place_arrays` (the engines take the
        params of their versions from the trainer's kept versions)."""
        self.runtime.load_state_dict(state["runtime"])  # first: a wall clock continues its time
        self.backend.load_state_dict(state["backend"], self.grpo.params_for)
        self.grpo.load_state_dict(state["grpo"])
        self.reward.load_state_dict(state["reward"])
        self.prompts.load_state_dict(state["prompts"])
        self.wall_s = state["run"]["wall_s"]

    def arrays(self, host_copies: bool) -> dict:
        """The checkpoint's arrays: the train state and the params of every kept version
        (``host_copies``: gathered to this process, when the trainer spans processes)."""
        versions = {f"v{v}": p for v, p in self.grpo.params.items()}
        if host_copies:
            return {"train_state": self.trainer.host_state(), "versions": jax.device_get(versions)}
        return {"train_state": self.trainer.state, "versions": versions}

    def array_targets(self, state: dict) -> dict:
        """Abstract arrays (shapes, dtypes, shardings) to restore the arrays of a checkpoint
        whose host state is ``state`` into."""
        param = jax.tree.map(_abstract, next(iter(self.grpo.params.values())))
        return {
            "train_state": jax.tree.map(_abstract, self.trainer.state),
            "versions": {f"v{v}": param for v in state["grpo"]["versions"]},
        }

    def check_saved_config(self, saved: dict) -> None:
        """Refuse a checkpoint whose config ``saved`` this run cannot continue: a resume may
        change the fields :data:`dora_jax.resume.RULES` allows, never the others (the shapes the
        checkpoint holds, its prompt stream, ...); :class:`ConfigError` names the field."""
        try:
            saved_cfg = from_dict(ExperimentConfig, saved)
        except ConfigError as e:
            raise CheckpointError(f"the checkpoint's config cannot be read: {e}") from None
        resume_changes(saved_cfg, self.cfg)

    def place_arrays(self, arrays, host_copies: bool, checkpoint=None) -> None:
        """Take the restored arrays (host copies: put into their shardings; a trainer spanning
        processes has the others read their shards of ``checkpoint``, ``(directory, step)``)."""
        versions = dict(arrays.versions)
        if host_copies:
            param = next(iter(self.grpo.params.values()))
            shardings = jax.tree.map(lambda a: a.sharding, param)
            versions = {k: jax.device_put(v, shardings) for k, v in versions.items()}
            self.trainer.load_host_state(arrays.train_state, checkpoint=checkpoint)
        else:
            self.trainer.state = arrays.train_state
        self.grpo.params = {int(k[1:]): v for k, v in versions.items()}

    def stream_history(self, run_dir: Path, resume: bool = False) -> list[str]:
        """Keep the run's history in ``run_dir`` (``records.jsonl``, ``consumed.jsonl``, and the
        step logs in ``metrics.jsonl``) rather than in memory: what the run holds and each
        checkpoint writes then stays the same size however long it runs. Returns the history
        files found shorter than the checkpoint says."""
        self.grpo.keep_log = False
        return self.runtime.stream_history(run_dir, resume=resume)

    def evaluate(self, step: int) -> EvalResult:
        """The held-out evaluation of the trainer's current params (needs ``evaluator``)."""
        if self.evaluator is None:
            raise ExperimentError("this experiment has no evaluation (eval.num_prompts is 0)")
        return self.evaluator(self.grpo.params_for(self.grpo.version), step)


def check_fits(cfg: ExperimentConfig) -> None:
    """Sizes that must hold a full-length trajectory (``max_prompt_len + max_new_tokens``)."""
    r, t = cfg.rollout, cfg.train
    longest = r.max_prompt_len + r.max_new_tokens
    if t.length_buckets[-1] < longest:
        raise ConfigError(
            "train.length_buckets",
            f"the largest bucket ({t.length_buckets[-1]}) must hold a full-length trajectory: "
            f"rollout.max_prompt_len + rollout.max_new_tokens = {longest} tokens",
        )
    pages = -(-longest // r.page_size)
    if r.num_pages - 1 < pages:
        raise ConfigError(
            "rollout.num_pages",
            f"{r.num_pages} pages of {r.page_size} tokens cannot hold one request of "
            f"max_prompt_len + max_new_tokens = {longest} tokens (it needs {pages} pages, plus "
            "the reserved page 0)",
        )
    try:
        mode_for(cfg.orchestrator)
    except ValueError as e:
        raise ConfigError("orchestrator.staleness_k", str(e)) from None


def resolve_model(cfg: ExperimentConfig) -> ExperimentConfig:
    """With ``model.hf_path``, the architecture comes from the checkpoint's ``config.json``
    (dtypes and remat stay as configured); otherwise ``cfg`` as it is."""
    m = cfg.model
    if m.hf_path is None:
        return cfg
    try:
        hf = load_hf_config(
            m.hf_path,
            param_dtype=m.param_dtype,
            compute_dtype=m.compute_dtype,
            remat=m.remat,
            hf_path=m.hf_path,
            attention=m.attention,
            attention_block=m.attention_block,
            seq_chunk=m.seq_chunk,
        )
    except UnsupportedModelError as e:
        what = str(e).removeprefix("config.json: ")
        where = Path(m.hf_path) / "config.json"
        raise ExperimentError(f"{where}: {what} (model.hf_path)") from None
    try:
        return dataclasses.replace(cfg, model=hf)
    except ConfigError as e:
        raise ExperimentError(f"{m.hf_path}/config.json does not fit the run: {e}") from None


def build(
    cfg: ExperimentConfig,
    run_dir: Path,
    on_warm_step: Callable[[int, float], None] | None = None,
    warm_start_dir: Path | None = None,
    process=None,
    *,
    restoring: bool = False,
    on_checked: Callable[[], None] | None = None,
) -> Experiment:
    """Everything a run needs; the warm start is cached in ``warm_start_dir`` (default
    ``run_dir / "warm_start"``), so runs that share it start from the same policy. With a
    ``process`` (``dora_jax.distributed.process.Process``, index 0 of several), rollout groups
    on the other processes' devices run there. With ``restoring`` (a checkpoint will replace the
    policy) the warm start is not run. ``on_checked`` is called once every check that can refuse
    the run has passed (the config, the model files, the data and eval files, the tokenizer, the
    reward function), before anything is written (the warm start's cache): the train command
    takes the run directory there, so that a refused run leaves it as it was."""
    cfg = resolve_model(cfg)
    if cfg.model.hf_path is not None:  # its files' headers and sizes, before any write
        check_hf_checkpoint(cfg.model.hf_path, cfg.model)
    check_fits(cfg)
    meshes = build_meshes(cfg.mesh)
    slow_bf16 = cpu_bfloat16_note(cfg.model.compute_dtype, jax.devices()[0].platform)
    if slow_bf16:
        print(f"note: {slow_bf16}", flush=True)
    plan = _memory_plan(cfg, meshes)  # before anything is allocated
    cfg = resolve_pages(cfg, plan)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    note = check_vocabularies(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer)
    if note:
        print(f"note: {note}", flush=True)
    if cfg.data.tokenizer == "hf":
        where = getattr(tokenizer, "chat_template_source", None)
        print(
            f"chat template: {where}"
            if where
            else f"note: {cfg.model.hf_path} has no chat template: prompts are used as they are",
            flush=True,
        )
    d = cfg.data
    encode = functools.partial(
        encode_chat, tokenizer, system_prompt=d.system_prompt, template=d.prompt_template
    )
    source, reward_fn, example, long_skipped = task_parts(cfg, encode)
    clock, bus = make_clock(cfg.orchestrator.clock), Bus()
    reward, eval_reward = scorers(cfg, reward_fn, clock.now)
    stops = eos_ids(tokenizer)
    env = env_run(cfg, tokenizer, clock.now)
    if env is not None:  # the teacher plays the environment's episodes
        example = env_demonstrations(cfg, tokenizer, cfg.seed + 1_000_003)
    evaluator = make_evaluator(cfg, meshes, tokenizer, eval_reward, encode, env)
    if on_checked is not None:  # nothing above writes; everything below may
        on_checked()
    # the other processes build their groups' engines (and their part of a spanning trainer)
    # while this one warm-starts
    cluster = _cluster(cfg, meshes, process, bus, clock, stops)
    warm = example is not None and cfg.warm_start.steps > 0 and not restoring
    warm_dir = Path(warm_start_dir or run_dir / "warm_start").absolute()
    warm_key = repr((cfg.model, cfg.seed)) + (
        "" if cfg.data.median_steps == 3 else f" median_steps={cfg.data.median_steps}"
    )
    if env is not None:
        kwargs = sorted(teacher_kwargs(cfg.env.kwargs).items())
        warm_key += f" env={cfg.env.spec} {kwargs} {cfg.rollout}"
    losses: list[float] = []
    warmed: Params | None = None
    if warm:
        # The built-in task's warm start is small: it runs on one device (then is sharded).
        one = jax.tree.map(
            lambda _: SingleDeviceSharding(jax.local_devices()[0]), abstract_params(cfg.model)
        )
        start = jax.device_get(policy_params(cfg.model, cfg.seed, one, cfg.model.hf_path))
        warmed, losses = warm_start(
            start,
            cfg.model,
            cfg.warm_start,
            example,
            tokenizer,
            cache_dir=warm_dir,
            cache_key=warm_key,
            on_step=on_warm_step,
        )
    # Every trainer process builds its shards from the same source (the warm start is read back
    # from its cache directory by all of them); one process takes the warm start as it is.
    spanning = cluster is not None and len(processes(meshes.trainer)) > 1
    start_from = {"hf": str(warm_dir) if warmed is not None and spanning else cfg.model.hf_path}
    broadcast = cluster.trainer_broadcast(meshes.trainer) if spanning else None
    trainer = SpmdTrainer.start(
        cfg, meshes.trainer, start_from, broadcast, params=None if spanning else warmed
    )
    del warmed  # version 0 lives on as the trainer's export (engines alias it)
    trainer.adopt_compiled(plan.train_step, *plan.train_bucket)
    if _compiles_ahead(cfg, spanning=spanning):
        trainer.compile_ahead(cfg.orchestrator.train_batch_prompts * cfg.train.group_size)
    lg = cfg.logging  # the trajectories kept as text: the file's, or one for the terminal
    kept = max(lg.samples_per_step, int(lg.samples_every > 0))
    grpo = GRPOTrainer(
        trainer, tokenizer, reward, samples_per_step=kept, on_failure=cfg.data.on_failure
    )
    if cluster is not None and not cluster.transfers.via_store:
        grpo.export_shardings = cluster.link.stage_shardings()
    backend = EngineBackend(
        cfg.model,
        cfg.rollout,
        meshes.groups,
        stops,
        grpo.params_for(0),
        grpo.params_for,
        seed=cfg.seed,
        clock=clock,
        bus=bus,
        cluster=cluster,
        turns=env.driver if env is not None else None,
    )
    if reward.pool is not None:  # score each request as it finishes, in the workers
        backend.on_finished = grpo.prefetch
    skip = d.long_prompts == "skip"
    prompts = (
        env.prompts
        if env is not None
        else TokenizedPrompts(
            source,
            tokenizer,
            cfg.rollout.max_prompt_len,
            d.system_prompt,
            d.prompt_template,
            skip=skip,
        )
    )
    # (kept: where groups run beside the control loop, so does the trainer, on its own thread)
    runner = ThreadedTrainer(grpo, clock.now, bus.post) if clock.concurrent else grpo
    runtime = Runtime(cfg.orchestrator, cfg.train.group_size, backend, runner, prompts, clock=clock)
    return Experiment(
        cfg,
        meshes,
        tokenizer,
        reward,
        source,
        grpo,
        backend,
        runtime,
        losses,
        evaluator=evaluator,
        memory_plan=plan,
        prompts=prompts,
        long_prompt_lines=long_skipped,
        env=env,
    )


def _compiles_ahead(cfg: ExperimentConfig, spanning: bool) -> bool:
    """Whether the trainer compiles new batch shapes on a worker thread (``train.compile_shapes``):
    a trainer spanning processes runs each step in lockstep on all of them, so it compiles in
    line."""
    mode = cfg.train.compile_shapes
    if mode == "background" and spanning:
        raise ConfigError(
            "train.compile_shapes",
            "'background' needs the trainer in one process "
            "(this trainer mesh spans several); use 'auto' or 'inline'",
        )
    if mode == "auto":
        # (kept: compiling in the background pays where the trainer runs beside the rollout)
        return CLOCKS[cfg.orchestrator.clock].concurrent and not spanning
    return mode == "background"


MEMORY_PLAN_FILE = "memory_plan.txt"


def _memory_plan(cfg: ExperimentConfig, meshes: Meshes) -> MemoryPlan:
    """The memory plan: a config that does not fit is refused (ExperimentError, with the whole
    plan); else it is printed as one line (in full with ``logging.memory_plan``). Nothing is
    written here: :func:`write_memory_plan` writes it to the run dir once the run is accepted."""
    try:
        plan = plan_memory(cfg, meshes)
        plan.check()
    except MemoryPlanError as e:
        raise ExperimentError(str(e)) from None
    if cfg.logging.memory_plan:
        print(plan.table(), flush=True)
    else:
        print(f"{plan.summary()} (in full: {MEMORY_PLAN_FILE} in the run dir)", flush=True)
    return plan


def write_memory_plan(exp: Experiment, run_dir: Path) -> Path | None:
    """Write the experiment's full per-device memory plan to ``run_dir/memory_plan.txt``; call
    it once every check that can refuse the run has passed (a refused run writes nothing)."""
    if exp.memory_plan is None:
        return None
    return exp.memory_plan.write(Path(run_dir) / MEMORY_PLAN_FILE)


def _cluster(
    cfg: ExperimentConfig, meshes: Meshes, process, bus: Bus, clock, stops: tuple[int, ...]
):
    """The other processes of a multi-process run, their groups' engines built (None alone).
    ``cfg`` is the resolved config (``rollout.num_pages`` sized by the memory plan): the other
    processes build their engines from it and from the EOS ids ``stops``."""
    if process is None or process.count == 1:
        return None
    from dora_jax.config import to_dict
    from dora_jax.distributed.cluster import Cluster
    from dora_jax.distributed.process import ProcessError
    from dora_jax.mesh import make_mesh
    from dora_jax.sharding import rollout_rules

    cluster = Cluster(process)
    if process.index not in processes(meshes.trainer):
        raise ProcessError(
            "the trainer mesh must include process 0's devices (process 0 leads "
            "the train steps): check mesh.trainer.devices"
        )
    r = cfg.mesh.rollout
    staging: list = []

    def stage_shardings():  # the group layout on process 0's devices, for weights going out
        if not staging:
            mesh = make_mesh(jax.local_devices()[: r.group_size], 1, r.tp, r.expert)
            staging.append(
                tree_shardings(
                    param_axes(cfg.model), abstract_params(cfg.model), rollout_rules(), mesh
                )
            )
        return staging[0]

    cluster.connect(bus.post, clock.now, stage_shardings, processes(meshes.trainer))
    cluster.start_hosts(to_dict(cfg), list(stops), cfg.seed, cfg.orchestrator.clock)
    return cluster


def run(
    exp: Experiment,
    num_steps: int,
    on_step: Callable[[StepLog], None] | None = None,
    max_ticks: int = 10_000_000,
    *,
    checkpointer=None,
    every_steps: int = 0,
    should_stop: Callable[[], bool] | None = None,
    observers: tuple[Observer, ...] = (),
) -> RunResult:
    """Run until ``num_steps`` more train steps have been published. Observers, in order, at
    every published version: ``on_step`` sees each new step log, versions no longer needed are
    freed, ``observers`` (metrics, evaluation), then the checkpointer saves every
    ``every_steps`` steps (last, so a checkpoint at step ``n`` comes after step ``n``'s log
    lines). When ``should_stop()`` turns true (SIGTERM) the run stops early (``exp.stopped`` is
    set); with a checkpointer, the end or the stop is saved too.

    No train step starts beyond ``train.total_steps`` (or beyond this call's target when that is
    larger): ``total_steps`` is the number of updates, and a logical run that stops earlier still
    starts the next step in the same round as an uninterrupted run would."""
    rt = exp.runtime
    rt.observers = [_StepLogs(exp, on_step), _FreeVersions(exp), *observers]
    if checkpointer is not None:
        rt.observers.append(_Checkpoints(exp, checkpointer, every_steps))
    if not exp.grpo.keep_log:  # the step logs are written out: the published ones go
        rt.observers.append(_TrimLogs(exp))
    rt.max_steps = max(exp.cfg.train.total_steps, rt.steps_done + num_steps)
    t0 = time.perf_counter()
    try:
        result = rt.run(
            num_steps,
            max_ticks=max_ticks,
            stall_s=exp.cfg.orchestrator.stall_s,
            should_stop=should_stop,
        )
    except Exception as e:
        if checkpointer is not None and rt.at_step_end:
            _save_before_failing(exp, checkpointer, e)
        raise
    finally:
        rt.observers = []
        exp.wall_s += time.perf_counter() - t0
    exp.stopped = rt.stopped
    if checkpointer is not None:
        _save_and_wait(exp, checkpointer)  # the end of the run, or the stop
    return result


def _save_and_wait(exp: Experiment, checkpointer) -> None:
    """Save now, with the run held still, and wait until the save is complete."""
    with exp.runtime.quiesce():
        checkpointer.save(exp)
    checkpointer.wait()


def _save_before_failing(exp: Experiment, checkpointer, error: Exception) -> None:
    """An observer of a published step raised (evaluation, metrics, a logger): the run's state
    is that step's end, as a checkpoint saves it, so it is saved before the error ends the run
    (an error elsewhere in a round leaves a state half changed: the last checkpoint stands).
    One line says which it was; a save that fails too leaves the error to the caller."""
    if isinstance(error, CheckpointSaveError):
        return  # the checkpointer is the one that failed
    what = f"{type(error).__name__} after step {exp.runtime.steps_done} was published"
    try:
        _save_and_wait(exp, checkpointer)
    except Exception as e:  # noqa: BLE001  (the first error is the one to report)
        print(f"warning: {what}; no checkpoint of that step ({e})", file=sys.stderr)
    else:
        print(f"note: {what}: saved a checkpoint of that step first", file=sys.stderr)


class _StepLogs:
    """Hands the step log of each published version to ``on_step`` (a logical run's step runs
    when its batch is taken, a few ticks before it is published)."""

    def __init__(self, exp: Experiment, on_step: Callable[[StepLog], None] | None):
        self.exp, self.on_step, self.seen = exp, on_step, exp.runtime.steps_done

    def on_publish(self, runtime: Runtime, version: int) -> None:
        for log in self.exp.grpo.step_logs(self.seen):
            if log.version > version:
                break
            if self.on_step is not None:
                self.on_step(log)
            self.seen += 1


class _TrimLogs:
    """Last at every published version of a run with history files: the step logs of the
    published versions have been seen by every observer (metrics.jsonl holds them): they go."""

    def __init__(self, exp: Experiment):
        self.exp = exp

    def on_publish(self, runtime: Runtime, version: int) -> None:
        self.exp.grpo.trim_log(version)


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class _FreeVersions:
    """Frees the params of versions nothing needs any more (versions appear only on publish),
    and every :data:`TRIM_EVERY` versions hands the host memory freed since back to the system
    (:func:`~dora_jax.platform.release_free_memory`: resident memory follows the live heap)."""

    def __init__(self, exp: Experiment):
        self.exp = exp

    def on_publish(self, runtime: Runtime, version: int) -> None:
        backend = self.exp.backend  # (groups out of the run too: their requests need them)
        recovery = getattr(backend, "recovery", None)
        held = recovery.versions_held() if recovery else {g.version for g in backend.groups()}
        self.exp.grpo.forget(held | {self.exp.grpo.version})
        if version % TRIM_EVERY == 0:
            release_free_memory()


TRIM_EVERY = 10


class _Checkpoints:
    """Saves every ``every`` steps (0: never here); at every step, stops the run if an
    asynchronous save failed."""

    def __init__(self, exp: Experiment, checkpointer, every_steps: int):
        self.exp, self.checkpointer, self.every = exp, checkpointer, every_steps

    def on_publish(self, runtime: Runtime, version: int) -> None:
        self.checkpointer.check()
        if self.every and runtime.steps_done % self.every == 0:
            with runtime.quiesce():
                self.checkpointer.save(self.exp)
