"""The one vocabulary of the execution layer: every call to a rollout group or to the trainer is a
frozen value of this module.

A command names what to do, never how it travels: the interpreters (``group.GroupWorker`` for a
group's engine, ``trainer_worker.TrainerWorker`` for the trainer's part on this process's devices)
carry commands out on local devices; the transports (``transport.py`` in this process, on the
caller's thread or a worker thread; ``dora_jax.distributed`` to another process) move commands and
hand back a future of each one's value, knowing nothing of their meaning. The same record codec
(``dora_jax.state_codec``) writes commands and their values into messages and checkpoints.

Group commands name their group; ``ticket`` names a handover between two groups (weights or
requests with their KV): ``remote`` ones cross processes through the transfer servers, the others
meet in their process's :class:`~dora_jax.execution.transport.Handoffs`. Params given as arrays
(``Load.params``, ``Restore.params``) only ever go to a group of the process that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_jax.orchestrator.backend import GroupTick


@dataclass(frozen=True)
class GroupCommand:
    group: int
    replies: ClassVar[bool] = False  # the caller waits for the value (else: only for order)


# -- weights ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load(GroupCommand):
    """Load ``version``: from ``params`` (arrays of this process), from the group ``peer`` of this
    process (once its own load of the version is done), or from the handover ``ticket``."""

    version: int = 0
    params: Any = None
    peer: int | None = None
    ticket: int | None = None


@dataclass(frozen=True)
class OfferParams(GroupCommand):
    """Offer this group's params (of its latest load) to another process under ``ticket``."""

    ticket: int = 0


# -- requests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit(GroupCommand):
    requests: tuple = ()  # rollout.Request records


@dataclass(frozen=True)
class SendRequests(GroupCommand):
    """Export requests with their KV (running, queued, parked alike) as handover ``ticket``."""

    ids: tuple = ()
    ticket: int = 0
    remote: bool = False


@dataclass(frozen=True)
class ReceiveRequests(GroupCommand):
    """Import handover ``ticket`` (nothing is prefilled again)."""

    ticket: int = 0
    remote: bool = False


@dataclass(frozen=True)
class Interrupt(GroupCommand):
    """Take requests out (their KV dropped); the value is their records (the others finished)."""

    ids: tuple = ()
    replies: ClassVar[bool] = True


@dataclass(frozen=True)
class Extend(GroupCommand):
    """Conversations waiting on their environment: append its turns, ``(id, tokens)`` each."""

    items: tuple = ()


@dataclass(frozen=True)
class End(GroupCommand):
    """Conversations whose episode is over: free them."""

    ids: tuple = ()


# -- progress and state -------------------------------------------------------------------------
@dataclass(frozen=True)
class Step(GroupCommand):
    """Logical clock: one engine step; the value is every event since the last ``Step``."""

    replies: ClassVar[bool] = True


@dataclass(frozen=True)
class Pause(GroupCommand):
    """Wall clock: stop stepping once every earlier command is applied (its future says when)."""


@dataclass(frozen=True)
class Resume(GroupCommand):
    pass


@dataclass(frozen=True)
class Snapshot(GroupCommand):
    """A host copy of everything the engine holds (an ``EngineSnapshot``), for checkpoints."""

    replies: ClassVar[bool] = True


@dataclass(frozen=True)
class Import(GroupCommand):
    """Continue requests of a failed group of this version from host copies of their KV
    (``ExportedRequests``, one request each): nothing is prefilled again."""

    parts: tuple = ()


@dataclass(frozen=True)
class Restore(GroupCommand):
    """Load the snapshot's version (``params`` of this process, or handover ``ticket``) and
    continue from ``snapshot``."""

    snapshot: Any = None
    params: Any = None
    ticket: int | None = None
    replies: ClassVar[bool] = True


# -- the trainer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainerCommand:
    """Run by every process holding devices of the trainer mesh, in the same order."""


@dataclass(frozen=True)
class StartTrainer(TrainerCommand):
    """Build the trainer from ``source`` (``{"hf": directory or None}``: a Hugging Face
    directory every trainer process reads, or the random init of the seed)."""

    source: Any = None


@dataclass(frozen=True)
class TrainStep(TrainerCommand):
    batch: Any = None  # a packed train.TrainBatch (host arrays)


@dataclass(frozen=True)
class ExportParams(TrainerCommand):
    """The params as rollout groups load them (``to_groups``: in the groups' layout)."""

    to_groups: bool = False


@dataclass(frozen=True)
class GatherState(TrainerCommand):
    """The whole train state as host arrays on process 0 (checkpoints)."""


@dataclass(frozen=True)
class RestoreState(TrainerCommand):
    """Each process reads its shards of checkpoint ``step`` in ``directory``."""

    directory: str = ""
    step: int = 0


# -- what groups report -------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupStatus:
    """An engine's requests and KV use, as of its last change (read from any thread)."""

    pages: dict  # every request it holds -> device KV pages it holds now
    pages_used: int
    pages_total: int


@dataclass(frozen=True)
class GroupEvent:
    """What a group did: one span (engine step, weight load, KV move) with its finished requests
    and ended model turns (conversations now waiting on their environment), or the error (its
    type, message and traceback) that stopped it."""

    group: int
    span: GroupTick | None = None
    finished: tuple = ()  # rollout.EngineFinished records
    error: str | None = None
    turn_ends: tuple = ()


# what the record codec (dora_jax.state_codec) writes and reads back
RECORDS = (
    Load,
    OfferParams,
    Submit,
    SendRequests,
    ReceiveRequests,
    Interrupt,
    Extend,
    End,
    Step,
    Pause,
    Resume,
    Snapshot,
    Import,
    Restore,
    StartTrainer,
    TrainStep,
    ExportParams,
    GatherState,
    RestoreState,
    GroupStatus,
    GroupEvent,
)


class TransferError(RuntimeError):
    """The holder of arrays between processes could not serve them; the message says why."""


# in the error of a transfer whose holder's process died ("process 2 is gone: ...")
HOST_GONE = "is gone:"
