"""Host-side request records of the rollout engine, and what crosses between engines."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

# host dtype of recorded MoE routes (expert ids; checked against num_experts at engine start)
ROUTE_DTYPE = np.int16


def request_key(seed: int, *ids: int) -> np.ndarray:
    """Raw threefry key data ``uint32[2]`` for one request, from integers (run seed, prompt
    index, sample index, ...); deterministic and independent of where the request runs."""
    h = np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    for i in ids:
        h = np.uint64((int(h) * 0x100000001B3 + (int(i) & 0xFFFFFFFFFFFFFFFF) + 1) % (1 << 64))
    return np.array([int(h) >> 32, int(h) & 0xFFFFFFFF], dtype=np.uint32)


@dataclass
class Request:
    """One sampled response in flight (DESIGN vocabulary), owned by one engine at a time."""

    id: Hashable
    prompt: list[int]
    version: int
    key: np.ndarray  # uint32[2], see request_key
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)  # behavior logprob of each token
    # tokens this request has had prefilled, over its whole life (a prompt's K/V copied from a
    # request with the same prompt counts: made once for it, not computed again)
    prefill_tokens: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    migrations: int = 0
    # Mixture of experts only: the experts each fed token (prompt, then every generated token
    # but the last) used in each layer, as chunks int16[n, L, k] in token order (routing
    # replay); empty for dense models.
    routes: list[np.ndarray] = field(default_factory=list)
    # Leading tokens of prompt + tokens whose K/V are computed (in the cache, or in an export's
    # buffer); 0 for a request that has none (new, or interrupted: its KV was dropped).
    kv_len: int = 0
    # The most tokens that ever had K/V computed: what a later prefill recomputes counts as
    # re-prefill.
    kv_peak: int = 0
    # Multi-turn conversations (a driver alternates model and environment turns). An EOS, one of
    # ``stop_seqs`` (token ids) or the token budget ends a model *turn*: the request then waits
    # (``waiting``), keeping its KV and freeing its slot, until the engine is told to extend it
    # with the environment's tokens or to end it. ``env_spans``: the ``[start, end)`` ranges of
    # ``tokens`` that came from the environment (logprob 0); ``turn_start``: where the current
    # model turn began in ``tokens``. ``max_new_tokens`` bounds every token after the prompt.
    multi_turn: bool = False
    stop_seqs: tuple[tuple[int, ...], ...] = ()
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_start: int = 0
    waiting: bool = False

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + len(self.tokens)

    @property
    def needs_sample(self) -> bool:
        """Whether its next feed ends by sampling a token: a new prompt, or an environment turn
        just appended (the last token is not one the model sampled)."""
        return not self.tokens or bool(self.env_spans and self.env_spans[-1][1] == len(self.tokens))

    @property
    def feed_end(self) -> int:
        """Tokens with K/V once the request is ready to decode: all of them when the feed ends
        with a sample, else all but the last (sampled, fed by the next decode step)."""
        return self.total_tokens if self.needs_sample else self.total_tokens - 1

    @property
    def needs_feed(self) -> bool:
        """Whether it must be prefilled (from ``kv_len`` to ``feed_end``) before it decodes."""
        return self.needs_sample or self.kv_len < self.feed_end

    def model_turn_ended(self, eos_ids: tuple[int, ...]) -> str | None:
        """Why its response or model turn is over after the last sampled token: ``eos``,
        ``stop`` (multi-turn: the turn ends with one of ``stop_seqs``), ``length`` (the budget
        is spent), or None."""
        if self.tokens[-1] in eos_ids:
            return "eos"
        if self.multi_turn:
            turn = self.tokens[self.turn_start :]
            for s in self.stop_seqs:
                if len(turn) >= len(s) and tuple(turn[len(turn) - len(s) :]) == tuple(s):
                    return "stop"
        if len(self.tokens) >= self.max_new_tokens:
            return "length"
        return None

    def append_env_turn(self, ids: list[int]) -> None:
        """Append the environment's turn (it waited on it); the next model turn starts after."""
        start = len(self.tokens)
        self.tokens.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.env_spans.append((start, len(self.tokens)))
        self.turn_start = len(self.tokens)
        self.waiting = False

    def routes_with_last(self, cfg) -> np.ndarray:
        """``int16[len(prompt) + len(tokens), L, k]``: the recorded routes of the fed tokens
        (one per token with KV) and a row of -1 for the last token (never fed)."""
        L, k = cfg.num_layers, cfg.num_experts_per_tok
        fed = np.concatenate(self.routes) if self.routes else np.zeros((0, L, k), ROUTE_DTYPE)
        if len(fed) != self.kv_len:
            raise ValueError(
                f"request {self.id!r}: {len(fed)} tokens' routes recorded for "
                f"{self.kv_len} fed tokens"
            )
        return np.concatenate([fed, np.full((1, L, k), -1, ROUTE_DTYPE)])

    def compact_routes(self) -> None:
        """Keep the recorded routes as one array (they grow a token at a time while decoding)
        before the request leaves its engine or is saved."""
        if len(self.routes) > 1:
            self.routes = [np.concatenate(self.routes)]


@dataclass(frozen=True)
class EngineFinished:
    """A completed response: a trajectory once the orchestrator attaches its reward."""

    id: Hashable
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finish_reason: str  # "eos" | "length" (multi-turn turn ends: also "stop")
    prefill_tokens: int
    migrations: int
    latency_s: float
    # Mixture of experts: int16[len(prompt) + len(tokens), L, k], the experts each token used
    # in each layer when it was fed to the model; the last token was never fed: its row is -1
    # (the router's own choice, if replayed). None for dense models.
    routes: np.ndarray | None = None
    # multi-turn: where the model turn that just ended starts in ``tokens``, and the ranges of
    # ``tokens`` the environment wrote
    turn_start: int = 0
    env_spans: tuple[tuple[int, int], ...] = ()


@dataclass
class ExportedRequests:
    """Requests leaving an engine with their KV: ``kv`` is a pack buffer
    ``[2, L, K, n_pages, Z, H]`` (on the source mesh, on another mesh, or as host numpy when
    parked); ``page_counts[i]`` pages of it belong to ``requests[i]``, in order."""

    requests: list[Request]
    page_counts: list[int]
    kv: object  # jax.Array or np.ndarray

    @property
    def num_pages(self) -> int:
        return sum(self.page_counts)
