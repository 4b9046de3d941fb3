"""The seam between the control plane and execution: the :class:`RolloutBackend` protocol.

The control plane sees groups, versions and requests, never arrays. A backend runs one engine per
rollout *group*; every group holds exactly one policy version at a time. Three implementations
share this contract: the in-memory fake (:mod:`dora_jax.orchestrator.fake_backend`), the cluster
simulator, and the real JAX engines on group submeshes.

Logical time: one call to :meth:`RolloutBackend.step` advances every group by one engine step,
one *tick*. Weight transfers and request migrations take a backend-defined number of ticks; the
control plane never waits on them: it keeps ticking and reads their progress in :meth:`groups`.

Identifiers are plain ints: ``group`` indexes ``groups()``; ``request_id`` is unique over a run;
``prompt_group`` is the id of the GRPO group of ``G`` requests sampled from one prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

# ``source`` of a weight transfer that comes from the trainer (only the newest published version).
TRAINER: Literal["trainer"] = "trainer"
Source = int | Literal["trainer"]

# "transfer": receiving weights; "migrate": packing or unpacking the KV of moving requests;
# "env_wait": nothing to decode while conversations it holds wait on their environment
Activity = Literal["idle", "prefill", "decode", "transfer", "migrate", "env_wait"]
ACTIVITIES: tuple[Activity, ...] = ("idle", "prefill", "decode", "transfer", "migrate", "env_wait")


class BackendError(RuntimeError):
    """A call broke the backend contract (a control-plane bug, never a recoverable condition)."""


def check_submit(
    group: int,
    requests: list[RequestSpec],
    free: int,
    version: int,
    max_prompt_len: int,
    seen: set[int],
    interrupted: dict,
) -> None:
    """``submit``'s contract, for the in-memory backends: ``group`` has ``free`` slots and holds
    ``version``; ``seen``: the request ids submitted so far, ``interrupted``: those interrupted."""
    if len(requests) > free:
        raise BackendError(f"submit: {len(requests)} requests, group {group} has {free} slots")
    for spec in requests:
        rid = spec.request_id
        if spec.version != version:
            held = f"group {group} holds {version}"
            raise BackendError(f"submit: request {rid} is for version {spec.version}, {held}")
        if not 0 < spec.prompt_len <= max_prompt_len:
            raise BackendError(f"submit: prompt_len {spec.prompt_len} out of range")
        if spec.resume is None and rid in seen:
            raise BackendError(f"submit: request {rid} was already submitted")
        if spec.resume is not None and rid not in interrupted:
            raise BackendError(f"submit: request {rid} was not interrupted")


def check_set_version(
    group: int,
    version: int,
    source: Source,
    held: int,
    published: int,
    version_of: Callable[[int], int],
    sendable: Collection[int] = (),
) -> bool:
    """``set_version``'s contract for every backend: ``held`` requests on ``group``, the trainer's
    ``published`` version (and the older ``sendable`` ones it still sends), ``version_of(g)``:
    what group ``g`` holds. False: a no-op (it holds ``version`` already)."""
    if version_of(group) == version:
        return False
    if held:
        raise BackendError(f"set_version: group {group} still holds {held} request(s)")
    if source == TRAINER:
        if version != published and version not in sendable:
            raise BackendError(
                f"set_version: the trainer only holds version {published}, not {version}"
            )
    elif source == group or version_of(source) != version:
        raise BackendError(f"set_version: group {source} does not hold version {version}")
    return True


def check_migrate(
    ids: list[int],
    src: int,
    dst: int,
    version_of: Callable[[int], int],
    where: Callable[[int], int | None],
    free: int | None,
) -> None:
    """``migrate``'s contract for every backend: ``where(r)``: the group holding request ``r``;
    ``free``: the slots ``dst`` has for them (None: the caller counts them itself)."""
    if src == dst:
        raise BackendError("migrate: src and dst are the same group")
    if version_of(src) != version_of(dst):
        raise BackendError(
            f"migrate: group {src} holds v{version_of(src)}, group {dst} v{version_of(dst)}"
        )
    bad = next((r for r in ids if where(r) != src), None)
    if bad is not None:
        raise BackendError(f"migrate: request {bad} is not on group {src}")
    if len(set(ids)) < len(ids):
        raise BackendError("migrate: duplicate request ids")
    if free is not None and len(ids) > free:
        raise BackendError(f"migrate: group {dst} has {free} free slots for {len(ids)}")


class GroupInfo(NamedTuple):
    """What the control plane may know about one rollout group, at the start of a tick."""

    group: int
    version: int  # the version it holds, or is receiving while busy_ticks > 0
    busy_ticks: int  # ticks left of a weight transfer (0: ready)
    max_slots: int  # concurrent requests the engine can run
    free_slots: int  # requests it can admit now (free slots and KV reservation both allow)
    kv_pages_used: int
    kv_pages_total: int
    # every request the group holds (prefilling, decoding, or arriving by migration), in admission
    # order, with the KV pages each one holds now
    requests: tuple[int, ...] = ()
    request_pages: tuple[int, ...] = ()
    host: int = 0  # the process whose devices hold the group (multi-process runs)
    # the requests of ``requests`` that wait on their environment (multi-turn conversations): they
    # hold KV pages and pin their version but no decode slot (``free_slots`` counts them out)
    waiting: tuple[int, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def kv_fraction(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


@dataclass(frozen=True)
class PartialRequest:
    """A request taken out of the backend by :meth:`RolloutBackend.interrupt` before it finished.

    ``versions`` lists every version that sampled at least one of its tokens, oldest first.
    Resubmitting it (``RequestSpec.resume``) re-prefills ``prompt_len + generated`` tokens.
    """

    request_id: int
    prompt_group: int
    prompt_len: int
    generated: int
    versions: tuple[int, ...]
    payload: object = None  # backend-owned state (tokens so far, logprobs, rng); opaque here
    # "" for an interrupt; for a request recovered from a failed group, where it continues from
    # (:data:`RECOVERY_SOURCES`): a host copy of its KV, its tokens so far, or its prompt
    source: str = ""


# Where a failed group's request continues (best first): a host copy of its KV (no re-prefill;
# the tokens after the copy are sampled again, identically), its tokens so far (re-prefilled under
# the same version), or its prompt (started again; same request key, so the same tokens).
RECOVERY_SOURCES = ("kv", "tokens", "prompt")

# A group's health: "dead" when its engine or its process failed (its requests are recovered
# elsewhere), "restarting" while its engine is rebuilt (on its devices, or by its process started
# again), "stale" while a rejoining group loads the version it is given, "healthy" once it holds a
# version again (only healthy groups are in the run).
HEALTH_STATES = ("healthy", "dead", "restarting", "stale")
# in the reason of a group that went "dead" because its process was asked to stop and handed its
# requests over ("process 2 is leaving (signal 15): ..."): it left, it did not fail
HOST_LEAVING = "is leaving ("


class HealthChange(NamedTuple):
    """A group entered ``state`` (one of :data:`HEALTH_STATES`) for ``reason``."""

    group: int
    state: str
    reason: str


@dataclass(frozen=True)
class RequestSpec:
    """One response to sample: a member of a prompt group, to run under ``version``."""

    request_id: int
    prompt_group: int
    version: int  # must equal the version of the group it is submitted to
    prompt_len: int
    payload: object = None  # prompt tokens, sampling params, rng seed: opaque to the control plane
    resume: PartialRequest | None = None  # continue an interrupted request (re-prefills it)


@dataclass(frozen=True)
class FinishedRequest:
    """A request whose response is complete; the runtime turns it into a trajectory."""

    request_id: int
    prompt_group: int
    prompt_len: int
    response_len: int
    versions: tuple[int, ...]  # versions that sampled its tokens, oldest first (span = len)
    payload: object = None  # tokens, behavior logprobs, reward inputs: forwarded to the trainer

    @property
    def version_span(self) -> int:
        return len(self.versions)


class GroupTick(NamedTuple):
    """What one group did during one tick (logical clock), or during one engine step or data
    move between ``t0`` and ``t1`` seconds (wall clock: several per group and round)."""

    group: int
    version: int
    activity: Activity
    active: int  # requests it held during the tick
    tokens: int  # response tokens sampled (decode)
    prefill_tokens: int  # context tokens prefilled, re-prefills included
    reprefill_tokens: int  # the part of prefill_tokens that had been computed before
    time_s: float  # seconds spent: wall time on a real backend, modelled time elsewhere
    t0: float = 0.0  # wall clock: when it started and ended (seconds since the run started)
    t1: float = 0.0


@dataclass(frozen=True)
class StepEvents:
    """The outcome of one :meth:`RolloutBackend.step`."""

    tick: int  # index of the tick that just ran (0, 1, ...)
    finished: tuple[FinishedRequest, ...]
    groups: tuple[GroupTick, ...] = field(default=())
    # requests of groups that failed during the step, taken out of them: the control plane
    # resubmits each (``RequestSpec.resume``) to a live group of its version
    recovered: tuple[PartialRequest, ...] = field(default=())
    health: tuple[HealthChange, ...] = field(default=())  # group health transitions, in order


@runtime_checkable
class RolloutBackend(Protocol):
    """Rollout groups behind one small interface. Every method is called from one thread.

    ``tokens_per_slot_tick``: tokens a busy decode slot adds per tick (utilisation figures).

    Errors: a call that breaks a contract below raises :class:`BackendError` and changes nothing.
    """

    tokens_per_slot_tick: int

    def groups(self) -> list[GroupInfo]:
        """The state of every group, indexed by group id, as of the end of the last tick."""
        ...

    def publish(self, version: int) -> None:
        """The trainer has produced ``version`` (exactly one more than the last published).

        From now on ``set_version(g, version, TRAINER)`` may fetch it. Older versions are no longer
        available from the trainer, only from groups holding them. Version 0, the initial policy,
        is published at construction and held by every group.
        """
        ...

    def set_version(self, group: int, version: int, source: Source) -> None:
        """Load ``version`` into ``group`` (a weight transfer; takes some ticks).

        ``source`` is :data:`TRAINER` (only for the newest published version) or the id of another
        group whose ``version`` is ``version``; if that group is itself still receiving it, this
        transfer finishes after that one. The group must hold no request: the control plane
        empties it first (migrate the requests to a same-version group, or interrupt them and
        resubmit them under the new version, which re-prefills them). While the transfer runs
        the group's ``version`` already reads the new one, ``busy_ticks > 0``, and requests
        submitted or migrated to it wait. Setting the version a group already holds is a no-op.
        """
        ...

    def submit(self, group: int, requests: list[RequestSpec]) -> None:
        """Admit requests to ``group``: they prefill, then decode one token per tick until done.

        Every request's ``version`` must equal the group's version, ``len(requests)`` must not
        exceed its ``free_slots``, request ids must be new (or the id of an interrupted request
        being resumed, with ``resume`` set).
        """
        ...

    def step(self) -> StepEvents:
        """Advance every group by one engine step (one tick) and report what happened."""
        ...

    def migrate(self, request_ids: list[int], src: int, dst: int) -> None:
        """Move requests with their KV cache from ``src`` to ``dst``; they are not re-prefilled.

        Both groups must hold the same version (KV computed under one version is valid only
        under that version), every request must be on ``src``, and ``dst`` must have that many
        ``free_slots``. The requests stop decoding while their KV is in transit (backend-defined
        ticks) and continue on ``dst`` exactly where they stopped.
        """
        ...

    def interrupt(self, request_ids: list[int], discard: bool = False) -> list[PartialRequest]:
        """Take unfinished requests out of their groups and return their state.

        For the partial-rollout baseline (resubmit under a new version) and the oversampling
        baseline (abort and discard: ``discard``, they will not be resubmitted and the backend
        forgets them, a conversation's episode included). Their slots and KV pages are freed at
        once.
        """
        ...

    def live_requests(self) -> int:
        """Requests submitted and neither finished nor interrupted (in a group or moving)."""
        ...

    def pause(self) -> None:
        """Wall clock: stop every group once it has carried out every call made so far; their
        reports wait for the next :meth:`step`. A no-op on the logical clock (between ticks)."""
        ...

    def resume(self) -> None:
        """Let the groups run again after :meth:`pause`."""
        ...
