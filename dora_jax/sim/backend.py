"""A simulated :class:`~dora_jax.orchestrator.backend.RolloutBackend`: rollout groups whose work
takes the time a cost model (:mod:`dora_jax.sim.cost_model`) says it takes.

**Time.** A tick is a fixed quantum of modeled time, ``tick_s`` seconds, for every group: the
control plane's tick count times ``tick_s`` is modeled time. Within a tick each group spends its
budget (``tick_s`` plus what it carried over) in this order: the rest of a weight transfer, KV it
receives by migration, prefill (oldest request first; the last one may be cut into a chunk), then
decode steps at the rate the cost model gives for its batch and contexts: ``k`` steps such that
``k * t_step(average batch, average context over those k steps) = budget`` (a two-pass fixed point;
requests that finish within the tick leave the batch at their last token). The fraction of a step
that does not fit is carried into the next tick, so long runs lose no time to rounding. A request
that finishes mid-tick frees its slot at the next tick boundary, when the control plane admits.

**Memory.** A group holds ``kv_capacity`` tokens of KV (cost model). Admission reserves room to
grow: each held request counts ``max(context, prompt + admit_reserve_tokens)`` tokens, and a group
admits (``free_slots``) while that sum plus ``admit_reserve_tokens`` per new request stays under
``admit_watermark`` of the capacity (an empty group always admits one). Long requests outgrow
their reservation; past capacity the newest requests are parked in host memory (the paper's
hierarchical KV) and wait, without cost, until room frees.
``kv_pages_used`` counts every held request's pages (device and host), so it may exceed
``kv_pages_total``: that is what the planner's KV-pressure trigger sees. ``migrate`` checks slots
only (each migrated request brings its own KV).

**Colocated placement.** :meth:`freeze` makes every group spend the ticks until a given one
training (no rollout progress, no transfer): the trainer calls it when rollout and training share
the devices.

**One shared device** (``shared_device``): each tick's ``tick_s`` is divided among the groups
with work (:mod:`dora_jax.sim.shared_device`).

**Conversations** (``conversations`` given: :mod:`dora_jax.sim.conversations`). A request
decodes model turn after model turn. At the end of one (its ``target``) it frees its decode slot
and waits its environment's latency (and, with ``latency.workers``, its turn for an
environment worker: :mod:`dora_jax.sim.waiting`), in modeled time that runs on whatever the
group does (or does not do), while its KV, all its tokens so far, stays counted on the group
(admission, parking, ``kv_pages_used``); the group decodes its other requests meanwhile. When the
observation arrives its tokens are prefilled as an extend of the cached context (only they cost
prefill), and the next model turn decodes. A turn ends at the time its last token was sampled
within the tick (the group's decode step times the tokens it took); an observation arrives at
the tick boundary nearest its time, so waits are not biased by the tick. A waiting request is
one of the group's requests for the control plane (it pins the group's version, it can migrate
with its KV and its turn state, ``interrupt`` returns it with both) but takes no slot: a group
may hold more requests than slots, and decodes (and prefills) at most ``max_slots`` at a time,
oldest first. Its :class:`~dora_jax.sim.waiting.WaitingRequests` (``waiting``) records, per
tick and group, the requests waiting on their environment, the KV tokens they hold, and the
seconds the group idled while they waited (its ``env_wait`` activity on the simulator's
timeline).

Response lengths come from :class:`~dora_jax.sim.workload.ResponseLengths`, a pure function of
``(seed, prompt group, request id mod G)``, so every mode gets the same workload.
"""

from __future__ import annotations

import numpy as np

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
from dora_jax.sim.config import FailureConfig
from dora_jax.sim.conversations import US, Conversations
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.failures import GroupFailures
from dora_jax.sim.requests import RequestTable
from dora_jax.sim.shared_device import device_shares
from dora_jax.sim.waiting import WaitingRequests
from dora_jax.sim.workload import ResponseLengths

# group-seconds accounting, per tick (summed over groups)
CATEGORIES = ("transfer", "migrate", "prefill", "reprefill", "decode", "idle", "train")
TRANSFER, MIGRATE, PREFILL, REPREFILL, DECODE, IDLE, TRAIN = range(len(CATEGORIES))
_ACTIVITY = ("idle", "prefill", "decode", "transfer", "migrate")


class SimBackend:
    """Simulated rollout groups; see the module docstring for the time and memory model. Its
    clock is logical (ticks of ``tick_s``), so :meth:`pause` and :meth:`resume` do nothing.
    ``requests`` holds the groups' requests (:class:`~dora_jax.sim.requests.RequestTable`);
    ``waiting`` runs conversations' turn boundaries and ``failures`` the groups' failures."""

    tokens_per_slot_tick = 1

    def __init__(
        self,
        cost: CostModel,
        num_groups: int,
        lengths: ResponseLengths,
        *,
        tick_s: float,
        max_slots: int,
        page_size: int = 16,
        max_prompt_len: int = 2048,
        admit_watermark: float = 0.85,
        admit_reserve_tokens: int = 2048,
        kv_capacity_tokens: int | None = None,
        conversations: Conversations | None = None,
        shared_device: bool = False,
        failures: FailureConfig | None = None,
        rollout_tp: int = 1,
    ):
        if num_groups < 1 or max_slots < 1 or tick_s <= 0 or page_size < 1:
            raise ValueError("need num_groups, max_slots, page_size >= 1 and tick_s > 0")
        if admit_reserve_tokens < 1 or (kv_capacity_tokens is not None and kv_capacity_tokens < 1):
            raise ValueError("need admit_reserve_tokens >= 1 and kv_capacity_tokens >= 1")
        self.cost, self.lengths, self.tick_s = cost, lengths, float(tick_s)
        self.num_groups, self.max_slots, self.page_size = num_groups, max_slots, page_size
        self.max_prompt_len = max_prompt_len
        # KV tokens a group holds on device (default: what the cost model's memory leaves)
        self.capacity = kv_capacity_tokens or cost.kv_capacity_tokens
        self.admit_limit = admit_watermark * self.capacity
        self.admit_reserve = admit_reserve_tokens
        self.conversations = conversations
        self.shared_device = bool(shared_device)
        self.requests = RequestTable(num_groups, max_slots)
        self.version = np.zeros(num_groups, np.int64)
        self.busy = np.zeros(num_groups)  # seconds of weight transfer left
        self.trip = np.zeros(num_groups)  # seconds a load from the trainer still waits
        self.mig = np.zeros(num_groups)  # seconds of incoming KV left
        self.carry = np.zeros(num_groups)
        self._frozen_until = 0
        self._published = 0
        self._tick = 0
        self._where: dict[int, int] = {}
        self._seen: set[int] = set()
        self._base_versions: dict[int, tuple[int, ...]] = {}
        self._payload: dict[int, object] = {}
        self.seconds: list[np.ndarray] = []  # per tick: group-seconds by CATEGORIES
        self.weight_transfers = 0
        self.migrated_requests = 0
        self.migrated_tokens = 0
        self.waiting = WaitingRequests(self.requests, conversations, max_slots, self.tick_s)
        self.failures = GroupFailures(failures, self.requests, rollout_tp, self.tick_s)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        return self._tick

    def live_requests(self) -> int:
        return len(self._where)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def _reserved(self, g: slice | int, k: int | None = None) -> np.ndarray:
        """KV tokens each held request counts for admission: its context, and at least its
        prompt plus ``admit_reserve_tokens`` (room to grow)."""
        cols = slice(None, k)
        plen, gen = self.requests.prompt_len[g, cols], self.requests.generated[g, cols]
        return np.maximum(plen + gen, plen + self.admit_reserve)

    def _free(self, reserved: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Requests each group may admit now: free slots, and room under the watermark for
        ``admit_reserve_tokens`` each (an empty group may always admit one)."""
        by_kv = np.floor((self.admit_limit - reserved) / self.admit_reserve).astype(np.int64)
        by_kv = np.maximum(by_kv, (self.requests.count == 0).astype(np.int64))
        return np.maximum(0, np.minimum(self.max_slots - held, by_kv))

    def _free_one(self, g: int) -> int:
        q = self.requests
        k = int(q.count[g])
        reserved = float(self._reserved(g, k).sum())
        by_kv = max(int(np.floor((self.admit_limit - reserved) / self.admit_reserve)), int(k == 0))
        held = k if self.conversations is None else k - int((q.wake_us[g, :k] > 0).sum())
        return max(0, min(self.max_slots - held, by_kv))

    def groups(self) -> list[GroupInfo]:
        q = self.requests
        w = q.width()
        valid = q.held(w)
        full = np.where(valid, q.context(w), 0)
        pages = -(-full // self.page_size)
        used = pages.sum(axis=1)
        reserved = np.where(valid, self._reserved(slice(None), w), 0).sum(axis=1)
        free = self._free(reserved, self.waiting.slots_held(w))
        total = self.capacity // self.page_size
        busy = np.ceil((self.trip + self.busy) / self.tick_s - 1e-9).astype(np.int64)
        out, down = [], self.failures.down(self._tick)
        for g in np.flatnonzero(~down).tolist():  # (a failed group is out until it is back)
            k, v, b = int(q.count[g]), int(self.version[g]), int(busy[g])
            ids, pg = tuple(q.request_id[g, :k].tolist()), tuple(pages[g, :k].tolist())
            info = GroupInfo(g, v, b, self.max_slots, int(free[g]), int(used[g]), total, ids, pg)
            out.append(info)
        return out

    # -- commands --------------------------------------------------------------------------------

    def _group(self, group: int) -> int:
        if not 0 <= group < self.num_groups:
            raise BackendError(f"no group {group}")
        return group

    def publish(self, version: int) -> None:
        if version != self._published + 1:
            raise BackendError(f"publish({version}): the last published is {self._published}")
        self._published = version

    def freeze(self, until_tick: int) -> None:
        """Colocated placement: every group trains (no rollout) until tick ``until_tick``."""
        self._frozen_until = max(self._frozen_until, int(until_tick))

    def set_version(self, group: int, version: int, source: Source) -> None:
        g = self._group(group)
        if source != TRAINER:
            self._group(int(source))
        held, version_of = int(self.requests.count[g]), lambda i: int(self.version[i])
        sendable = self.failures.sendable_versions(self.version, self._published, self._tick)
        if not check_set_version(g, version, source, held, self._published, version_of, sendable):
            return
        self._load(g, version, source)

    def _load(self, g: int, version: int, source: Source) -> None:
        """Group ``g`` loads ``version`` from ``source`` (from a group: after that one's own
        load)."""
        self.version[g] = version
        wait = 0.0 if source == TRAINER else float(self.trip[source] + self.busy[source])
        self.trip[g] = self.cost.weight_trip_s() if source == TRAINER else 0.0
        self.busy[g] = wait + self.cost.weight_transfer_s()
        self.weight_transfers += 1

    # (what the failures ask of their groups: :class:`~dora_jax.sim.failures.FailingGroups`)

    def load_newest(self, group: int) -> int:
        """Group ``group`` loads the newest published version from the trainer; returns it."""
        self._load(group, self._published, TRAINER)
        return self._published

    def loading(self, group: int) -> bool:
        """Whether group ``group`` still waits for weights it loads."""
        return bool(self.trip[group] > 0 or self.busy[group] > 0)

    def halt(self, group: int) -> None:
        """Group ``group`` drops its work in flight: weight loads, incoming KV, carried time."""
        self.trip[group] = self.busy[group] = self.mig[group] = self.carry[group] = 0.0

    def submit(self, group: int, requests: list[RequestSpec]) -> None:
        g = self._group(group)
        if not requests:
            return
        q = self.requests
        free, v = self._free_one(g), int(self.version[g])
        check_submit(group, requests, free, v, self.max_prompt_len, self._seen, q.parked)
        if len({s.request_id for s in requests}) < len(requests):
            raise BackendError("submit: duplicate request ids")
        pg = np.array([s.prompt_group for s in requests], np.int64)
        members = np.array([s.request_id for s in requests], np.int64) % self.lengths.group_size
        conv = self.conversations
        target = (conv.first_target if conv else self.lengths.lengths)(pg, members)
        for spec in requests:
            if spec.resume is not None:
                self._base_versions[spec.request_id] = tuple(spec.resume.versions)
            if spec.payload is not None:
                self._payload[spec.request_id] = spec.payload
            self._seen.add(spec.request_id)
            self._where[spec.request_id] = g
        self.waiting.assign([s.request_id for s in requests if s.resume is None])
        q.append(g, requests, target)

    def _versions(self, rid: int, g: int, sampled: bool) -> tuple[int, ...]:
        base = self._base_versions.pop(rid, ())
        v = int(self.version[g])
        return base + (v,) if sampled and (not base or base[-1] != v) else base

    def migrate(self, request_ids: list[int], src: int, dst: int) -> None:
        s, d = self._group(src), self._group(dst)
        check_migrate(request_ids, s, d, lambda i: int(self.version[i]), self._where.get, None)
        q = self.requests
        room, need = self.max_slots - int(q.count[d]), len(request_ids)
        if self.conversations is not None and request_ids:  # waiting requests take no slot
            room = self.max_slots - int(self.waiting.slots_held(q.width())[d])
            need -= int((q.wake_us[s, q.rows(s, request_ids)] > 0).sum())
        if need > room:
            raise BackendError(f"migrate: group {dst} has {room} free slots")
        if not request_ids:
            return
        rows = q.rows(s, request_ids)
        full = q.prompt_len[s, rows] + q.generated[s, rows]
        cached = int((full - q.prefill_left[s, rows]).sum())
        q.move(s, rows, d)
        for r in request_ids:
            self._where[r] = d
        self.mig[d] += self.cost.kv_transfer_s(cached)
        self.migrated_requests += len(request_ids)
        self.migrated_tokens += cached

    def interrupt(self, request_ids: list[int], discard: bool = False) -> list[PartialRequest]:
        for r in request_ids:
            if r not in self._where:
                raise BackendError(f"interrupt: request {r} is not running")
        if len(set(request_ids)) < len(request_ids):
            raise BackendError("interrupt: duplicate request ids")
        by_group: dict[int, list[int]] = {}
        for r in request_ids:
            by_group.setdefault(self._where[r], []).append(r)
        out: dict[int, PartialRequest] = {}
        q = self.requests
        for g, ids in by_group.items():
            rows = q.rows(g, ids)
            for r, i in zip(ids, rows.tolist(), strict=True):
                gen, plen = int(q.generated[g, i]), int(q.prompt_len[g, i])
                versions = self._versions(r, g, bool(q.sampled[g, i]))
                payload = self._payload.pop(r, None)
                out[r] = PartialRequest(r, int(q.prompt_group[g, i]), plen, gen, versions, payload)
                del self._where[r]
            q.park(g, rows)  # (its cached context: re-prefilled on resume)
        if discard:  # never resubmitted: its conversation ends here
            self.waiting.release(list(request_ids))
        return [out[r] for r in request_ids]

    # -- the tick --------------------------------------------------------------------------------

    def _prefill(
        self,
        w: int,
        budget: np.ndarray,
        secs: np.ndarray,
        counts: np.ndarray,
        sched: np.ndarray | None = None,
        bank: np.ndarray | None = None,
    ) -> None:
        """Prefill every group's waiting context, oldest request first, within its ``budget``
        (updated in place); a group's first request that does not fit gets the rest as a chunk.
        Vectorized over groups: cumulative tokens and pairs per group, one cost-model call.
        ``sched``: only these rows (conversations: those holding a slot). ``bank`` (a shared
        device): a group whose rest of the budget cannot pay for that chunk (a measured cost
        charges a whole call for any chunk) prefills nothing more this tick and banks the rest
        in ``bank``, its budget set to 0 (its engine step waits for its share to add up)."""
        G, q = self.num_groups, self.requests
        todo = (q.prefill_left[:, :w] > 0) & q.held(w)
        if sched is not None:
            todo &= sched
        todo &= (budget > 0)[:, None]
        gi, ri = np.nonzero(todo)  # group-major: admission order within each group
        if not len(gi):
            return
        left = q.prefill_left[gi, ri]
        start = q.prompt_len[gi, ri] + q.generated[gi, ri] - left
        pairs = self.cost.causal_pairs(start, start + left)
        cnt = np.bincount(gi, minlength=G)
        first = np.concatenate(([0], np.cumsum(cnt)[:-1]))
        cum_t = np.cumsum(left)
        cum_p = np.cumsum(pairs)
        base = first[gi]
        off_t = np.where(base > 0, cum_t[base - 1], 0)
        off_p = np.where(base > 0, cum_p[base - 1], 0.0)
        times = self.cost.prefill_s(cum_t - off_t, cum_p - off_p)
        fits = times <= budget[gi]
        done = np.where(fits, left, 0)
        nfit = np.bincount(gi, weights=fits, minlength=G).astype(np.int64)
        last = first + nfit - 1
        spent = np.where(nfit > 0, times[np.maximum(last, 0)], 0.0)
        cut = np.nonzero((nfit < cnt) & (cnt > 0))[0]  # groups whose budget ends mid-request
        banked = np.zeros(G, bool)
        if len(cut):
            p = first[cut] + nfit[cut]
            frac = (budget[cut] - spent[cut]) / np.maximum(times[p] - spent[cut], 1e-12)
            done[p] = (left[p] * np.clip(frac, 0.0, 1.0)).astype(np.int64)
            if bank is not None:  # the chunk's own cost, where it is not proportional
                base_t = np.where(nfit[cut] > 0, cum_t[np.maximum(p - 1, 0)], off_t[p])
                base_p = np.where(nfit[cut] > 0, cum_p[np.maximum(p - 1, 0)], off_p[p])
                part = self.cost.prefill_s(
                    base_t - off_t[p] + done[p],
                    base_p - off_p[p] + (pairs[p] * done[p] / np.maximum(left[p], 1)),
                )
                short = (done[p] == 0) | (part > budget[cut] + 1e-12)
                done[p[short]] = 0
                banked[cut[short]] = True
            spent[cut] = np.where(banked[cut], spent[cut], budget[cut])
        re = np.minimum(done, q.reprefill_left[gi, ri])
        q.prefill_left[gi, ri] -= done
        q.reprefill_left[gi, ri] -= re
        tot = np.bincount(gi, weights=done, minlength=G)
        tot_re = np.bincount(gi, weights=re, minlength=G)
        counts[:, 0] += tot.astype(np.int64)
        counts[:, 1] += tot_re.astype(np.int64)
        share = np.divide(tot_re, tot, out=np.zeros(G), where=tot > 0)
        spent = np.where(cnt > 0, spent, 0.0)
        secs[:, REPREFILL] += spent * share
        secs[:, PREFILL] += spent * (1.0 - share)
        budget -= spent
        if bank is not None:
            bank += np.where(banked, budget, 0.0)
            budget[banked] = 0.0

    def step(self) -> StepEvents:
        self.failures.due(self._tick, self)
        t, G, dt = self._tick, self.num_groups, self.tick_s
        secs = np.zeros((G, len(CATEGORIES)))
        counts = np.zeros((G, 2), np.int64)  # prefill tokens, re-prefill tokens
        tokens = np.zeros(G, np.int64)
        held = self.requests.count.copy()
        finished: list[FinishedRequest] = []
        sched = self.waiting.wake_up(t) if self.conversations is not None else None
        if t < self._frozen_until:  # colocated: the devices train; the carry waits
            secs[:, TRAIN] = dt
        else:
            # a group whose weights are still on their way spends the tick waiting for them, in
            # whole ticks, with no share of a shared device
            trip = self.trip > 0
            self.trip = np.maximum(self.trip - dt, 0.0)
            self.carry[trip] = 0.0
            down = self.failures.down(t)
            budget = np.where(trip | down, 0.0, dt + self.carry)
            if self.shared_device:  # each group's share of the device's tick, and its own carry
                share, working = device_shares(
                    self.requests, self.cost, dt, sched, trip, self.busy + self.mig, self.carry
                )
                budget = share + self.carry
            for c, arr in ((TRANSFER, self.busy), (MIGRATE, self.mig)):
                use = np.minimum(arr, np.maximum(budget, 0.0))
                arr -= use
                budget -= use
                secs[:, c] = use
            secs[:, TRANSFER] += np.where(trip, dt, 0.0)
            w = self.requests.width()
            bank = np.zeros(G) if self.shared_device else None
            self._prefill(w, budget, secs, counts, sched, bank)
            tokens, finished = self._decode(w, budget, secs, sched)
            if bank is not None:
                self.carry += bank
        if self.failures.cfg is not None:
            secs[self.failures.down(t), IDLE] = dt  # a failed group, out of the run: idle
        idle_own = secs[:, IDLE].copy()  # idle with nothing to do (not waiting for the device)
        if self.shared_device and t >= self._frozen_until:
            away = np.where(trip, 0.0, dt - share)  # the device runs the other groups meanwhile
            secs[:, IDLE] += away
            idle_own += np.where(working, 0.0, away)
        self.seconds.append(secs.sum(axis=0))
        if self.conversations is not None:
            self.waiting.record(idle_own)
        busy = secs[:, TRANSFER] + secs[:, MIGRATE]
        fill = secs[:, PREFILL] + secs[:, REPREFILL]
        dec = secs[:, DECODE]
        act = np.where(dec >= fill, 2, 1)  # 0 idle, 1 prefill, 2 decode, 3 transfer, 4 migrate
        moving = np.where(secs[:, MIGRATE] > secs[:, TRANSFER], 4, 3)
        act = np.where((busy >= fill) & (busy >= dec), moving, act)
        act = np.where(np.maximum(np.maximum(busy, fill), dec) <= 0, 0, act)
        time_s = dt - secs[:, IDLE] - secs[:, TRAIN]
        cols = (self.version, act, held, tokens, counts[:, 0], counts[:, 1], time_s)
        rows = zip(range(G), *(c.tolist() for c in cols), strict=True)
        ticks = tuple(GroupTick(g, v, _ACTIVITY[a], *rest) for g, v, a, *rest in rows)
        self._tick += 1
        recovered, health = self.failures.take_events()
        return StepEvents(t, tuple(finished), ticks, recovered, health)

    def _decode(
        self, w: int, budget: np.ndarray, secs: np.ndarray, sched: np.ndarray | None = None
    ) -> tuple[np.ndarray, list[FinishedRequest]]:
        """Decode steps within each group's remaining budget (rows ``< w`` only: no group holds
        more); returns tokens per group and the requests that finished (conversations: the
        others that reached their turn's end start waiting on their environment). ``sched``:
        only these rows decode."""
        q = self.requests
        valid = q.held(w)
        gen, target = q.generated[:, :w], q.target[:, :w]
        full = q.context(w)
        runnable = valid & (q.prefill_left[:, :w] == 0)
        if sched is not None:
            runnable &= sched
        over = np.nonzero(np.where(valid, full, 0).sum(axis=1) > self.capacity)[0]
        if len(over):  # park the newest requests of groups whose KV overflows
            cum = np.cumsum(np.where(valid[over], full[over], 0), axis=1)
            runnable[over] &= (cum <= self.capacity) | (np.arange(w) == 0)
        rem = np.where(runnable, target - gen, 0.0)
        ctx = np.where(runnable, full, 0.0)
        nr = runnable.sum(axis=1)
        work = (nr > 0) & (budget > 0)
        b = np.where(work, budget, 0.0)
        s = self.cost.decode_step_s(nr, ctx.sum(axis=1))
        k = np.where(work, b / s, 0.0)
        maxrem = rem.max(axis=1) if w else np.zeros(self.num_groups)
        for _ in range(2):  # batch and context averaged over the k steps
            kk = np.maximum(np.minimum(k, maxrem), 1e-9)
            m = np.minimum(rem, kk[:, None])
            n_avg = m.sum(axis=1) / kk
            c_avg = (m * (ctx + (m - 1.0) / 2.0)).sum(axis=1) / kk
            s = self.cost.decode_step_s(n_avg, c_avg)
            k = np.where(work, b / s, 0.0)
        steps = np.where(work, np.minimum(np.floor(k), maxrem), 0.0)
        used = steps * s
        out_of_work = work & (steps >= maxrem)
        self.carry = np.where(work & ~out_of_work, budget - used, 0.0)
        idle = np.where(work, np.where(out_of_work, b - used, 0.0), np.maximum(budget, 0.0))
        secs[:, DECODE] += used
        secs[:, IDLE] += np.maximum(idle, 0.0)
        m = np.minimum(rem, steps[:, None]).astype(np.int64)
        gen += m
        q.sampled[:, :w] |= m > 0
        tokens = m.sum(axis=1)
        done = runnable & (gen >= target)
        gi, ri = np.nonzero(done)
        finished: list[FinishedRequest] = []
        if len(gi) and self.conversations is not None:  # turn ends: when its last token came
            into = np.clip(self.tick_s - b[gi] + m[gi, ri] * s[gi], 0.0, self.tick_s)
            at = np.rint((self._tick * self.tick_s + into) * US).astype(np.int64)
            last = self.waiting.end_turns(gi, ri, at)
            gi, ri = gi[last], ri[last]
        if len(gi):
            fields = (q.request_id, q.prompt_group, q.prompt_len, q.generated)
            cols = zip(gi.tolist(), *(f[gi, ri].tolist() for f in fields), strict=True)
            if self.conversations is not None:
                self.waiting.finish(gi, ri)
            for g, r, p, pl, ng in cols:
                versions, payload = self._versions(r, g, True), self._payload.pop(r, None)
                finished.append(FinishedRequest(r, p, pl, ng, versions, payload))
                del self._where[r]
            for g in np.unique(gi).tolist():
                q.remove(g, ri[gi == g])
        return tokens, finished
