"""Run checkpoints with orbax ``CheckpointManager``, and exact resume.

A checkpoint (one step directory, named by the train steps done) holds five items:

- ``train_state``: the trainer's state (params, optimizer state, version, skip counter), restored
  directly into the trainer's shardings;
- ``versions``: the params of every policy version the rollout side may still need (held by a
  group, or the trainer's newest), restored into the trainer's param shardings;
- ``host``: the run's plain-data state as ``{component: state}``, each component's own
  ``state_dict()`` (the control plane with everything in flight, the engines' requests with
  their tokens, logprobs and keys and the KV pages of running requests, so a resumed request
  continues without re-prefill, bit for bit; the trainer's unpublished step logs, the scorer's
  counts, the prompt cursor). Its size follows the work in flight, not the run's age: a run's
  history goes to files in its run directory (:mod:`dora_jax.orchestrator.history`), of which
  the checkpoint stores the lengths. It is stored as JSON text plus the large numpy arrays
  (:mod:`dora_jax.state_codec`): reading it never unpickles;
- ``config``: the resolved config (JSON): a resumed run starts from it (:mod:`dora_jax.resume`);
- ``meta``: the host state's format (:data:`HOST_FORMAT`), the steps done, the tick.

What is saved is a :class:`RunState` (the assembled experiment implements it): this module reads
no component's fields and imports nothing of the assembly.

A checkpoint is taken between control rounds with no train step running on a worker (the wall
clock quiesces the groups first: :meth:`Runtime.quiesce`). Saves are atomic (orbax writes a
temporary directory and renames it when complete): a run killed mid-save leaves a temporary
directory, which the next run discards (and says so), and the previous checkpoint stays usable. A
checkpoint that cannot be read is moved to ``run_dir/unusable_checkpoints/`` when an older one is
restored instead, so the resumed run's saves never collide with it. A failed save raises
:class:`CheckpointSaveError` (the run stops).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp

from dora_jax import faults, state_codec
from dora_jax.config import ConfigError, ExperimentConfig, to_dict

log = logging.getLogger(__name__)
ITEMS = ("train_state", "versions", "host", "config", "meta")
# Format of the host item: 1 was a pickle (no ``meta`` item); 2 is JSON text plus arrays; 3 is
# ``{component: state}`` with the run's history in files beside the checkpoints; 4 records each
# request's computed KV length and conversation state (multi-turn episodes).
HOST_FORMAT = 4
TMP_MARK = ".orbax-checkpoint-tmp"
UNUSABLE_DIR = "unusable_checkpoints"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the current config."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, no permission): the run stops."""


def _one_line(e: BaseException) -> str:
    """A short cause: the operating system's reason when the error carries one (tensorstore
    reports it as ``[os_error_code='28']``), else the error's first 300 characters."""
    if isinstance(e, OSError) and e.errno:
        return f"{e.strerror or os.strerror(e.errno)} [errno {e.errno}]"
    text = " ".join(str(e).split())
    m = re.search(r"os_error_code='?(\d+)", text)
    if m:
        code = int(m.group(1))
        return f"{os.strerror(code)} [errno {code}]"
    return f"{type(e).__name__}: {text[:300]}"


SPACE_MARGIN = 1.1  # a save needs the checkpoint's size plus 10% free


def no_space(free: int, need: int) -> str | None:
    """Why ``free`` bytes cannot hold a checkpoint of about ``need`` bytes (with
    :data:`SPACE_MARGIN`), or None. Sizes are in KiB below 10 MiB, else MiB, free rounded down
    and what is needed rounded up, so the message shows free < needed."""
    limit = need * SPACE_MARGIN
    if free >= limit:
        return None
    unit, name = (2**10, "KiB") if max(free, limit) < 10 * 2**20 else (2**20, "MiB")

    def size(n: float, up: bool) -> str:
        return f"{(math.ceil if up else math.floor)(n / unit * 10) / 10:,.1f} {name}"

    return (
        f"no space left: {size(free, False)} free, the checkpoint needs about {size(need, True)} "
        f"({size(limit, True)} with a {SPACE_MARGIN - 1:.0%} margin)"
    )


class _QuietSaveFailures(logging.Filter):
    """Once a run's checkpointer is open, orbax's own reports of a failed background save (error
    logs with tracebacks, asyncio's reports of its write tasks' exceptions that nobody retrieved
    once the save was abandoned, and the 'Event loop is closed' errors tensorstore prints when
    its writes end after orbax gave up, possibly much later) are left out:
    :class:`CheckpointSaveError` reports the failure once, with its cause. Installed for the rest
    of the process."""

    def __init__(self):
        super().__init__()
        self._hook = self._unraisable = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "asyncio":  # "Task exception was never retrieved" of a failed write
            tb = record.exc_info[2] if record.exc_info else None
            files = [f.filename for f in traceback.extract_tb(tb)] if tb is not None else []
            return not any("orbax" in f for f in files) and "orbax" not in record.getMessage()
        return "orbax" not in record.pathname

    def _excepthook(self, tp, value, tb):
        if tp is RuntimeError and str(value) == "Event loop is closed":
            return
        self._hook(tp, value, tb)

    def _unraisablehook(self, u):
        if u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed":
            return
        self._unraisable(u)

    def install(self) -> None:
        if self._hook is None:
            logging.getLogger("absl").addFilter(self)
            logging.getLogger("asyncio").addFilter(self)
            self._hook, sys.excepthook = sys.excepthook, self._excepthook
            self._unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisablehook


_QUIET = _QuietSaveFailures()


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax's warnings about read-only managers are noise when we only peek."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def finished_steps(directory: Path) -> list[int]:
    """The finished checkpoints in ``directory`` (step directories; temporary ones left by an
    interrupted save do not count). Creates nothing."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def unfinished(directory: Path) -> list[Path]:
    """Temporary directories of saves that never completed."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if TMP_MARK in p.name)


def _reader(directory: Path, items: tuple[str, ...]) -> ocp.CheckpointManager:
    """A read-only manager for this process alone (in a multi-process run, process 0 reads the
    config while the others wait for its orders, and the followers of a spanning trainer read
    its state): no barrier with the other processes."""
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me} if jax.process_count() > 1 else None
    )
    opts = ocp.CheckpointManagerOptions(read_only=True, create=False, multiprocessing_options=mp)
    return ocp.CheckpointManager(directory.absolute(), options=opts, item_names=items)


def read_train_state(directory: Path, step: int, like: Any) -> Any:
    """The train state of checkpoint ``step`` as host arrays shaped like ``like`` (a trainer
    process other than 0 reads it so, when the trainer spans processes)."""
    host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    with _quiet_orbax():
        manager = _reader(directory, ("train_state",))
        try:
            args = ocp.args.Composite(train_state=ocp.args.StandardRestore(host))
            return manager.restore(step, args=args).train_state
        finally:
            manager.close()


def peek_configs(directory: Path) -> Iterator[tuple[int, dict | None]]:
    """``(step, saved config or None when unreadable)``, newest first, reading only."""
    steps = finished_steps(directory)
    if not steps:
        return
    with _quiet_orbax():
        manager = _reader(directory, ("config",))
        for step in reversed(steps):
            try:
                cfg = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
                yield step, dict(cfg.config)
            except Exception:  # noqa: BLE001  (an unreadable checkpoint: the caller goes on)
                yield step, None


class RunState(Protocol):
    """What a checkpoint saves and restores (``dora_jax.pipeline.experiment.Experiment``)."""

    cfg: ExperimentConfig

    @property
    def steps_done(self) -> int: ...  # the checkpoint's key

    @property
    def tick(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...  # {component: plain-data state}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def arrays(self, host_copies: bool) -> dict[str, Any]: ...  # {"train_state", "versions"}

    def array_targets(self, state: dict[str, Any]) -> dict[str, Any]: ...  # abstract arrays

    def place_arrays(self, arrays: Any, host_copies: bool, checkpoint=None) -> None: ...

    def check_saved_config(self, saved: dict[str, Any]) -> None: ...  # raises: cannot take it


class RunCheckpointer:
    """The run's checkpoints in ``directory``. Opening it discards the temporary directories of
    saves that never completed (``discarded`` lists them)."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.discarded = self.discard_unfinished()
        # Only process 0 writes (it holds the trainer, and the other processes' engine snapshots
        # come to it as plain data): the other processes take no part in the saves.
        mp = ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes={0} if jax.process_count() > 1 else None
        )
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            multiprocessing_options=mp,
            create=False,
            cleanup_tmp_directories=True,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        # With several processes, arrays on process 0's devices alone are "host local" to orbax:
        # they are saved as host copies and put back into their shardings on restore.
        self.host_copies = jax.process_count() > 1
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=ITEMS)
        self.moved_aside: list[Path] = []  # unusable checkpoints skipped by restore_latest
        self.saved_config: dict | None = None  # the config of the checkpoint restored
        self._saving: int | None = None  # the step of the last save handed to orbax
        self._closed = False
        _QUIET.install()

    def close(self) -> None:
        """Finish the save in progress (errors are the caller's to check first) and let go."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.manager.wait_until_finished()
        with contextlib.suppress(Exception):
            self.manager.close()

    def discard_unfinished(self) -> list[str]:
        out = []
        for p in unfinished(self.directory):
            shutil.rmtree(p, ignore_errors=True)
            out.append(p.name)
        return out

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, exp: RunState) -> int:
        """Save between control rounds, keyed by the train steps done; a second save at the
        same step is a no-op (a resume from the first continues the same run). Returns the key.
        Raises :class:`CheckpointSaveError` when this save, or an earlier asynchronous one,
        failed."""
        step = exp.steps_done
        self.check()
        if step in self.steps():
            return step
        text, arrays = state_codec.dumps(exp.state_dict())
        host = {"state": np.frombuffer(text, np.uint8), **arrays}
        meta = {
            "format": HOST_FORMAT,
            "steps_done": step,
            "tick": exp.tick,
            "saved_at": time.time(),
        }
        # host copies: gathered to process 0 when the trainer spans processes
        items = exp.arrays(self.host_copies)
        self._check_space(step, [items["train_state"], items["versions"], host])
        previous, self._saving = self._saving, step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    train_state=ocp.args.StandardSave(items["train_state"]),
                    versions=ocp.args.StandardSave(items["versions"]),
                    host=ocp.args.StandardSave(host),
                    config=ocp.args.JsonSave(to_dict(exp.cfg)),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
            faults.point("save")  # async: the save is still being written
        except Exception as e:  # noqa: BLE001  (this save, or the previous one still running)
            unfinished = previous is not None and previous not in finished_steps(self.directory)
            raise self._save_failed(previous if unfinished else step, e) from e
        return step

    def _check_space(self, step: int, trees: list) -> None:
        """Refuse a save that would not fit the free space (with a 10% margin) before writing."""
        need = sum(int(getattr(x, "nbytes", 0)) for t in trees for x in jax.tree.leaves(t))
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return
        message = no_space(free, need)
        if message is not None:
            raise self._save_failed(step, OSError(errno.ENOSPC, message))

    def _save_failed(self, step: int | None, e: BaseException) -> CheckpointSaveError:
        step = step if step is not None else -1
        last = max([s for s in self.safe_steps() if s != step], default=None)
        kept = (
            f"the last complete checkpoint is {self.directory / str(last)}"
            if last is not None
            else "no checkpoint was completed"
        )
        return CheckpointSaveError(
            f"saving checkpoint {self.directory / str(step)} failed ({_one_line(e)}); the run "
            f"stopped; {kept}"
        )

    def safe_steps(self) -> list[int]:
        with contextlib.suppress(Exception):
            self.manager.reload()
        return finished_steps(self.directory)

    def check(self) -> None:
        """Raise :class:`CheckpointSaveError` if an asynchronous save has failed."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(self._saving, e) from e

    def wait(self) -> None:
        """Block until the save in progress is complete (or raise :class:`CheckpointSaveError`)."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(self._saving, e) from e

    def restore_latest(self, exp: RunState) -> int:
        """Restore the newest usable checkpoint into the freshly built ``exp``; a corrupt one is
        skipped with a warning in favour of the previous, and then moved to
        ``unusable_checkpoints/`` (``moved_aside``). A checkpoint of another format, or whose
        config differs from ``exp.cfg`` in a field a resume may not change, is refused. Returns
        the step restored; ``saved_config`` is that checkpoint's config."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to resume from")
        errors, skipped = [], []
        for step in reversed(steps):
            try:
                self._restore(exp, step)
            except (ConfigError, CheckpointError):
                raise
            except Exception as e:  # noqa: BLE001  (a truncated or unreadable checkpoint)
                errors.append(f"step {step}: {_one_line(e)}")
                skipped.append(step)
                log.warning(
                    "checkpoint %s/%d is unusable (%s); trying the previous one",
                    self.directory,
                    step,
                    _one_line(e),
                )
                continue
            self._move_aside(skipped)
            return step
        raise CheckpointError(
            f"{self.directory}: no usable checkpoint (move the directory away to start over):"
            "\n  " + "\n  ".join(errors)
        )

    def _move_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        dest = self.directory.parent / UNUSABLE_DIR
        dest.mkdir(exist_ok=True)
        for step in steps:
            target = dest / f"{step}-{int(time.time())}"
            shutil.move(str(self.directory / str(step)), str(target))
            self.moved_aside.append(target)
        self.manager.reload()

    def _format(self, step: int) -> int:
        path = self.directory / str(step)
        if not (path / "meta").is_dir():
            return 1
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return int(meta.meta.get("format", 0))

    def _restore(self, exp: RunState, step: int) -> None:
        fmt = self._format(step)
        if fmt != HOST_FORMAT:
            what = " (a pickled host state)" if fmt == 1 else ""
            raise CheckpointError(
                f"{self.directory / str(step)} is a checkpoint of format {fmt}{what}; this "
                f"version reads format {HOST_FORMAT} only: resume it with the version that wrote "
                f"it, or start a fresh run in another run_dir"
            )
        meta = self.manager.restore(
            step,
            args=ocp.args.Composite(config=ocp.args.JsonRestore(), host=ocp.args.StandardRestore()),
        )
        exp.check_saved_config(dict(meta.config))
        stored = dict(meta.host)
        text = np.asarray(stored.pop("state")).tobytes()
        state = state_codec.loads(text, stored)
        targets = exp.array_targets(state)
        if self.host_copies:  # read as host arrays, then placed
            targets = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), targets)
        restore = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
        arrays = self.manager.restore(step, args=ocp.args.Composite(**restore))
        if self.host_copies:
            # (a trainer spanning processes has the others read their shards from this step;
            # a failure there is theirs, not this checkpoint's: it is not moved aside)
            try:
                exp.place_arrays(arrays, True, checkpoint=(self.directory, step))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(
                    f"placing the train state of {self.directory / str(step)} on the trainer "
                    f"failed ({_one_line(e)}); the checkpoint was left as it is"
                ) from e
        else:
            exp.place_arrays(arrays, False)
        exp.load_state_dict(state)
        self.saved_config = dict(meta.config)
