"""The real :class:`RolloutBackend`: one JAX rollout engine per group submesh.

Weight transfers and request migrations run synchronously inside the call (they finish before
the next tick, so ``busy_ticks`` is always 0) and their wall time is recorded in
:attr:`EngineBackend.overheads`. Moves between groups are ``jax.device_put`` from one group's
mesh to another's with identical mesh shapes and PartitionSpecs, so they copy shard to shard
(see JAX_FACTS); params coming from the trainer are placed into the group's rollout shardings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jax.sharding import Mesh

from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.model.params import Params
from dora_jax.orchestrator.backend import (
    TRAINER,
    BackendError,
    FinishedRequest,
    GroupInfo,
    GroupTick,
    PartialRequest,
    RequestSpec,
    Source,
    StepEvents,
)
from dora_jax.rollout import Engine, Request, request_key


@dataclass(frozen=True)
class PromptPayload:
    """What a request needs beyond the control plane's view: its prompt and answer."""

    index: int  # position of the prompt in the prompt stream
    tokens: tuple[int, ...]
    answer: str
    max_new_tokens: int | None = None  # None: the backend's default


@dataclass(frozen=True)
class Completion:
    """Payload of a finished request: everything the trainer needs to score and learn."""

    prompt: PromptPayload
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    prefill_tokens: int
    migrations: int


@dataclass
class Overheads:
    """Wall seconds spent on control-plane data movement (the paper's overhead figures)."""

    weight_transfer_s: float = 0.0
    weight_transfers: int = 0
    migration_s: float = 0.0
    migrated_requests: int = 0
    log: list[tuple[str, int, int, float]] = field(default_factory=list)  # (kind, src, dst, s)


class EngineBackend:
    """Groups = engines on ``meshes``; version 0 (``initial_params``) is loaded everywhere."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        meshes: Sequence[Mesh],
        eos_id: int,
        initial_params: Params,
        trainer_params: Callable[[int], Params],
        *,
        seed: int,
        max_new_tokens: int | None = None,
        interpret: bool | None = None,
    ):
        self.engines = [
            Engine(model_cfg, rollout_cfg, m, eos_id, interpret=interpret) for m in meshes
        ]
        for e in self.engines:
            e.load_params(initial_params, 0)
        self.seed = seed
        self.tokens_per_slot_tick = rollout_cfg.decode_steps  # for utilisation figures
        self.max_new_tokens = max_new_tokens or rollout_cfg.max_new_tokens
        self.trainer_params = trainer_params
        self.published = 0
        self.overheads = Overheads()
        self._tick = 0
        self._meta: dict[int, tuple[int, PromptPayload, list[int]]] = {}  # rid -> pg, prompt, vers
        self._where: dict[int, int] = {}  # rid -> group

    # -- queries -------------------------------------------------------------------------------
    def groups(self) -> list[GroupInfo]:
        out = []
        for g, e in enumerate(self.engines):
            ld = e.load()
            running = [r for r in e.slots if r is not None]
            ids = [r.id for r in running] + [r.id for r in e.pending]
            pages = [len(e.alloc.table(r.id)) for r in running] + [0] * len(e.pending)
            for p in e.parked:
                ids += [r.id for r in p.requests]
                pages += [0] * len(p.requests)
            out.append(
                GroupInfo(
                    group=g,
                    version=e.version,
                    busy_ticks=0,
                    max_slots=e.max_concurrent_decodes,
                    free_slots=max(ld.free_slots - ld.pending - ld.parked, 0),
                    kv_pages_used=ld.pages_used,
                    kv_pages_total=ld.pages_total,
                    requests=tuple(ids),
                    request_pages=tuple(pages),
                )
            )
        return out

    # -- versions ------------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        if version != self.published + 1:
            raise BackendError(f"published version {version} after {self.published}")
        self.published = version

    def set_version(self, group: int, version: int, source: Source) -> None:
        e = self.engines[group]
        if e.version == version:
            return
        if e.num_requests:
            raise BackendError(f"group {group} still holds {e.num_requests} request(s)")
        t0 = time.perf_counter()
        if source == TRAINER:
            if version != self.published:
                raise BackendError(
                    f"the trainer only serves version {self.published}, not {version}"
                )
            params = self.trainer_params(version)
            src = -1
        else:
            holder = self.engines[source]
            if holder.version != version:
                raise BackendError(f"group {source} holds version {holder.version}, not {version}")
            params, src = holder.params, source
        e.load_params(params, version)
        _block(e.params)
        dt = time.perf_counter() - t0
        self.overheads.weight_transfer_s += dt
        self.overheads.weight_transfers += 1
        self.overheads.log.append(("weights", src, group, dt))

    # -- requests ------------------------------------------------------------------------------
    def submit(self, group: int, requests: list[RequestSpec]) -> None:
        e = self.engines[group]
        reqs = []
        for spec in requests:
            if spec.version != e.version:
                raise BackendError(
                    f"request {spec.request_id} of version {spec.version} "
                    f"submitted to group {group} of version {e.version}"
                )
            if spec.resume is not None:  # partial rollout: continue under the new version
                r: Request = spec.resume.payload
                r.version = spec.version
                pg, prompt, versions = self._meta[spec.request_id]
                versions.append(spec.version)
            else:
                prompt = spec.payload
                if not isinstance(prompt, PromptPayload):
                    raise BackendError(
                        f"request {spec.request_id}: payload must be a PromptPayload"
                    )
                r = Request(
                    spec.request_id,
                    list(prompt.tokens),
                    spec.version,
                    request_key(self.seed, spec.request_id),
                    prompt.max_new_tokens or self.max_new_tokens,
                )
                self._meta[spec.request_id] = (spec.prompt_group, prompt, [spec.version])
            reqs.append(r)
            self._where[spec.request_id] = group
        e.submit(reqs)

    def step(self) -> StepEvents:
        finished, ticks = [], []
        for g, e in enumerate(self.engines):
            before = e.load()
            report = e.step()
            active = before.active + before.pending
            kind = (
                "prefill" if report.prefill_tokens else "decode" if report.decode_tokens else "idle"
            )
            ticks.append(
                GroupTick(
                    group=g,
                    version=e.version,
                    activity=kind,
                    active=active,
                    tokens=report.sampled_tokens,
                    prefill_tokens=report.prefill_tokens,
                    reprefill_tokens=report.reprefill_tokens,
                    time_s=report.prefill_s + report.decode_s,
                )
            )
            for f in report.finished:
                pg, prompt, versions = self._meta.pop(f.id)
                self._where.pop(f.id, None)
                comp = Completion(
                    prompt, f.tokens, f.logprobs, f.finish_reason, f.prefill_tokens, f.migrations
                )
                finished.append(
                    FinishedRequest(
                        f.id, pg, len(prompt.tokens), len(f.tokens), tuple(versions), comp
                    )
                )
        events = StepEvents(self._tick, tuple(finished), tuple(ticks))
        self._tick += 1
        return events

    def migrate(self, request_ids: list[int], src: int, dst: int) -> None:
        a, b = self.engines[src], self.engines[dst]
        if a.version != b.version:
            raise BackendError(
                f"cannot migrate from group {src} (version {a.version}) to group "
                f"{dst} (version {b.version})"
            )
        t0 = time.perf_counter()
        running = {r.id for r in a.slots if r is not None}
        moving = [i for i in request_ids if i in running]
        queued = [i for i in request_ids if i not in running]
        if moving:
            b.import_requests(a.export_requests(moving))
        if queued:  # not started yet (or parked on the host): hand over as they are
            b.submit(a.interrupt(queued))
        _block(b.cache.k)
        dt = time.perf_counter() - t0
        for i in request_ids:
            self._where[i] = dst
        self.overheads.migration_s += dt
        self.overheads.migrated_requests += len(request_ids)
        self.overheads.log.append(("migrate", src, dst, dt))

    def interrupt(self, request_ids: list[int]) -> list[PartialRequest]:
        by_group: dict[int, list[int]] = {}
        for rid in request_ids:
            if rid not in self._where:
                raise BackendError(f"request {rid} is not in flight")
            by_group.setdefault(self._where[rid], []).append(rid)
        out = []
        for g, ids in by_group.items():
            for r in self.engines[g].interrupt(ids):
                pg, prompt, versions = self._meta[r.id]
                self._where.pop(r.id)
                out.append(
                    PartialRequest(r.id, pg, len(prompt.tokens), len(r.tokens), tuple(versions), r)
                )
        return out


def _block(tree) -> None:
    import jax

    jax.block_until_ready(tree)
