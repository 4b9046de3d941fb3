"""The ``train`` command: parse arguments, resolve the config, run the experiment, report.

A run directory gets: ``config.yaml`` (resolved), ``warm_start/`` (cached), ``metrics.jsonl``,
``tb/`` (TensorBoard), ``timeline.png``, ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dora_jax.config import ConfigError, ExperimentConfig, dump_yaml, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
MODES = ("sync", "one_step", "partial", "oversample", "dora")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python launch/train.py",
        description="GRPO-style RL post-training with DORA multi-version asynchronous rollout.",
    )
    p.add_argument(
        "--config", type=Path, default=None, help="YAML preset (default: configs/default.yaml)"
    )
    p.add_argument("--mode", choices=MODES, help="shortcut for orchestrator.mode=MODE")
    p.add_argument("--steps", type=int, default=None, help="shortcut for train.total_steps=N")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run_dir from its latest checkpoint",
    )
    m = p.add_argument_group("several processes (one per host; see docs/multihost.md)")
    m.add_argument(
        "--local-processes",
        type=int,
        default=0,
        metavar="N",
        help="start N processes on this machine (testing; users without a scheduler)",
    )
    m.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="with --local-processes: fake CPU devices per process (default 8 / N)",
    )
    m.add_argument(
        "--pin-cores",
        action="store_true",
        help="with --local-processes: pin each process to its own CPU core",
    )
    m.add_argument("--coordinator", help="host:port of process 0 (else DORA_COORDINATOR, or the "
                                         "scheduler's: SLURM, Open MPI, Cloud TPU)")  # fmt: skip
    m.add_argument("--num-processes", type=int, help="processes in the run (DORA_NUM_PROCESSES)")
    m.add_argument("--process-id", type=int, help="this process's index (DORA_PROCESS_ID)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="dotted overrides, e.g. train.lr=1e-6",
    )
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"orchestrator.mode={args.mode}")
    if args.steps is not None:
        overrides.append(f"train.total_steps={args.steps}")
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    return load_config(path, overrides)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_config(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.local_processes:
        return _launch_local(args, argv, cfg)
    from dora_jax.distributed.process import ProcessError, initialize, spec_from

    proc = None
    try:
        spec = spec_from(args)
        if spec is not None:
            proc = initialize(spec)
    except ProcessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if proc is not None and not proc.is_main:
        from dora_jax.distributed.host import serve

        return serve(proc)
    from dora_jax.checkpoint import CheckpointError as RunCheckpointError
    from dora_jax.data.jsonl import DataError
    from dora_jax.model.hf_checkpoint import CheckpointError
    from dora_jax.model.tokenizer import TokenizerError
    from dora_jax.pipeline.experiment import ExperimentError

    try:
        return train(cfg, resume=args.resume, proc=proc)
    except (
        ConfigError,
        DataError,
        CheckpointError,
        TokenizerError,
        ExperimentError,
        RunCheckpointError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _StopFlag:
    """Set by SIGINT/SIGTERM: the run saves a checkpoint at the next tick and exits."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        import signal

        def handler(signum, frame):
            if self.signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.signal = signum
            print(
                f"\nsignal {signum}: saving a checkpoint at the next tick, then stopping",
                file=sys.stderr,
                flush=True,
            )

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def _launch_local(args: argparse.Namespace, argv: list[str], cfg: ExperimentConfig) -> int:
    from dora_jax.distributed.launcher import launch_local

    n = args.local_processes
    k = args.devices_per_process or max(1, 8 // n)
    rest, skip = [], False
    for a in argv:  # the children get everything but the launcher's own flags
        if skip:
            skip = False
            continue
        if a in ("--local-processes", "--devices-per-process"):
            skip = True
            continue
        if a.startswith(("--local-processes=", "--devices-per-process=")) or a == "--pin-cores":
            continue
        rest.append(a)
    return launch_local(n, rest, Path(cfg.run_dir), devices_per_process=k,
                        pin_cores=args.pin_cores)  # fmt: skip


def train(cfg: ExperimentConfig, resume: bool = False, proc=None) -> int:
    """The train command as phases: run dir, build (warm start), checkpoints (resume), the run
    loop with its observers (metrics, held-out evaluation, checkpoints), final evaluation and
    reports."""
    from dora_jax.pipeline.experiment import run
    from dora_jax.pipeline.observers import HeldOutEval, MetricsLog
    from dora_jax.pipeline.run_report import write_run_report

    run_dir = Path(cfg.run_dir)
    t_start = time.perf_counter()
    _announce(cfg, run_dir)
    if proc is not None:  # a peer that dies ends this process with a message (exit 3)
        proc.on_peer_lost = lambda what: _resume_hint(run_dir, proc)
        proc.start_watchdog()
    exp = _build(cfg, run_dir, proc)
    wandb_log = None
    try:
        checkpointer = _open_checkpoints(exp, run_dir, resume)
        if checkpointer is None:
            return 2
        warm_start_s = time.perf_counter() - t_start
        if cfg.logging.wandb:  # process 0 only: the others serve their groups (see main)
            from dora_jax.wandb_log import WandbLog

            wandb_log = WandbLog(cfg, run_dir)
        metrics = MetricsLog(exp, run_dir, resume, mirror=wandb_log)
        evals = HeldOutEval(exp, run_dir, cfg, resume, echo=metrics.echo, mirror=wandb_log)
        if exp.runtime.steps_done == 0:
            evals.at(0)  # before the first step
        stop = _StopFlag()
        stop.install()
        result = run(
            exp,
            max(cfg.train.total_steps - exp.runtime.steps_done, 0),
            checkpointer=checkpointer,
            every_steps=cfg.checkpoint.every_steps,
            should_stop=stop,
            observers=(metrics, evals),
        )
        metrics.close()
        if not exp.stopped:
            evals.at(exp.runtime.steps_done)
        evals.close()
        write_run_report(exp, result, evals, run_dir, time.perf_counter() - t_start, warm_start_s)
    finally:
        if wandb_log is not None:
            wandb_log.close()
        exp.close()
        if proc is not None:
            proc.finish()
    return 0


def _resume_hint(run_dir: Path, proc) -> str:
    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*") if p.is_dir())
    last = (
        f"the last checkpoint is {run_dir / 'checkpoints' / str(ckpts[-1])}"
        if ckpts
        else "there is no checkpoint yet"
    )
    return (
        f"Stopping; {last}. Continue with the same processes and: python launch/train.py "
        f"--resume run_dir={run_dir}"
    )


def _announce(cfg: ExperimentConfig, run_dir: Path) -> None:
    from dora_jax.model import count_params

    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    o = cfg.orchestrator
    print(
        f"dora_jax: mode={o.mode} clock={o.clock} K={o.staleness_k} TBS={o.train_batch_prompts} "
        f"RBS={o.rollout_batch_prompts} G={cfg.train.group_size}; policy {cfg.model.family} "
        f"({count_params(cfg.model):,} params); run dir {run_dir}"
    )


def _build(cfg: ExperimentConfig, run_dir: Path, proc=None):
    """The experiment, with a progress bar over the warm start."""
    from dora_jax.metrics import progress
    from dora_jax.pipeline.experiment import build

    bar = progress(cfg.warm_start.steps, "warm start", enabled=cfg.logging.progress)

    def on_warm(i: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    try:
        exp = build(cfg, run_dir, on_warm, process=proc)
    finally:
        bar.close()
    if exp.warm_start_losses:
        print(
            f"warm start: {len(exp.warm_start_losses)} steps, loss "
            f"{exp.warm_start_losses[0]:.3f} -> {exp.warm_start_losses[-1]:.3f}"
        )
    groups = ", ".join(
        f"g{i}:{[d.id for d in m.devices.flat]}" for i, m in enumerate(exp.meshes.groups)
    )
    print(f"trainer mesh {dict(exp.meshes.trainer.shape)}; rollout groups {groups}")
    return exp


def _open_checkpoints(exp, run_dir: Path, resume: bool):
    """The run's checkpointer, after restoring the latest checkpoint (``resume``); None (with
    an error printed) when a fresh run would overwrite checkpoints."""
    from dora_jax.checkpoint import RunCheckpointer

    cfg = exp.cfg
    ckpt_dir = run_dir / "checkpoints"
    if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        print(
            f"error: {ckpt_dir} already holds checkpoints: pass --resume to continue that run, "
            "or choose another run_dir",
            file=sys.stderr,
        )
        return None
    checkpointer = RunCheckpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    if resume:
        tick = checkpointer.restore_latest(exp)
        print(
            f"resumed from {ckpt_dir}/{tick}: {exp.runtime.steps_done} steps done, "
            f"{exp.backend.live_requests()} requests in flight"
        )
    return checkpointer
