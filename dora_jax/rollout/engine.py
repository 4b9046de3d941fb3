"""The host-side rollout engine of one group: continuous batching over fixed slots, one version.

Method names follow JetStream's Engine API where they mean the same (``load_params``,
``prefill``, ``free_resource``; see docs/jetstream.md), extended with what DORA needs: a policy
version, behavior logprobs, moving requests out and in with their KV pages (``export_requests`` /
``import_requests``, ``park`` to host memory, ``interrupt``: :mod:`dora_jax.rollout.moves`), and
multi-turn conversations.

One :meth:`step` gives every request in a slot exactly one new token: admitted requests get their
first token from prefill, running ones from one decode step. A request that cannot get a page
while decoding is parked in host memory (its KV kept, no re-prefill) and resumed first when pages
free up.

Conversations (``Request.multi_turn``): an EOS, a stop sequence or the token budget ends a model
*turn*. The request then frees its slot and waits with its KV (``StepReport.turn_ends`` reports
it) until :meth:`extend` appends the environment's turn, which is prefilled into the same KV
(from where its cache ends: never a re-prefill of earlier turns) and sampled from, or :meth:`end`
frees it. Waiting requests are the first parked to host memory when pages run short, and move,
park, interrupt and snapshot like any other.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
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
from dora_jax.rollout.moves import EngineError, EngineSnapshot, Handover, padded_pages, split_parked
from dora_jax.rollout.page_allocator import PageAllocator
from dora_jax.rollout.requests import ROUTE_DTYPE, EngineFinished, ExportedRequests, Request
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.rollout.steps import (
    KVCache,
    StepStatic,
    decode_step,
    init_cache,
    prefill_step,
    sample_rows,
    stop_ids,
)

__all__ = ["Engine", "EngineError", "EngineLoad", "EngineSnapshot", "Handover", "StepReport"]

# Pack buffer [2, 1, K, L * n, Z, H]: the kernels' [2, L, K, n, Z, H] layout applied to the
# layer-major cache viewed as one "layer" (see KVCache); page j of layer l sits at l * n + j.
BUFFER_SPEC = P(None, None, "model", None, None, None)


@dataclass(frozen=True)
class EngineLoad:
    version: int | None
    active: int
    pending: int
    parked: int
    free_slots: int
    pages_used: int
    pages_total: int
    waiting: int = 0  # conversations waiting on their environment (not parked)


@dataclass
class StepReport:
    finished: list[EngineFinished]
    prefill_tokens: int = 0  # context tokens prefilled (re-prefills included)
    # prompt tokens whose K/V were copied from a request with the same prompt (not computed)
    shared_prefill_tokens: int = 0
    reprefill_tokens: int = 0  # the part of prefill_tokens that had been computed before
    sampled_tokens: int = 0  # new response tokens (first tokens from prefill + decode)
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # conversations whose model turn ended this step (each a record of the whole conversation
    # so far); they now wait for extend() or end()
    turn_ends: list[EngineFinished] = field(default_factory=list)


def _buckets(limit: int, factor: int) -> list[int]:
    """Padded sizes ``1, factor, factor**2, ...`` below ``limit``, then ``limit``."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= factor
    return out + [limit]


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


_decode_jit = jax.jit(decode_step, static_argnames=("st",), donate_argnums=(1,))
_prefill_jit = jax.jit(prefill_step, static_argnames=("st",), donate_argnums=(1,))
_sample_rows_jit = jax.jit(sample_rows, static_argnames=("sampling",))


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
    (``Request.routes``; a finished one carries them as ``EngineFinished.routes``), for routing
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
            raise EngineError(
                "rollout.num_pages is null: the memory plan sizes it "
                "(pipeline.memory_plan), or set it"
            )
        self.impl, self.interpret = resolve_impl(rcfg.attention_impl, interpret)
        self.sampling = SamplingParams(rcfg.temperature, rcfg.top_k, rcfg.top_p)
        self.decode_steps = rcfg.decode_steps
        self._st = StepStatic(
            cfg=cfg,
            sampling=self.sampling,
            mesh=mesh,
            impl=self.impl,
            interpret=self.interpret,
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
        self.parked: deque[ExportedRequests] = deque()  # one request each, KV on the host
        # conversations waiting on their environment (KV kept, no slot), and those extended
        # with its turn, queued for the prefill of it
        self.waiting: dict[Hashable, Request] = {}
        self.ready: deque[Request] = deque()
        # Batch-invariant decoding uses one batch shape, so a row's numerics never depend on
        # how many other requests share the step (bit-identical continuation after migration).
        # Otherwise batch rows and block-table widths (pages attended) are bucketed.
        rows = rcfg.resolved_prefill_rows
        if rcfg.batch_invariant:
            self.buckets, self.width_buckets = [rcfg.max_slots], [self.pages_per_seq]
            self.prefill_buckets = [rows]
        else:
            self.buckets = _buckets(rcfg.max_slots, 4)
            self.width_buckets = _buckets(self.pages_per_seq, 2)
            self.prefill_buckets = _buckets(rows, 4)
        self.params: Params | None = None
        self.version: int | None = None
        self.last_logits: dict[Hashable, np.ndarray] = {}  # per request, last decode (tests)
        self._rep = NamedSharding(mesh, P())
        self._param_shardings = sh.tree_shardings(
            param_axes(cfg), abstract_params(cfg), sh.rollout_rules(), mesh
        )

    # -- JetStream-style API -------------------------------------------------------------------
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
        """Queue requests for admission (prefill when a slot and pages are free); a conversation
        submitted while it waits on its environment (resubmitted after an interrupt) waits."""
        for r in requests:
            self._check_admissible(r)
            if r.kv_len:
                raise EngineError(f"request {r.id!r} is submitted with KV (import it instead)")
            self._queue(r)

    def prefill(self, requests: Sequence[Request]) -> list[EngineFinished]:
        """Prefill ``requests`` into free slots now (chunked), sampling each first token."""
        return self._prefill(list(requests), StepReport([]))

    def free_resource(self, slot: int) -> None:
        r = self.slots[slot]
        if r is None:
            raise EngineError(f"slot {slot} is already free")
        self.alloc.free(r.id)
        self.slots[slot] = None

    # -- conversations ---------------------------------------------------------------------------
    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Append the environment's turn to a conversation waiting on it; the next :meth:`step`
        that has a slot for it prefills those tokens into its KV and samples the model's next
        turn. Refused unless the request waits, or if its budget would leave no model token."""
        r = self._waiting_request(rid)
        ids = [int(t) for t in tokens]
        if not ids:
            raise EngineError(f"request {rid!r}: an environment turn needs at least one token")
        room = r.max_new_tokens - len(r.tokens) - len(ids)
        if room < 1:
            raise EngineError(
                f"request {rid!r}: {len(ids)} environment tokens leave {room} of its "
                f"{r.max_new_tokens} tokens for the model (it needs at least one)"
            )
        r.append_env_turn(ids)
        if r.id in self.waiting:
            del self.waiting[r.id]
            (self.ready if r.kv_len else self.pending).append(r)
        # a parked one resumes (and is then fed) when pages allow

    def end(self, ids: Iterable[Hashable]) -> None:
        """Free conversations whose episode is over (they wait on their environment)."""
        for rid in ids:
            r = self._waiting_request(rid)
            if r.id in self.waiting:
                del self.waiting[r.id]
                if r.kv_len:
                    self.alloc.free(r.id)
            else:
                self.parked = deque(p for p in self.parked if p.requests[0].id != r.id)

    def _waiting_request(self, rid: Hashable) -> Request:
        if rid in self.waiting:
            return self.waiting[rid]
        for p in self.parked:
            if p.requests[0].id == rid and p.requests[0].waiting:
                return p.requests[0]
        raise EngineError(f"request {rid!r} is not waiting on its environment here")

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Resume parked requests, feed (prefill) the admitted and extended ones, decode running
        ones."""
        report = StepReport([])
        running = [r for r in self.slots if r is not None and not r.needs_feed]
        self._resume_parked()
        free_slots = sum(r is None for r in self.slots)
        budget = self.alloc.pages_free
        # Parked requests go first: no admission while any wait for pages (no starvation); then
        # conversations extended by their environment, then new requests.
        for queue in (self.ready, self.pending):
            while queue and free_slots and not self._resumable_parked():
                r = queue[0]
                need = self.alloc.pages_for(r.feed_end + 1)
                if r.kv_len:
                    need -= len(self.alloc.table(r.id))
                if need > budget:
                    break
                budget -= max(need, 0)
                free_slots -= 1
                self.slots[self._free_slot()] = queue.popleft()
        feed = [r for r in self.slots if r is not None and r.needs_feed]
        if feed:
            self._prefill(feed, report)
        if running:
            self._decode(report, only={r.id for r in running})
        return report

    def load(self) -> EngineLoad:
        return EngineLoad(
            version=self.version,
            active=sum(r is not None for r in self.slots),
            pending=len(self.pending) + len(self.ready),
            parked=sum(len(p.requests) for p in self.parked),
            free_slots=sum(r is None for r in self.slots),
            pages_used=self.alloc.pages_used,
            pages_total=self.alloc.pages_total,
            waiting=len(self.waiting),
        )

    @property
    def num_requests(self) -> int:
        ld = self.load()
        return ld.active + ld.pending + ld.parked + ld.waiting

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything (run, admit or resume a request); requests
        waiting on their environment need no step."""
        busy = any(r is not None for r in self.slots) or bool(self.pending or self.ready)
        return busy or self._resumable_parked()

    def request_ids(self) -> list[Hashable]:
        ids = [r.id for r in self.slots if r is not None] + [r.id for r in self.pending]
        ids += [r.id for r in self.ready] + list(self.waiting)
        return ids + [r.id for p in self.parked for r in p.requests]

    def waiting_ids(self) -> list[Hashable]:
        """Conversations waiting on their environment (on the device, or parked)."""
        parked = [p.requests[0].id for p in self.parked if p.requests[0].waiting]
        return list(self.waiting) + parked

    def held_pages(self) -> dict[Hashable, int]:
        """Every request the engine holds and the device KV pages it holds now (0 for requests
        queued without KV or parked in host memory)."""
        out = {r.id: len(self.alloc.table(r.id)) for r in self._device_requests()}
        out.update((r.id, 0) for r in self._without_kv())
        out.update((r.id, 0) for p in self.parked for r in p.requests)
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

    def _pack(self, pages: list[int]) -> jax.Array:
        return _pack(self.cache, self._page_ids(pages), self.impl, self.interpret)

    def _unpack(self, buffer: jax.Array, ids: jax.Array) -> None:
        self.cache = _unpack(self.cache, buffer, ids, self.impl, self.interpret)

    def _page_ids(self, ids: list[int]) -> jax.Array:
        """Every layer's copy of pages ``ids`` (layer-major), padded to a power of two with the
        padding page 0 (bounded recompiles)."""
        padded = np.zeros(padded_pages(len(ids)), np.int32)
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

    def _after_sample(self, r: Request, report: StepReport) -> None:
        """A response that is over finishes (its slot and pages freed); a conversation whose
        model turn is over waits on its environment (its slot freed, its pages kept)."""
        reason = r.model_turn_ended(self.eos_ids)
        if reason is None:
            return
        record = EngineFinished(
            id=r.id,
            prompt=tuple(r.prompt),
            tokens=tuple(r.tokens),
            logprobs=tuple(r.logprobs),
            version=r.version,
            finish_reason=reason,
            prefill_tokens=r.prefill_tokens,
            migrations=r.migrations,
            latency_s=time.perf_counter() - r.submitted_at,
            routes=r.routes_with_last(self.cfg) if self.cfg.is_moe else None,
            turn_start=r.turn_start,
            env_spans=tuple(tuple(s) for s in r.env_spans),
        )
        slot = self.slots.index(r)
        if r.multi_turn:
            self.slots[slot] = None
            r.waiting = True
            self.waiting[r.id] = r
            report.turn_ends.append(record)
        else:
            self.free_resource(slot)
            report.finished.append(record)

    def _prefill(self, reqs: list[Request], report: StepReport) -> list[EngineFinished]:
        """Feed each request's tokens from ``kv_len`` to ``feed_end`` in chunks (a new prompt, a
        re-prefill after an interrupt, or an environment turn appended to a conversation),
        sampling a token after the feed when it ends with one the model did not sample. New
        requests with the same prompt are fed once (``rollout.share_prefill``)."""
        t0 = time.perf_counter()
        for r in reqs:
            if r not in self.slots:
                self._check_admissible(r)
                slot = self._free_slot()
                if slot is None:
                    raise EngineError("no free slot to prefill into")
                self.slots[slot] = r
            self.alloc.ensure(r.id, r.feed_end + 1)
        sample = [r.needs_sample for r in reqs]
        fed, sharers = self._prompt_sharers(reqs)
        rows = self.prefill_buckets[-1]
        for i in range(0, len(fed), rows):
            self._prefill_rows(fed[i : i + rows], sharers, report)
        for r, sampled in zip(reqs, sample, strict=True):
            if sampled:
                self._after_sample(r, report)
        report.prefill_s += time.perf_counter() - t0
        return report.finished

    def _prompt_sharers(self, reqs: list[Request]) -> tuple[list[Request], dict]:
        """The requests to feed, and for each that has them, the new requests with its prompt
        (they take its KV pages and logits instead of being fed)."""
        if not self.rcfg.share_prefill:
            return reqs, {}
        fed: list[Request] = []
        first: dict[tuple[int, ...], Request] = {}
        sharers: dict[Hashable, list[Request]] = {}
        for r in reqs:
            if r.kv_len or r.tokens:  # only a whole new prompt is shared
                fed.append(r)
                continue
            key = tuple(r.prompt)
            if key in first:
                sharers.setdefault(first[key].id, []).append(r)
            else:
                first[key] = r
                fed.append(r)
        return fed, sharers

    def _prefill_rows(self, reqs: list[Request], sharers: dict, report: StepReport) -> None:
        """One batch of :meth:`_prefill`: at most ``prefill_rows`` requests, chunk by chunk."""
        starts0 = [r.kv_len for r in reqs]
        seqs = [(r.prompt + r.tokens)[r.kv_len : r.feed_end] for r in reqs]
        sample = [r.needs_sample for r in reqs]
        C = self.rcfg.prefill_chunk
        B = _bucket(len(reqs), self.prefill_buckets)
        tables = self._block_tables(reqs, B)
        keys = np.zeros((B, 2), np.uint32)
        keys[: len(reqs)] = [r.key for r in reqs]
        tables_d, keys_d = self._put(tables, keys)
        moe = self.cfg.is_moe
        for r in reqs:  # a prefill from the start (re)computes the routes of every fed token
            if not r.kv_len:
                r.routes = []
        longest = max(len(s) for s in seqs)
        for start in range(0, longest, C):
            chunk = np.zeros((B, C), np.int32)
            starts = np.zeros(B, np.int32)
            valid = np.zeros(B, np.int32)
            for i, s in enumerate(seqs):
                piece = s[start : start + C]
                chunk[i, : len(piece)] = piece
                starts[i] = starts0[i] + start
                valid[i] = len(piece)
            self.cache, tok, lp, logits, routes = _prefill_jit(
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
                    end = starts0[i] + len(seqs[i])
                    r.prefill_tokens += len(seqs[i])
                    report.reprefill_tokens += max(0, min(end, r.kv_peak) - starts0[i])
                    r.kv_len, r.kv_peak = end, max(r.kv_peak, end)
                    if sample[i]:
                        report.sampled_tokens += 1
                        r.tokens.append(int(tok[i]))
                        r.logprobs.append(float(lp[i]))
                        if r.first_token_at is None:
                            r.first_token_at = time.perf_counter()
                self._take_shared(
                    [(i, s) for i in ends for s in sharers.get(reqs[i].id, ())],
                    reqs,
                    logits,
                    report,
                )
        report.prefill_tokens += sum(len(s) for s in seqs)

    def _take_shared(self, pairs: list, fed: list[Request], logits, report: StepReport) -> None:
        """Requests whose prompt was just fed in row ``i`` of ``fed`` (``pairs``: ``(i,
        request)``) get that row's KV pages copied into theirs, and sample their first token from
        its ``logits`` with their own keys."""
        if not pairs:
            return
        n = padded_pages(len(pairs))
        rows = np.zeros(n, np.int32)
        keys = np.zeros((n, 2), np.uint32)
        positions = np.zeros(n, np.int32)
        src: list[int] = []
        dst: list[int] = []
        for j, (i, r) in enumerate(pairs):
            rows[j], keys[j], positions[j] = i, r.key, len(r.prompt)
            pages = self.alloc.pages_for(len(r.prompt))
            src += self.alloc.table(fed[i].id)[:pages]
            dst += self.alloc.table(r.id)[:pages]
        tok, lp = _sample_rows_jit(
            logits, *self._put(rows, keys, positions), sampling=self.sampling
        )
        self._unpack(self._pack(src), self._page_ids(dst))  # the pages move as a migration's do
        tok, lp = np.asarray(tok), np.asarray(lp)
        for j, (i, r) in enumerate(pairs):
            r.kv_len = r.kv_peak = len(r.prompt)
            r.prefill_tokens += len(r.prompt)  # its prompt's K/V, made once (here: copied)
            r.routes = list(fed[i].routes)
            r.tokens.append(int(tok[j]))
            r.logprobs.append(float(lp[j]))
            r.first_token_at = time.perf_counter()
            report.sampled_tokens += 1
            report.shared_prefill_tokens += len(r.prompt)

    def _decode(self, report: StepReport, only: set | None = None) -> list[EngineFinished]:
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
                r.kv_len += 1
                sampled += 1
                if r.model_turn_ended(self.eos_ids) in ("eos", "stop"):
                    break  # (the device went on past a stop sequence: those tokens are dropped)
            r.kv_peak = max(r.kv_peak, r.kv_len)
            self._after_sample(r, report)
        report.decode_tokens += sampled
        report.sampled_tokens += sampled
        report.decode_s += time.perf_counter() - t0
        return report.finished

    def _reserve_pages(self, rows: list[Request]) -> list[Request]:
        """Make sure each row has a page for the token it is about to write. When pages run out,
        park conversations waiting on their environment first, then the requests with the least
        work done, one at a time, to host memory (their KV is kept: no re-prefill) until the
        rest fit."""
        queue = sorted(rows, key=lambda r: -r.total_tokens)
        kept: list[Request] = []
        while queue:
            r = queue[0]
            need = r.total_tokens + min(self.decode_steps, r.max_new_tokens - len(r.tokens)) - 1
            if self.alloc.can_hold(r.id, need):
                self.alloc.ensure(r.id, need)
                kept.append(queue.pop(0))
                continue
            idle = [w for w in self.waiting.values() if w.kv_len]
            if idle:  # the one holding the most pages
                victim = max(idle, key=lambda w: len(self.alloc.table(w.id)))
            else:
                victim = queue.pop()  # the least advanced (possibly r itself)
            self.parked.append(self.park([victim.id]))
        return kept

    def _resumable_parked(self) -> bool:
        return any(not p.requests[0].waiting for p in self.parked)

    def _resume_parked(self) -> None:
        """Resume parked requests, oldest first, while they fit (those still waiting on their
        environment stay parked)."""
        for p in list(self.parked):
            if p.requests[0].waiting:
                continue
            if not self.can_import(p):
                break
            self.parked.remove(p)
            self.import_requests(p)

    # -- moving requests -----------------------------------------------------------------------
    def move_sizes(self) -> list[int]:
        """The pack sizes a move can have here: powers of two up to the pages a group holds."""
        top = padded_pages(self.alloc.num_pages - 1)
        return [1 << i for i in range(top.bit_length())]

    def compile_move(self, size: int) -> None:
        """Compile the programs that pack and unpack a move of ``size`` padded pages on this
        group's device, by packing the padding page into itself (its content stays its own).
        Without it a group's first move of each size compiles on the spot: about 0.15 s on an
        idle CPU core, several times that beside busy groups."""
        ids = [0] * size
        self._unpack(self._pack(ids), self._page_ids(ids))
        jax.block_until_ready(self.cache)

    def compile_moves(self) -> list[int]:
        """:meth:`compile_move` for every size; returns the sizes."""
        sizes = self.move_sizes()
        for n in sizes:
            self.compile_move(n)
        return sizes

    def export_requests(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Take requests whose KV is on the device (running, waiting or ready to be fed) out with
        their KV pages packed into one buffer on this mesh. Their slots and pages are freed here;
        nothing is recomputed at the destination."""
        reqs = [self._on_device(i) for i in ids]
        for r in reqs:
            r.compact_routes()
        page_counts, kv = self._pack_requests(reqs)
        for r in reqs:
            self._release(r)
        return ExportedRequests(reqs, page_counts, kv)

    def snapshot(self):
        """A host copy of everything in flight (request records and the KV pages of the requests
        that have them on the device), taken without disturbing the engine: what a checkpoint
        stores."""
        on_device = self._device_requests()
        for r in on_device:
            r.compact_routes()
        counts, kv = self._pack_requests(on_device)
        kv = np.asarray(kv)
        return EngineSnapshot(
            version=self.version,
            running=ExportedRequests(copy.deepcopy(on_device), counts, kv),
            pending=copy.deepcopy(self._without_kv()),
            parked=copy.deepcopy(list(self.parked)),
        )

    def _pack_requests(self, reqs: Sequence[Request]) -> tuple[list[int], jax.Array]:
        """(pages per request, pack buffer of their cached KV), in request order."""
        counts = [self.alloc.pages_for(r.kv_len) for r in reqs]
        pages = [p for r, n in zip(reqs, counts, strict=True) for p in self.alloc.table(r.id)[:n]]
        return counts, self._pack(pages)

    def restore(self, snap) -> None:
        """Continue from a snapshot: the engine must be empty and serve ``snap.version``. Requests
        with KV get it back (no re-prefill); the rest queue or wait as they were."""
        if self.num_requests:
            raise EngineError(f"restore needs an empty engine, this one holds {self.num_requests}")
        if snap.version != self.version:
            raise EngineError(f"snapshot of version {snap.version}, engine serves {self.version}")
        if snap.running.requests:
            migrations = [r.migrations for r in snap.running.requests]
            self.import_requests(snap.running)
            for r, m in zip(snap.running.requests, migrations, strict=True):
                r.migrations = m  # a restore is not a migration
        for r in snap.pending:
            self._queue(r)
        for x in snap.parked:
            self.parked.extend(split_parked(x))

    def can_import(self, exported: ExportedRequests) -> bool:
        slots = sum(r is None for r in self.slots)
        running = sum(not r.waiting and not r.needs_feed for r in exported.requests)
        pages = sum(self.alloc.pages_for(self._room(r)) for r in exported.requests)
        return slots >= running and pages <= self.alloc.pages_free

    def import_requests(self, exported: ExportedRequests) -> None:
        """Take requests exported by an engine of the same version (any mesh of the same shape,
        or parked on the host) and continue them from their cached KV: a running one takes a
        slot, a waiting one waits here, one ready to be fed queues for its prefill."""
        self._check_version(exported.requests)
        if not self.can_import(exported):
            raise EngineError(
                f"no room for {len(exported.requests)} imported request(s): "
                f"{self.load().free_slots} free slot(s), {self.alloc.pages_free} free page(s)"
            )
        page_ids: list[int] = []
        for r, n in zip(exported.requests, exported.page_counts, strict=True):
            table = self.alloc.ensure(r.id, self._room(r))
            page_ids.extend(table[:n])
            r.migrations += 1
        ids = self._page_ids(page_ids)
        kv = exported.kv
        if kv.shape[3] != ids.shape[0]:
            raise EngineError(f"KV buffer holds {kv.shape[3]} pages, expected {ids.shape[0]}")
        self._unpack(jax.device_put(kv, self.buffer_sharding), ids)
        for r in exported.requests:
            self._place(r)

    def move_out(self, ids: Iterable[Hashable]) -> Handover:
        """Take requests out for another engine of this version, wherever they are here: those
        with KV on the device packed, those without as they are, parked ones with their host KV.
        Ids this engine does not hold (finished meanwhile) are skipped; :attr:`Handover.ids` says
        which were taken."""
        wanted = set(ids)
        device = [r.id for r in self._device_requests() if r.id in wanted]
        exported = self.export_requests(device) if device else None
        queued = [r for r in self._without_kv() if r.id in wanted]
        self._drop_unqueued(wanted)
        parked = [p for p in self.parked if p.requests[0].id in wanted]
        self.parked = deque(p for p in self.parked if p.requests[0].id not in wanted)
        return Handover(exported, queued, parked)

    def move_in(self, handover: Handover) -> None:
        """Take a :class:`Handover` from an engine of the same version: requests with KV continue
        from it when slots and pages allow, else wait parked (KV in host memory, resumed before
        any new admission); the others queue or wait. Nothing is re-prefilled."""
        for r in handover.queued:
            self._check_admissible(r)
        if handover.running is not None:
            if self.can_import(handover.running):
                self.import_requests(handover.running)
            else:
                self._check_version(handover.running.requests)
                handover.running.kv = np.asarray(handover.running.kv)
                self.parked.extend(split_parked(handover.running))  # moved when resumed
        for p in handover.parked:
            self._check_version(p.requests)
            self.parked.extend(split_parked(p))
        for r in handover.queued:
            self._queue(r)

    def park(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Export requests with their KV copied to host memory (the hierarchical KV store)."""
        out = self.export_requests(ids)
        out.kv = np.asarray(out.kv)
        return out

    def interrupt(self, ids: Sequence[Hashable]) -> list[Request]:
        """Stop requests (wherever they are) and return them without KV; what they generated so
        far stays on the returned records (a conversation waiting on its environment still
        waits: resubmitted, it waits again, and is prefilled afresh when extended)."""
        wanted = set(ids)
        out = [r for r in self._device_requests() if r.id in wanted]
        for r in out:
            self._release(r)
        out += [r for r in self._without_kv() if r.id in wanted]
        self._drop_unqueued(wanted)
        out += [p.requests[0] for p in self.parked if p.requests[0].id in wanted]
        self.parked = deque(p for p in self.parked if p.requests[0].id not in wanted)
        missing = wanted - {r.id for r in out}
        if missing:
            raise EngineError(f"unknown request id(s) {sorted(map(str, missing))}")
        for r in out:
            r.kv_len = 0
        return out

    # -- where requests are --------------------------------------------------------------------
    def _device_requests(self) -> list[Request]:
        """Requests whose KV is in this engine's cache: running, waiting, ready to be fed."""
        out = [r for r in self.slots if r is not None]
        out += [r for r in self.waiting.values() if r.kv_len]
        return out + [r for r in self.ready if r.kv_len]

    def _without_kv(self) -> list[Request]:
        """Requests held with no KV: queued for admission, or waiting/ready after an interrupt."""
        out = list(self.pending)
        out += [r for r in self.waiting.values() if not r.kv_len]
        return out + [r for r in self.ready if not r.kv_len]

    def _drop_unqueued(self, ids: set) -> None:
        """Forget the requests of ``ids`` that hold no KV here (they leave the engine)."""
        self.pending = deque(r for r in self.pending if r.id not in ids)
        self.ready = deque(r for r in self.ready if r.kv_len or r.id not in ids)
        for rid in [i for i, r in self.waiting.items() if not r.kv_len and i in ids]:
            del self.waiting[rid]

    def _on_device(self, rid: Hashable) -> Request:
        for r in self._device_requests():
            if r.id == rid:
                return r
        raise EngineError(f"request {rid!r} has no KV on this engine")

    def _release(self, r: Request) -> None:
        """Free ``r``'s slot or queue place and its pages (it leaves the engine)."""
        if r in self.slots:
            self.slots[self.slots.index(r)] = None
        elif r.id in self.waiting:
            del self.waiting[r.id]
        else:
            self.ready.remove(r)
        self.alloc.free(r.id)

    def _place(self, r: Request) -> None:
        """Put a request whose KV pages this engine now holds where its state says."""
        if r.waiting:
            self.waiting[r.id] = r
        elif r.needs_feed:
            self.ready.append(r)
        else:
            self.slots[self._free_slot()] = r

    def _queue(self, r: Request) -> None:
        """Hold a request that has no KV here: it waits (conversation), or queues for admission."""
        if r.waiting:
            self.waiting[r.id] = r
        elif r.tokens and r.needs_sample:
            self.ready.append(r)  # extended while it was away: prefilled from the start
        else:
            self.pending.append(r)

    @staticmethod
    def _room(r: Request) -> int:
        """Tokens of KV the request needs pages for: what it has, or what its next write adds."""
        return max(r.kv_len, 1) if r.waiting else r.feed_end + 1
