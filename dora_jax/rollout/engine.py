"""The host-side rollout engine of one group: continuous batching over fixed slots, one version.

Method names mirror JetStream's Engine API (``load_params``, ``prefill``, ``generate``,
``free_resource``, ``max_concurrent_decodes``; see docs/jetstream.md), extended with what DORA
needs: a policy version, behavior logprobs, and moving requests out and in with their KV pages
(``export_requests`` / ``import_requests``, ``park`` to host memory, ``interrupt``).

One :meth:`step` gives every request in a slot exactly one new token: admitted requests get their
first token from prefill, running ones from one decode step. A request that cannot get a page
while decoding is parked in host memory (its KV kept, no re-prefill) and resumed first when pages
free up.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dora_jax import sharding as sh
from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.kernels.kv_cache_ops import pack_pages, unpack_pages
from dora_jax.model.params import Params, abstract_params, param_axes
from dora_jax.rollout.attention import resolve_impl
from dora_jax.rollout.page_allocator import PageAllocator
from dora_jax.rollout.requests import ROUTE_DTYPE, ExportedRequests, FinishedRequest, Request
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.rollout.steps import (
    KVCache,
    StepStatic,
    decode_step,
    init_cache,
    prefill_step,
    stop_ids,
)

# Pack buffer [2, 1, K, L * n, Z, H]: the kernels' [2, L, K, n, Z, H] layout applied to the
# layer-major cache viewed as one "layer" (see KVCache); page j of layer l sits at l * n + j.
BUFFER_SPEC = P(None, None, "model", None, None, None)


class EngineError(RuntimeError):
    """A request or operation the engine refuses (wrong version, too long, no capacity)."""


@dataclass(frozen=True)
class EngineLoad:
    version: int | None
    active: int
    pending: int
    parked: int
    free_slots: int
    pages_used: int
    pages_total: int


@dataclass
class EngineSnapshot:
    version: int | None
    running: ExportedRequests  # KV as host numpy
    pending: list[Request]
    parked: list[ExportedRequests]


@dataclass
class Handover:
    """Requests leaving an engine for another of the same version: running ones with their KV
    packed (``running``), queued ones as they are (``queued``, no KV yet), parked ones with their
    KV in host memory (``parked``). Nothing is recomputed where they land."""

    running: ExportedRequests | None
    queued: list[Request]
    parked: list[ExportedRequests]

    @property
    def ids(self) -> list[Hashable]:
        out = [r.id for r in self.running.requests] if self.running else []
        out += [r.id for r in self.queued]
        return out + [r.id for p in self.parked for r in p.requests]


@dataclass
class StepReport:
    finished: list[FinishedRequest]
    prefill_tokens: int = 0  # context tokens prefilled (re-prefills included)
    reprefill_tokens: int = 0  # the part of prefill_tokens that had been computed before
    sampled_tokens: int = 0  # new response tokens (first tokens from prefill + decode)
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def _buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 4
    return out + [limit]


def _pow2_buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


_decode_jit = jax.jit(decode_step, static_argnames=("st",), donate_argnums=(1,))
_prefill_jit = jax.jit(prefill_step, static_argnames=("st",), donate_argnums=(1,))


@partial(jax.jit, static_argnames=("impl", "interpret"))
def _pack(cache: KVCache, page_ids, impl, interpret):
    return pack_pages(cache.k[None], cache.v[None], page_ids, impl=impl, interpret=interpret)


@partial(jax.jit, static_argnames=("impl", "interpret"), donate_argnums=(0,))
def _unpack(cache: KVCache, buffer, page_ids, impl, interpret):
    k, v = unpack_pages(
        cache.k[None], cache.v[None], buffer, page_ids, impl=impl, interpret=interpret
    )
    return cache.replace(k=k[0], v=v[0])


class Engine:
    """One rollout group's engine on ``mesh`` (axes ``("data", "expert", "model")``, data = 1).

    For a mixture of experts every request records the experts each fed token used in each layer
    (``Request.routes``; a finished one carries them as ``FinishedRequest.routes``), for routing
    replay in the trainer. A prefill, including a re-prefill, records its fed tokens afresh."""

    def __init__(
        self,
        cfg: ModelConfig,
        rcfg: RolloutConfig,
        mesh: Mesh,
        eos_id: int | Sequence[int],
        *,
        interpret: bool | None = None,
        return_logits: bool = False,
    ):
        # eos_id: one id or several (any of them ends a response), plus rollout.extra_eos_ids
        self.eos_ids = stop_ids(eos_id, rcfg.extra_eos_ids)
        self.cfg, self.rcfg, self.mesh, self.eos_id = cfg, rcfg, mesh, self.eos_ids[0]
        if cfg.is_moe and cfg.num_experts > np.iinfo(ROUTE_DTYPE).max:
            raise EngineError(f"model.num_experts={cfg.num_experts}: recorded routes are int16")
        if rcfg.num_pages is None:
            raise EngineError("rollout.num_pages is null: the memory plan sizes it "
                              "(pipeline.memory_plan), or set it")  # fmt: skip
        self.impl, self.interpret = resolve_impl(rcfg.attention_impl, interpret)
        interpret = self.interpret
        self.sampling = SamplingParams(rcfg.temperature, rcfg.top_k, rcfg.top_p)
        self.decode_steps = rcfg.decode_steps
        self._st = StepStatic(
            cfg=cfg,
            sampling=self.sampling,
            mesh=mesh,
            impl=self.impl,
            interpret=interpret,
            return_logits=return_logits,
            decode_steps=rcfg.decode_steps,
            eos_ids=self.eos_ids,
        )
        Z = rcfg.page_size
        self.pages_per_seq = -(-(rcfg.max_prompt_len + rcfg.max_new_tokens) // Z)
        if self.pages_per_seq > rcfg.num_pages - 1:
            raise EngineError(
                f"rollout.num_pages={rcfg.num_pages} cannot hold one request of "
                f"max_prompt_len + max_new_tokens = {rcfg.max_prompt_len + rcfg.max_new_tokens} "
                f"tokens ({self.pages_per_seq} pages of {Z}, plus the reserved page 0)"
            )
        self.alloc = PageAllocator(rcfg.num_pages, Z)
        self.cache = init_cache(cfg, rcfg, mesh)
        self.slots: list[Request | None] = [None] * rcfg.max_slots
        self.pending: deque[Request] = deque()
        self.parked: deque[ExportedRequests] = deque()
        # Batch-invariant decoding uses one batch shape, so a row's numerics never depend on
        # how many other requests share the step (bit-identical continuation after migration).
        # Otherwise batch rows and block-table widths (pages attended) are bucketed.
        self.buckets = [rcfg.max_slots] if rcfg.batch_invariant else _buckets(rcfg.max_slots)
        self.width_buckets = (
            [self.pages_per_seq] if rcfg.batch_invariant else _pow2_buckets(self.pages_per_seq)
        )
        self.params: Params | None = None
        self.version: int | None = None
        self.last_logits: dict[Hashable, np.ndarray] = {}  # per request, last decode (tests)
        self._rep = NamedSharding(mesh, P())
        self._param_shardings = sh.tree_shardings(
            param_axes(cfg), abstract_params(cfg), sh.rollout_rules(), mesh
        )

    # -- JetStream-style API -------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.rcfg.max_slots

    @property
    def param_shardings(self) -> Params:
        """Where this engine keeps its params (the group mesh, rollout rules)."""
        return self._param_shardings

    @property
    def buffer_sharding(self) -> NamedSharding:
        """Where a pack buffer of this engine's KV pages lives (``export_requests``)."""
        return NamedSharding(self.mesh, BUFFER_SPEC)

    def load_params(self, params: Params, version: int) -> None:
        """Serve ``version`` with ``params`` (copied into this group's shardings). Refused while
        the engine holds requests of another version: drain, migrate or interrupt them first."""
        if self.version is not None and version != self.version and self.num_requests:
            raise EngineError(
                f"cannot load version {version}: the engine holds {self.num_requests} "
                f"request(s) of version {self.version}"
            )
        self.params = jax.device_put(params, self._param_shardings)
        self.version = version

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests for admission (prefill when a slot and pages are free)."""
        for r in requests:
            self._check_admissible(r)
            self.pending.append(r)

    def prefill(self, requests: Sequence[Request]) -> list[FinishedRequest]:
        """Prefill ``requests`` into free slots now (chunked), sampling each first token."""
        return self._prefill(list(requests), StepReport([]))

    def generate(self) -> list[FinishedRequest]:
        """One decode step for every running request."""
        return self._decode(StepReport([]))

    def free_resource(self, slot: int) -> None:
        r = self.slots[slot]
        if r is None:
            raise EngineError(f"slot {slot} is already free")
        self.alloc.free(r.id)
        self.slots[slot] = None

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Resume parked requests, admit pending ones (prefill), decode running ones."""
        report = StepReport([])
        running = [r for r in self.slots if r is not None]
        self._resume_parked()
        admitted: list[Request] = []
        free_slots = sum(r is None for r in self.slots)
        budget = self.alloc.pages_free
        # Parked requests go first: no admission while any wait for pages (no starvation).
        while self.pending and not self.parked and len(admitted) < free_slots:
            need = self.alloc.pages_for(self.pending[0].cached_tokens + 1)
            if need > budget:
                break
            budget -= need
            admitted.append(self.pending.popleft())
        if admitted:
            self._prefill(admitted, report)
        if running:
            self._decode(report, only={r.id for r in running})
        return report

    def load(self) -> EngineLoad:
        return EngineLoad(
            version=self.version,
            active=sum(r is not None for r in self.slots),
            pending=len(self.pending),
            parked=sum(len(p.requests) for p in self.parked),
            free_slots=sum(r is None for r in self.slots),
            pages_used=self.alloc.pages_used,
            pages_total=self.alloc.pages_total,
        )

    @property
    def num_requests(self) -> int:
        ld = self.load()
        return ld.active + ld.pending + ld.parked

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything (run, admit or resume a request)."""
        return any(r is not None for r in self.slots) or bool(self.pending or self.parked)

    def request_ids(self) -> list[Hashable]:
        ids = [r.id for r in self.slots if r is not None] + [r.id for r in self.pending]
        return ids + [r.id for p in self.parked for r in p.requests]

    def held_pages(self) -> dict[Hashable, int]:
        """Every request the engine holds and the device KV pages it holds now (0 for requests
        queued for admission or parked in host memory)."""
        out = {r.id: len(self.alloc.table(r.id)) for r in self.slots if r is not None}
        out.update((r.id, 0) for r in self.pending)
        out.update((r.id, 0) for p in self.parked for r in p.requests)
        return out

    # -- moving requests -----------------------------------------------------------------------
    def export_requests(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Take running requests out with their KV pages packed into one buffer on this mesh.
        Their slots and pages are freed here; nothing is recomputed at the destination."""
        reqs = [self._running(i) for i in ids]
        for r in reqs:
            r.compact_routes()
        page_counts, kv = self._pack_requests(reqs)
        for r in reqs:
            self.free_resource(self.slots.index(r))
        return ExportedRequests(reqs, page_counts, kv)

    def snapshot(self) -> EngineSnapshot:
        """A host copy of everything in flight (request records and the KV pages of running
        ones), taken without disturbing the engine: what a checkpoint stores."""
        running = [r for r in self.slots if r is not None]
        for r in running:
            r.compact_routes()
        counts, kv = self._pack_requests(running)
        kv = np.asarray(kv)
        return EngineSnapshot(
            version=self.version,
            running=ExportedRequests(copy.deepcopy(running), counts, kv),
            pending=copy.deepcopy(list(self.pending)),
            parked=copy.deepcopy(list(self.parked)),
        )

    def _pack_requests(self, reqs: Sequence[Request]) -> tuple[list[int], jax.Array]:
        """(pages per request, pack buffer of their cached KV), in request order."""
        counts = [self.alloc.pages_for(r.cached_tokens) for r in reqs]
        pages = [p for r, n in zip(reqs, counts, strict=True) for p in self.alloc.table(r.id)[:n]]
        return counts, _pack(self.cache, self._page_ids(pages), self.impl, self.interpret)

    def restore(self, snap: EngineSnapshot) -> None:
        """Continue from a snapshot: the engine must be empty and serve ``snap.version``. Running
        requests get their KV back (no re-prefill); the rest queue as they were."""
        if self.num_requests:
            raise EngineError(f"restore needs an empty engine, this one holds {self.num_requests}")
        if snap.version != self.version:
            raise EngineError(f"snapshot of version {snap.version}, engine serves {self.version}")
        if snap.running.requests:
            migrations = [r.migrations for r in snap.running.requests]
            self.import_requests(snap.running)
            for r, m in zip(snap.running.requests, migrations, strict=True):
                r.migrations = m  # a restore is not a migration
        self.pending.extend(snap.pending)
        self.parked.extend(snap.parked)

    def can_import(self, exported: ExportedRequests) -> bool:
        free = sum(r is None for r in self.slots)
        pages = sum(self.alloc.pages_for(r.total_tokens) for r in exported.requests)
        return free >= len(exported.requests) and pages <= self.alloc.pages_free

    def import_requests(self, exported: ExportedRequests) -> None:
        """Take requests exported by an engine of the same version (any mesh of the same shape,
        or parked on the host) and continue them from their cached KV."""
        self._check_version(exported.requests)
        if not self.can_import(exported):
            raise EngineError(
                f"no room for {len(exported.requests)} imported request(s): "
                f"{self.load().free_slots} free slot(s), {self.alloc.pages_free} free page(s)"
            )
        page_ids: list[int] = []
        for r, n in zip(exported.requests, exported.page_counts, strict=True):
            table = self.alloc.ensure(r.id, r.total_tokens)
            page_ids.extend(table[:n])
            r.migrations += 1
            self.slots[self._free_slot()] = r
        ids = self._page_ids(page_ids)
        kv = exported.kv
        if kv.shape[3] != ids.shape[0]:
            raise EngineError(f"KV buffer holds {kv.shape[3]} pages, expected {ids.shape[0]}")
        kv = jax.device_put(kv, self.buffer_sharding)
        self.cache = _unpack(self.cache, kv, ids, self.impl, self.interpret)

    def move_out(self, ids: Iterable[Hashable]) -> Handover:
        """Take requests out for another engine of this version, wherever they are here: running
        ones with their KV, queued ones as they are, parked ones with their host KV. Ids this
        engine does not hold (finished meanwhile) are skipped; :attr:`Handover.ids` says which
        were taken."""
        wanted = set(ids)
        running = [r.id for r in self.slots if r is not None and r.id in wanted]
        exported = self.export_requests(running) if running else None
        queued = [r for r in self.pending if r.id in wanted]
        self.pending = deque(r for r in self.pending if r.id not in wanted)
        parked = []
        for p in list(self.parked):
            mine = [r.id in wanted for r in p.requests]
            if any(mine):
                if not all(mine):
                    raise EngineError("move_out must name all requests parked together")
                self.parked.remove(p)
                parked.append(p)
        return Handover(exported, queued, parked)

    def move_in(self, handover: Handover) -> None:
        """Take a :class:`Handover` from an engine of the same version: running requests continue
        from their KV when slots and pages allow, else wait parked (KV in host memory, resumed
        before any new admission); queued ones wait for admission. Nothing is re-prefilled."""
        for r in handover.queued:
            self._check_admissible(r)
        if handover.running is not None:
            if self.can_import(handover.running):
                self.import_requests(handover.running)
            else:
                self._check_version(handover.running.requests)
                handover.running.kv = np.asarray(handover.running.kv)
                self.parked.append(handover.running)  # counted as moved when it is resumed
        for p in handover.parked:
            self._check_version(p.requests)
            self.parked.append(p)
        self.pending.extend(handover.queued)

    def park(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Export requests with their KV copied to host memory (the hierarchical KV store)."""
        out = self.export_requests(ids)
        out.kv = np.asarray(out.kv)
        return out

    def interrupt(self, ids: Sequence[Hashable]) -> list[Request]:
        """Stop requests (running, pending or parked) and return them without KV; what they
        generated so far stays on the returned records."""
        wanted, out = set(ids), []
        for slot, r in enumerate(self.slots):
            if r is not None and r.id in wanted:
                self.free_resource(slot)
                out.append(r)
        out += [r for r in self.pending if r.id in wanted]
        self.pending = deque(r for r in self.pending if r.id not in wanted)
        for p in list(self.parked):
            if any(r.id in wanted for r in p.requests):
                if not all(r.id in wanted for r in p.requests):
                    raise EngineError("interrupt must name all requests parked together")
                self.parked.remove(p)
                out += p.requests
        missing = wanted - {r.id for r in out}
        if missing:
            raise EngineError(f"unknown request id(s) {sorted(map(str, missing))}")
        return out

    # -- internals -----------------------------------------------------------------------------
    def _check_admissible(self, r: Request) -> None:
        rc = self.rcfg
        if self.params is None:
            raise EngineError("load_params must be called before submitting requests")
        if r.version != self.version:
            raise EngineError(
                f"request {r.id!r} is of version {r.version}, this engine serves "
                f"version {self.version}"
            )
        if not r.prompt:
            raise EngineError(f"request {r.id!r} has an empty prompt")
        if len(r.prompt) > rc.max_prompt_len:
            raise EngineError(
                f"request {r.id!r}: prompt of {len(r.prompt)} tokens is longer than "
                f"rollout.max_prompt_len={rc.max_prompt_len}"
            )
        if not 0 < r.max_new_tokens <= rc.max_new_tokens:
            raise EngineError(
                f"request {r.id!r}: max_new_tokens={r.max_new_tokens} must be in "
                f"[1, rollout.max_new_tokens={rc.max_new_tokens}]"
            )

    def _check_version(self, requests: Iterable[Request]) -> None:
        for r in requests:
            if r.version != self.version:
                raise EngineError(
                    f"request {r.id!r} is of version {r.version}, this engine serves "
                    f"version {self.version}: requests never move across versions"
                )

    def _free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def _running(self, rid: Hashable) -> Request:
        for r in self.slots:
            if r is not None and r.id == rid:
                return r
        raise EngineError(f"request {rid!r} is not running on this engine")

    def _page_ids(self, ids: list[int]) -> jax.Array:
        """Every layer's copy of pages ``ids`` (layer-major), padded to a power of two with the
        padding page 0 (bounded recompiles)."""
        n = 1
        while n < len(ids):
            n *= 2
        padded = np.zeros(n, np.int32)
        padded[: len(ids)] = ids
        return jax.device_put(np.asarray(self.cache.global_pages(padded), np.int32), self._rep)

    def _block_tables(self, reqs: Sequence[Request], rows: int) -> np.ndarray:
        """``int32[rows, width]`` page tables (padding page 0), width bucketed by the longest."""
        tables = [self.alloc.table(r.id) for r in reqs]
        width = _bucket(max(len(t) for t in tables), self.width_buckets)
        out = np.zeros((rows, width), np.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = t
        return out

    def _put(self, *arrays):
        return jax.device_put(arrays, self._rep)

    def _finish_if_done(self, r: Request, out: list[FinishedRequest]) -> None:
        if r.tokens[-1] in self.eos_ids or len(r.tokens) >= r.max_new_tokens:
            reason = "eos" if r.tokens[-1] in self.eos_ids else "length"
            out.append(
                FinishedRequest(
                    id=r.id,
                    prompt=tuple(r.prompt),
                    tokens=tuple(r.tokens),
                    logprobs=tuple(r.logprobs),
                    version=r.version,
                    finish_reason=reason,
                    prefill_tokens=r.prefill_tokens,
                    migrations=r.migrations,
                    latency_s=time.perf_counter() - r.submitted_at,
                    routes=self._finished_routes(r),
                )
            )
            self.free_resource(self.slots.index(r))

    def _finished_routes(self, r: Request) -> np.ndarray | None:
        """``int16[len(prompt) + len(tokens), L, k]``: the recorded routes of the fed tokens and
        a row of -1 for the last token (never fed); None for dense models."""
        if not self.cfg.is_moe:
            return None
        L, k = self.cfg.num_layers, self.cfg.num_experts_per_tok
        fed = r.fed_routes(L, k)
        if len(fed) != r.cached_tokens:
            raise EngineError(f"request {r.id!r}: {len(fed)} tokens' routes recorded for "
                              f"{r.cached_tokens} fed tokens")  # fmt: skip
        return np.concatenate([fed, np.full((1, L, k), -1, ROUTE_DTYPE)])

    def _prefill(self, reqs: list[Request], report: StepReport) -> list[FinishedRequest]:
        t0 = time.perf_counter()
        for r in reqs:
            self._check_admissible(r)
            slot = self._free_slot()
            if slot is None:
                raise EngineError("no free slot to prefill into")
            self.alloc.ensure(r.id, r.cached_tokens + 1)
            self.slots[slot] = r
        seqs = [list(r.prompt) + list(r.tokens[:-1]) for r in reqs]
        C = self.rcfg.prefill_chunk
        B = _bucket(len(reqs), self.buckets)
        tables = self._block_tables(reqs, B)
        keys = np.zeros((B, 2), np.uint32)
        for i, r in enumerate(reqs):
            keys[i] = r.key
        tables_d, keys_d = self._put(tables, keys)
        moe = self.cfg.is_moe
        for r in reqs:  # a prefill (re)computes the routes of every fed token
            r.routes = []
        longest = max(len(s) for s in seqs)
        for start in range(0, longest, C):
            chunk = np.zeros((B, C), np.int32)
            starts = np.full(B, start, np.int32)
            valid = np.zeros(B, np.int32)
            for i, s in enumerate(seqs):
                piece = s[start : start + C]
                chunk[i, : len(piece)] = piece
                valid[i] = len(piece)
            self.cache, tok, lp, _, routes = _prefill_jit(
                self.params,
                self.cache,
                *self._put(chunk, starts, valid),
                tables_d,
                keys_d,
                st=self._st,
            )
            if moe:
                routes = np.asarray(routes).astype(ROUTE_DTYPE)
                for i, r in enumerate(reqs):
                    if valid[i]:
                        r.routes.append(routes[i, : valid[i]].copy())
            ends = [i for i, s in enumerate(seqs) if start < len(s) <= start + C]
            if ends:
                tok, lp = np.asarray(tok), np.asarray(lp)
                for i in ends:
                    r = reqs[i]
                    r.prefill_tokens += len(seqs[i])
                    if r.tokens:  # re-prefilled (partial-rollout baseline)
                        report.reprefill_tokens += len(seqs[i])
                    else:  # a fresh request: its first token comes from prefill
                        report.sampled_tokens += 1
                        r.tokens.append(int(tok[i]))
                        r.logprobs.append(float(lp[i]))
                        r.first_token_at = time.perf_counter()
        report.prefill_tokens += sum(len(s) for s in seqs)
        for r in reqs:
            if len(r.tokens) and r.first_token_at is not None:
                self._finish_if_done(r, report.finished)
        report.prefill_s += time.perf_counter() - t0
        return report.finished

    def _decode(self, report: StepReport, only: set | None = None) -> list[FinishedRequest]:
        t0 = time.perf_counter()
        rows = [r for r in self.slots if r is not None and (only is None or r.id in only)]
        rows = self._reserve_pages(rows)
        if not rows:
            return report.finished
        B = _bucket(len(rows), self.buckets)
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        tables = self._block_tables(rows, B)
        active = np.zeros(B, bool)
        keys = np.zeros((B, 2), np.uint32)
        remaining = np.zeros(B, np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.tokens[-1], r.total_tokens - 1
            active[i], keys[i] = True, r.key
            remaining[i] = r.max_new_tokens - len(r.tokens)
        self.cache, tok, lp, logits, routes = _decode_jit(
            self.params,
            self.cache,
            *self._put(tokens, positions, tables, active, keys, remaining),
            st=self._st,
        )
        tok, lp = np.asarray(tok), np.asarray(lp)
        if logits is not None:
            self.last_logits = {r.id: np.asarray(logits[i]) for i, r in enumerate(rows)}
        routes = None if routes is None else np.asarray(routes).astype(ROUTE_DTYPE)  # [S,B,L,k]
        sampled = 0
        for i, r in enumerate(rows):
            for j in range(min(self.decode_steps, int(remaining[i]))):
                if routes is not None:  # step j's fed token: the last token before this append
                    r.routes.append(routes[j, i][None])
                r.tokens.append(int(tok[j, i]))
                r.logprobs.append(float(lp[j, i]))
                sampled += 1
                if r.tokens[-1] in self.eos_ids:
                    break
            self._finish_if_done(r, report.finished)
        report.decode_tokens += sampled
        report.sampled_tokens += sampled
        report.decode_s += time.perf_counter() - t0
        return report.finished

    def _reserve_pages(self, rows: list[Request]) -> list[Request]:
        """Make sure each row has a page for the token it is about to write. When pages run out,
        park the requests with the least work done, one at a time, to host memory (their KV is
        kept: no re-prefill) until the rest fit."""
        queue = sorted(rows, key=lambda r: -r.total_tokens)
        kept: list[Request] = []
        while queue:
            r = queue[0]
            need = r.total_tokens + min(self.decode_steps, r.max_new_tokens - len(r.tokens)) - 1
            if self.alloc.can_hold(r.id, need):
                self.alloc.ensure(r.id, need)
                kept.append(queue.pop(0))
            else:
                victim = queue.pop()  # the least advanced (possibly r itself)
                self.parked.append(self.park([victim.id]))
        return kept

    def _resume_parked(self) -> None:
        while self.parked and self.can_import(self.parked[0]):
            self.import_requests(self.parked.popleft())
