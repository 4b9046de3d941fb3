"""The ``train`` command: parse arguments, resolve the config, run the experiment, report.

A run directory gets: ``config.yaml`` (resolved), ``memory_plan.txt`` (the per-device memory
plan), ``warm_start/`` (cached), ``metrics.jsonl``, ``tb/`` (TensorBoard), ``timeline.png``,
``summary.json`` and ``summary.md``.

Misuse and faults (``docs/reliability.md``): a refused run changes nothing in its run dir (every
check comes before the first write); a run holds the dir's lock while it writes; ``--resume``
continues from the checkpoint's own config (:mod:`dora_jax.resume`); a bad input exits 2 with one
line naming the file, line or field; a signal before the run loop saves nothing and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import get_args

from dora_jax.config import ConfigError, ExperimentConfig, dump_yaml, load_config, schema

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _steps(text: str) -> int:
    """``--steps``: a whole number of train steps, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python launch/train.py",
        description="GRPO-style RL post-training with DORA multi-version asynchronous rollout.",
    )
    p.add_argument(
        "--config", type=Path, default=None, help="YAML preset (default: configs/default.yaml)"
    )
    modes = get_args(schema.Mode)  # the built-in modes and those registered
    p.add_argument("--mode", choices=modes, help="shortcut for orchestrator.mode=MODE")
    p.add_argument(
        "--steps", type=_steps, default=None, help="shortcut for train.total_steps=N (N >= 1)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run_dir from its latest checkpoint",
    )
    m = p.add_argument_group(
        "several processes (one per host; see docs/multihost.md)",
        "The coordinator and transfer listeners authenticate nothing: keep them on a private "
        "network. They bind to the coordinator's host (process 0) or this machine's address "
        "towards it; DORA_BIND_ADDRESS=ADDR binds them to ADDR instead.",
    )
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
    m.add_argument(
        "--coordinator",
        help="host:port of process 0 (else DORA_COORDINATOR, or the "
        "scheduler's: SLURM, Open MPI, Cloud TPU)",
    )
    m.add_argument("--num-processes", type=int, help="processes in the run (DORA_NUM_PROCESSES)")
    m.add_argument("--process-id", type=int, help="this process's index (DORA_PROCESS_ID)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="dotted overrides, e.g. train.lr=1e-6",
    )
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"orchestrator.mode={args.mode}")
    if args.steps is not None:
        overrides.append(f"train.total_steps={args.steps}")
    return overrides


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    """A fresh run's config: the preset (default ``configs/default.yaml``), then the overrides."""
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    return load_config(path, _overrides(args))


def resume_hint(run_dir: str | Path) -> str:
    from dora_jax.pipeline.run_report import resume_hint as hint

    return hint(run_dir)


def main(argv: list[str]) -> int:
    try:
        with _project_log_lines():
            return _main(argv)
    except KeyboardInterrupt:  # a second signal, or one before our handlers were installed
        print("\ninterrupted: stopped at once", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _project_log_lines():
    """While the command runs, the package's log records reach stderr as the command's other
    lines do (``warning: ...``), not in the logging module's default ``WARNING:name:`` form."""
    import logging

    class Lines(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.levelname.lower()}: {record.getMessage()}"

    log = logging.getLogger("dora_jax")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Lines())
    handler.setLevel(logging.WARNING)
    propagate = log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def _main(argv: list[str]) -> int:
    from dora_jax.resume import resolve, run_dir_of

    args = parse_args(argv)
    default = DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None
    try:  # a resumed run's config is read by process 0 alone (below)
        cfg = None if args.resume else resolve_config(args)
        run_dir = Path(cfg.run_dir) if cfg else run_dir_of(args.config or default, _overrides(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.local_processes:
        return _launch_local(args, argv, run_dir)
    from dora_jax.distributed.process import ProcessError, initialize, spec_from

    proc = None
    try:
        spec = spec_from(args)
        if spec is not None:
            _refuse_ended_launch(spec, run_dir)
            proc = initialize(spec)
    except ProcessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if proc is not None and proc.is_main:
        from dora_jax.distributed.launcher import term_with_launcher

        term_with_launcher()  # (with --local-processes: a killed launcher stops the run)
    if proc is not None and not proc.is_main:
        from dora_jax.distributed.host import serve

        # process 0 gone: this terminal too says where the run goes on from. The runtime may
        # end this process at once when its coordinator dies, before any handler of ours runs,
        # so it is said at the start as well.
        print(
            f"process {proc.index}: if process 0 ends, this process ends too; the run then goes "
            f"on from its last checkpoint with: {resume_hint(run_dir)}",
            flush=True,
        )
        proc.on_peer_lost = lambda what: _resume_hint(run_dir, proc)
        return serve(proc)
    if cfg is None:
        try:  # the checkpoint's config, changed only where the command line says so
            cfg, _, _, _ = resolve(args.config, _overrides(args), default_config=default)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    from dora_jax.checkpoint import CheckpointError, CheckpointSaveError
    from dora_jax.data.jsonl import DataError
    from dora_jax.model.hf_checkpoint import HFCheckpointError
    from dora_jax.model.tokenizer import TokenizerError
    from dora_jax.pipeline.experiment import ExperimentError, resolve_model
    from dora_jax.pipeline.grpo import PromptTooLong
    from dora_jax.run_dir import RunDirBusy, RunDirError

    try:
        cfg = resolve_model(cfg)  # model.hf_path: the architecture of its config.json
        return train(cfg, resume=args.resume, proc=proc)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (
        DataError,
        HFCheckpointError,
        TokenizerError,
        ExperimentError,
        CheckpointError,
        CheckpointSaveError,
        PromptTooLong,
        RunDirBusy,
        RunDirError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a file system gone read-only, ...
        where = f": {e.filename}" if e.filename else ""
        print(
            f"error: {e.strerror or e}{where}; the run stopped (its last checkpoint is usable: "
            f"{resume_hint(cfg.run_dir)})",
            file=sys.stderr,
        )
        return 2
    except Exception as e:  # noqa: BLE001  (a bug: keep the traceback, say what is left)
        traceback.print_exc()
        print(
            f"error: the run crashed ({type(e).__name__}); its run dir is usable: "
            f"{_last_checkpoint(cfg.run_dir)}",
            file=sys.stderr,
        )
        return 1


def _refuse_ended_launch(spec, run_dir: Path) -> None:
    """A host's command of a local launch started after that run ended: one line at once (not
    a wait for a process 0 that is gone), naming the command that continues the run."""
    from dora_jax.distributed.launcher import ended_launch
    from dora_jax.distributed.process import ProcessError

    pid = ended_launch(run_dir, spec.process_id or 0)
    if pid is not None:
        raise ProcessError(
            f"process {spec.process_id}: the run this command joins has ended (its process 0, "
            f"pid {pid}, is gone): nothing to join. The run goes on from its last checkpoint "
            f"with: {resume_hint(run_dir)}"
        )


def interrupted_message(signum: int) -> str:
    import signal

    return (
        f"{signal.Signals(signum).name} during the warm start or setup: stopped; nothing was "
        "saved (the first checkpoint is written once training runs); the same command starts over"
    )


class _StopFlag:
    """SIGINT/SIGTERM. Before :meth:`arm` (warm start, setup) a signal stops the process at once:
    nothing is saved, the message says so, the run dir's lock is released (``on_abort``) and the
    process exits with 128 + the signal number, without unwinding through the computations in
    flight. Once armed, it sets the flag: the run saves a checkpoint at the next tick and exits;
    a second signal stops at once (a SIGTERM after a SIGTERM does not: a scheduler may repeat its
    notice, and its hard stop is a SIGKILL)."""

    def __init__(self, on_abort=None):
        self.signal: int | None = None
        self.armed = False
        self.on_abort = on_abort
        self._previous: dict = {}

    def __call__(self) -> bool:
        return self.signal is not None

    def arm(self) -> None:
        self.armed = True

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if not self.armed:
                print(f"\n{interrupted_message(signum)}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                if self.on_abort is not None:
                    self.on_abort()
                os._exit(128 + signum)
            if self.signal is not None:  # a second signal: stop now, unless a SIGTERM again
                if signum == signal.SIGTERM and self.signal == signal.SIGTERM:
                    # (a scheduler's repeated notice: the save goes on; its hard stop, if it
                    # comes, is a SIGKILL)
                    print(
                        "\nsignal 15 again: still saving the checkpoint (SIGINT stops at once)",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                raise KeyboardInterrupt
            self.signal = signum
            print(
                f"\nsignal {signum}: saving a checkpoint at the next tick, then stopping",
                file=sys.stderr,
                flush=True,
            )

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, handler)

    def uninstall(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _launch_local(args: argparse.Namespace, argv: list[str], run_dir: Path) -> int:
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
    code = launch_local(n, rest, run_dir, devices_per_process=k, pin_cores=args.pin_cores)
    if code < 0:  # process 0 was killed: it could not say how to go on, so the launcher does
        import shlex
        import signal

        from dora_jax.distributed.launcher import local_flags
        from dora_jax.pipeline.run_report import resume_hint

        flags = shlex.join(local_flags(n, k, args.pin_cores))
        print(
            f"error: process 0 was killed ({signal.Signals(-code).name}); "
            f"{_last_checkpoint(run_dir, resume_hint(run_dir, flags))}",
            file=sys.stderr,
        )
        return 128 - code  # as a shell reports a process killed by that signal
    return code


def train(cfg: ExperimentConfig, resume: bool = False, proc=None) -> int:
    """The train command as phases: checks that need no write (a fresh run into a dir with
    checkpoints; in build: the config, data, tokenizer, reward and eval files), then the run dir
    and its lock, build's writes (warm start), checkpoints (resume), the run
    loop with its observers (metrics, held-out evaluation, health, checkpoints), final
    evaluation and reports. With several processes only process 0 gets here."""
    from dora_jax.checkpoint import finished_steps
    from dora_jax.run_dir import RunDirLock

    run_dir = Path(cfg.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not resume and finished_steps(ckpt_dir):
        print(
            f"error: {ckpt_dir} already holds checkpoints: pass --resume to continue that run "
            f"({resume_hint(run_dir)}), or choose another run_dir",
            file=sys.stderr,
        )
        return 2
    lock = RunDirLock(run_dir)  # taken at the first write (build's on_checked)
    stop = _StopFlag(on_abort=lock.release)
    stop.install()
    try:
        return _train(cfg, run_dir, resume, stop, proc, lock)
    except KeyboardInterrupt:  # a second signal in the run loop: stop at once
        print(f"\ninterrupted: stopped at once; {_last_checkpoint(run_dir)}", file=sys.stderr)
        return 130
    finally:
        stop.uninstall()
        lock.release()


def _train(cfg: ExperimentConfig, run_dir: Path, resume: bool, stop, proc, lock) -> int:
    from dora_jax.checkpoint import finished_steps
    from dora_jax.metrics import read_metrics
    from dora_jax.pipeline.experiment import run, write_memory_plan
    from dora_jax.pipeline.health import NoRolloutGroups, RunHealth
    from dora_jax.pipeline.observers import HeldOutEval, MetricsLog
    from dora_jax.pipeline.run_report import write_run_report
    from dora_jax.run_dir import create, start_over

    t_start = time.perf_counter()
    restoring = resume and bool(finished_steps(run_dir / "checkpoints"))

    def claim() -> None:
        """The run's first write, once every check that can refuse it has passed: the run dir,
        its lock, and for a fresh run the earlier run's logs gone and config.yaml written."""
        create(run_dir)
        lock.acquire()
        if lock.took_over:
            print(f"note: {run_dir} was held by a run that is gone ({lock.took_over}); taking over")
        if not restoring:
            if resume:
                print(
                    f"note: {run_dir} has no finished checkpoint yet: starting from step 0 with "
                    "its saved config"
                )
            removed = start_over(run_dir)
            if removed:
                print(
                    f"note: removed {', '.join(removed)} of an earlier run that left no checkpoint"
                )
            dump_yaml(cfg, run_dir / "config.yaml")

    _announce(cfg, run_dir)
    if proc is not None:  # a peer that dies ends this process with a message (exit 3)
        proc.on_peer_lost = lambda what: _resume_hint(run_dir, proc)
        proc.start_watchdog()
    exp = _build(cfg, run_dir, restoring, proc, on_checked=claim)
    checkpointer = None
    wandb_log = None
    try:
        checkpointer = _open_checkpoints(exp, run_dir, restoring)
        # every check that can refuse the run has passed (a resumed run's: with the restore)
        write_memory_plan(exp, run_dir)
        for name in exp.stream_history(run_dir, resume=restoring):
            print(
                f"warning: {run_dir / name} is shorter than the checkpoint says (it was cut or "
                "replaced): the summary and timeline will miss the part that is gone"
            )
        warm_start_s = time.perf_counter() - t_start
        if cfg.logging.wandb:  # process 0 only: the others serve their groups (see main)
            from dora_jax.wandb_log import WandbLog

            wandb_log = WandbLog(cfg, run_dir)
        metrics = MetricsLog(exp, run_dir, restoring, mirror=wandb_log)
        evals = HeldOutEval(exp, run_dir, cfg, restoring, echo=metrics.echo, mirror=wandb_log)
        logged = run_dir / "metrics.jsonl"  # (cut to the checkpoint by MetricsLog)
        history = read_metrics(logged) if restoring and logged.is_file() else []
        health = RunHealth(exp, echo=metrics.echo, history=history)
        no_groups = NoRolloutGroups(exp, run_dir, echo=metrics.echo)
        if exp.runtime.steps_done == 0:
            evals.at(0)  # before the first step
        stop.arm()  # from here a signal saves a checkpoint at the next tick
        result = run(
            exp,
            max(cfg.train.total_steps - exp.runtime.steps_done, 0),
            checkpointer=checkpointer,
            every_steps=cfg.checkpoint.every_steps,
            should_stop=lambda: stop() or health.tripped is not None or no_groups(),
            observers=(metrics, evals, health),
        )
        metrics.close()
        if not exp.stopped:
            evals.at(exp.runtime.steps_done)
        evals.close()
        write_run_report(
            exp,
            result,
            evals,
            run_dir,
            time.perf_counter() - t_start,
            warm_start_s,
            health=health,
        )
        for tripped in (health.tripped, no_groups.tripped):
            if tripped:
                print(f"error: {tripped}; {_last_checkpoint(run_dir)}", file=sys.stderr)
                return 1
        return 0
    except BaseException:
        if checkpointer is not None:  # finish the save in progress: it stays usable
            with contextlib.suppress(Exception):  # (or it failed too: its temporary dir goes)
                checkpointer.wait()
            checkpointer.discard_unfinished()
        raise
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if wandb_log is not None:
            wandb_log.close()
        exp.close()
        if proc is not None:
            proc.finish()


def _last_checkpoint(run_dir: Path, command: str | None = None) -> str:
    """The newest finished checkpoint of ``run_dir`` and the command that resumes from it
    (``command``, default :func:`resume_hint`'s)."""
    from dora_jax.checkpoint import finished_steps

    steps = finished_steps(Path(run_dir) / "checkpoints")
    if not steps:
        return "there is no checkpoint yet (the same command starts over)"
    last = Path(run_dir) / "checkpoints" / str(steps[-1])
    return f"the last checkpoint is {last}; continue with: {command or resume_hint(run_dir)}"


def _resume_hint(run_dir: Path, proc) -> str:
    from dora_jax.checkpoint import finished_steps
    from dora_jax.distributed.launcher import launch_flags

    steps = finished_steps(run_dir / "checkpoints")
    if steps:
        last = f"the last checkpoint is {run_dir / 'checkpoints' / str(steps[-1])}"
    elif proc.is_main:
        last = "there is no checkpoint yet"
    else:  # (the run dir may be process 0's machine's alone)
        last = f"the run's checkpoints are process 0's, in {run_dir / 'checkpoints'} on its machine"
    how = "" if launch_flags() else " the same processes and"
    return f"Stopping; {last}. Continue with{how}: {resume_hint(run_dir)}"


def _announce(cfg: ExperimentConfig, run_dir: Path) -> None:
    from dora_jax.model import count_params

    o = cfg.orchestrator
    k = f"auto[{o.k_min},{o.k_max}]" if o.auto_k else o.staleness_k
    print(
        f"dora_jax: mode={o.mode} clock={o.clock} K={k} TBS={o.train_batch_prompts} "
        f"RBS={o.rollout_batch_prompts} G={cfg.train.group_size}; policy {cfg.model.family} "
        f"({count_params(cfg.model):,} params); run dir {run_dir}"
    )


def _build(
    cfg: ExperimentConfig, run_dir: Path, restoring: bool = False, proc=None, on_checked=None
):
    """The experiment, with a progress bar over the warm start (none when ``restoring``: the
    checkpoint brings the policy)."""
    from dora_jax.metrics import progress
    from dora_jax.pipeline.experiment import build

    steps = 0 if restoring else cfg.warm_start.steps
    bar = progress(steps, "warm start", enabled=cfg.logging.progress and steps > 0)

    def on_warm(i: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    try:
        exp = build(cfg, run_dir, on_warm, process=proc, restoring=restoring, on_checked=on_checked)
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
    if exp.long_prompt_lines:
        lines = ", ".join(map(str, exp.long_prompt_lines[:20]))
        more = ", ..." if len(exp.long_prompt_lines) > 20 else ""
        print(
            f"note: data.long_prompts=skip left out {len(exp.long_prompt_lines)} prompt(s) "
            f"longer than rollout.max_prompt_len={cfg.rollout.max_prompt_len} "
            f"({cfg.data.path} {'lines' if cfg.data.task == 'jsonl' else 'rows'} {lines}{more})"
        )
    return exp


def _open_checkpoints(exp, run_dir: Path, restoring: bool):
    """The run's checkpointer, after restoring the latest checkpoint (``restoring``): the
    resumed config's changes are checked against it and printed; ``config.yaml`` is rewritten
    only once the restore has succeeded."""
    from dora_jax import resume
    from dora_jax.checkpoint import RunCheckpointer
    from dora_jax.config import from_dict

    cfg = exp.cfg
    ckpt_dir = run_dir / "checkpoints"
    checkpointer = RunCheckpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    if checkpointer.discarded:
        print(
            f"note: discarded {', '.join(checkpointer.discarded)} in {ckpt_dir}: a save that "
            "never completed (the run stopped while writing it)"
        )
    if not restoring:
        return checkpointer
    tick = checkpointer.restore_latest(exp)
    for path in checkpointer.moved_aside:
        print(f"warning: an unreadable checkpoint was moved to {path}; resumed from an older one")
    saved = from_dict(ExperimentConfig, checkpointer.saved_config)
    applied = resume.changes(saved, cfg)
    resume.check_restored(cfg, exp.runtime, applied)
    for c in applied:
        print(f"resume: {c} (applied)")
    dump_yaml(cfg, run_dir / "config.yaml")
    print(
        f"resumed from {ckpt_dir}/{tick}: {exp.runtime.steps_done} steps done, "
        f"{exp.backend.live_requests()} requests in flight"
    )
    return checkpointer
