"""An in-memory :class:`~dora_jax.orchestrator.backend.RolloutBackend` for tests and comparisons.

Cost model, in ticks (one tick = one engine step of every group):

- A request's response length is drawn when it is first submitted, from a log-normal with the
  given median and ``p99 / median`` ratio (clipped to ``[1, max_new_tokens]``), as a function of
  ``(seed, request_id)`` only, so every mode sees the same workload for the same request ids.
  ``prompt_corr`` correlates the lengths of one prompt group (hard prompts: long responses).
- Prefill is compute-bound and blocks the engine: in a tick where any request of a group still has
  context to prefill, the group prefills up to ``prefill_tokens_per_tick`` tokens (oldest request
  first) and decodes nothing. Otherwise every runnable request samples one token.
- ``weight_transfer_ticks``: a ``set_version`` makes the group busy (no prefill, no decode).
- ``migrate_ticks``: a migrated request waits that long before it runs on its new group.
- Slots: ``max_slots`` per group. KV: each admitted request reserves pages for its prompt plus
  ``max_new_tokens``; ``kv_pages_used`` counts the pages its cached tokens fill now.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

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
    check_migrate,
    check_set_version,
    check_submit,
)

_Z99 = 2.3263478740408408  # the 0.99 quantile of the standard normal


@dataclass(frozen=True)
class FakeBackendConfig:
    num_groups: int = 4
    max_slots: int = 16
    page_size: int = 16
    kv_pages: int | None = None  # per group; None: room for max_slots full-length requests
    max_prompt_len: int = 512
    max_new_tokens: int = 4096
    length_median: float = 64.0
    length_p99_ratio: float = 10.0  # p99 / median of the response length (1: all equal)
    prompt_corr: float = 0.0  # share of log-length variance common to a prompt group, in [0, 1]
    prefill_tokens_per_tick: int = 1024
    weight_transfer_ticks: int = 4
    migrate_ticks: int = 1
    seed: int = 0

    def __post_init__(self):
        for name in ("num_groups", "max_slots", "page_size", "max_prompt_len", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_tokens_per_tick <= 0:
            raise ValueError("prefill_tokens_per_tick must be > 0")
        if self.length_median < 1 or self.length_p99_ratio < 1:
            raise ValueError("length_median and length_p99_ratio must be >= 1")
        if not 0.0 <= self.prompt_corr <= 1.0:
            raise ValueError(f"prompt_corr must be in [0, 1], got {self.prompt_corr}")
        if self.weight_transfer_ticks < 0 or self.migrate_ticks < 0:
            raise ValueError("weight_transfer_ticks and migrate_ticks must be >= 0")
        if self.kv_pages is not None and self.kv_pages < self.pages_per_request:
            raise ValueError(f"kv_pages must hold one request ({self.pages_per_request} pages)")

    @property
    def pages_per_request(self) -> int:
        """Pages reserved by a request with the longest prompt and response."""
        return -(-(self.max_prompt_len + self.max_new_tokens) // self.page_size)


def response_length(cfg: FakeBackendConfig, request_id: int, prompt_group: int) -> int:
    """The response length of a request: a pure function of the seed and the ids."""
    sigma = math.log(cfg.length_p99_ratio) / _Z99
    z = random.Random((cfg.seed << 40) ^ (request_id << 1)).gauss(0.0, 1.0)
    if cfg.prompt_corr > 0:
        zp = random.Random((cfg.seed << 40) ^ (prompt_group << 1) ^ 1).gauss(0.0, 1.0)
        z = math.sqrt(cfg.prompt_corr) * zp + math.sqrt(1.0 - cfg.prompt_corr) * z
    n = int(round(cfg.length_median * math.exp(sigma * z)))
    return max(1, min(cfg.max_new_tokens, n))


class _Req:
    __slots__ = (
        "rid",
        "pg",
        "prompt_len",
        "target",
        "generated",
        "prefill_left",
        "reprefill_left",
        "reserve",
        "ready_at",
        "versions",
        "payload",
    )

    def __init__(self, spec: RequestSpec, target: int, reserve: int, ready_at: int):
        self.rid, self.pg, self.prompt_len = spec.request_id, spec.prompt_group, spec.prompt_len
        self.target, self.reserve, self.ready_at = target, reserve, ready_at
        self.payload = spec.payload
        self.generated, self.reprefill_left, self.versions = 0, 0, []
        self.prefill_left = spec.prompt_len

    def cached(self) -> int:
        return self.prompt_len + self.generated - self.prefill_left


def _result(r: _Req) -> tuple:
    """A Finished- or PartialRequest's fields: id, prompt group, lengths, versions, payload."""
    return r.rid, r.pg, r.prompt_len, r.generated, tuple(r.versions), r.payload


class _Group:
    __slots__ = ("gid", "version", "transfer_left", "reqs", "reserved")

    def __init__(self, gid: int, version: int):
        self.gid, self.version, self.transfer_left = gid, version, 0
        self.reqs: dict[int, _Req] = {}
        self.reserved = 0


class FakeBackend:
    """Deterministic in-memory rollout groups; see the module docstring for the cost model. It
    runs on the logical clock only, so :meth:`pause` and :meth:`resume` have nothing to do."""

    tokens_per_slot_tick = 1

    def __init__(self, cfg: FakeBackendConfig):
        self.cfg = cfg
        self._kv_total = cfg.kv_pages or cfg.max_slots * cfg.pages_per_request  # (never 0)
        self._groups = [_Group(g, 0) for g in range(cfg.num_groups)]
        self._published = 0
        self._tick = 0
        self._where: dict[int, _Group] = {}  # live request id -> its group
        self._seen: set[int] = set()  # every request id ever submitted
        self._interrupted: dict[int, tuple[int, int]] = {}  # id -> (target length, cached tokens)

    # -- queries ---------------------------------------------------------------------------------

    def _free_slots(self, g: _Group) -> int:
        by_kv = (self._kv_total - g.reserved) // self.cfg.pages_per_request
        return max(0, min(self.cfg.max_slots - len(g.reqs), by_kv))

    def groups(self) -> list[GroupInfo]:
        ps, slots, total = self.cfg.page_size, self.cfg.max_slots, self._kv_total
        out = []
        for g in self._groups:
            ids, pages = tuple(g.reqs), tuple(-(-r.cached() // ps) for r in g.reqs.values())
            free, used = self._free_slots(g), sum(pages)
            out.append(
                GroupInfo(g.gid, g.version, g.transfer_left, slots, free, used, total, ids, pages)
            )
        return out

    def live_requests(self) -> int:
        return len(self._where)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    # -- commands --------------------------------------------------------------------------------

    def _group(self, group: int) -> _Group:
        if not 0 <= group < len(self._groups):
            raise BackendError(f"no group {group}")
        return self._groups[group]

    def publish(self, version: int) -> None:
        if version != self._published + 1:
            raise BackendError(f"publish({version}): the last published is {self._published}")
        self._published = version

    def set_version(self, group: int, version: int, source: Source) -> None:
        g = self._group(group)
        if source != TRAINER:
            self._group(int(source))
        version_of = lambda i: self._groups[i].version  # noqa: E731
        if not check_set_version(group, version, source, len(g.reqs), self._published, version_of):
            return
        wait = 0 if source == TRAINER else self._groups[int(source)].transfer_left
        g.version = version
        g.transfer_left = wait + self.cfg.weight_transfer_ticks

    def submit(self, group: int, requests: list[RequestSpec]) -> None:
        g = self._group(group)
        free, limit = self._free_slots(g), self.cfg.max_prompt_len
        check_submit(group, requests, free, g.version, limit, self._seen, self._interrupted)
        for spec in requests:
            reserve = -(-(spec.prompt_len + self.cfg.max_new_tokens) // self.cfg.page_size)
            if spec.resume is None:
                target = response_length(self.cfg, spec.request_id, spec.prompt_group)
                r = _Req(spec, target, reserve, self._tick)
            else:
                target, cached = self._interrupted.pop(spec.request_id)
                r = _Req(spec, target, reserve, self._tick)
                r.generated = spec.resume.generated
                r.prefill_left = spec.prompt_len + r.generated
                r.reprefill_left = cached
                r.versions = list(spec.resume.versions)
            self._seen.add(spec.request_id)
            g.reqs[r.rid] = r
            g.reserved += reserve
            self._where[r.rid] = g

    def migrate(self, request_ids: list[int], src: int, dst: int) -> None:
        s, d = self._group(src), self._group(dst)
        where = lambda r: getattr(self._where.get(r), "gid", None)  # noqa: E731
        version_of = lambda i: self._groups[i].version  # noqa: E731
        check_migrate(request_ids, src, dst, version_of, where, self._free_slots(d))
        for rid in request_ids:
            r = s.reqs.pop(rid)
            s.reserved -= r.reserve
            r.ready_at = max(r.ready_at, self._tick + self.cfg.migrate_ticks)
            d.reqs[rid] = r
            d.reserved += r.reserve
            self._where[rid] = d

    def interrupt(self, request_ids: list[int], discard: bool = False) -> list[PartialRequest]:
        for rid in request_ids:
            if rid not in self._where:
                raise BackendError(f"interrupt: request {rid} is not running")
        out = []
        for rid in request_ids:
            g = self._where.pop(rid)
            r = g.reqs.pop(rid)
            g.reserved -= r.reserve
            self._interrupted[rid] = (r.target, r.cached())
            out.append(PartialRequest(*_result(r)))
        return out

    def step(self) -> StepEvents:
        t = self._tick
        rate = self.cfg.prefill_tokens_per_tick
        finished: list[FinishedRequest] = []
        ticks: list[GroupTick] = []
        for g in self._groups:
            reqs = g.reqs
            n = len(reqs)
            tokens = prefill = reprefill = 0
            if g.transfer_left > 0:
                g.transfer_left -= 1
                activity = "transfer"
            elif not n:
                activity = "idle"
            else:
                runnable = [r for r in reqs.values() if r.ready_at <= t]
                filling = [r for r in runnable if r.prefill_left > 0]
                if filling:
                    activity, budget = "prefill", rate
                    for r in filling:
                        use = min(budget, r.prefill_left)
                        re = min(use, r.reprefill_left)
                        r.prefill_left -= use
                        r.reprefill_left -= re
                        prefill, reprefill, budget = prefill + use, reprefill + re, budget - use
                        if budget == 0:
                            break
                elif runnable:
                    activity, v = "decode", g.version
                    for r in runnable:
                        r.generated += 1
                        if not r.versions or r.versions[-1] != v:
                            r.versions.append(v)
                        if r.generated >= r.target:
                            del reqs[r.rid]
                            del self._where[r.rid]
                            g.reserved -= r.reserve
                            finished.append(FinishedRequest(*_result(r)))
                    tokens = len(runnable)
                else:
                    activity = "idle"
            ticks.append(GroupTick(g.gid, g.version, activity, n, tokens, prefill, reprefill, 1.0))
        self._tick += 1
        return StepEvents(tick=t, finished=tuple(finished), groups=tuple(ticks))
