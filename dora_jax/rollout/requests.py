"""Host-side request records of the rollout engine, and what crosses between engines."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field

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
    prefill_tokens: int = 0  # tokens this request has had prefilled, over its whole life
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    migrations: int = 0
    # Mixture of experts only: the experts each fed token (prompt, then every generated token
    # but the last) used in each layer, as chunks int16[n, L, k] in token order (routing
    # replay); empty for dense models.
    routes: list[np.ndarray] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V are in the cache: the prompt and all but the last generated one."""
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def fed_routes(self, layers: int, k: int) -> np.ndarray:
        """The recorded routes as one array ``[n, layers, k]`` (empty when none)."""
        if not self.routes:
            return np.zeros((0, layers, k), ROUTE_DTYPE)
        return np.concatenate(self.routes)

    def compact_routes(self) -> None:
        """Keep the recorded routes as one array (they grow a token at a time while decoding)
        before the request leaves its engine or is saved."""
        if len(self.routes) > 1:
            self.routes = [np.concatenate(self.routes)]


@dataclass(frozen=True)
class FinishedRequest:
    """A completed response: a trajectory once the orchestrator attaches its reward."""

    id: Hashable
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finish_reason: str  # "eos" | "length"
    prefill_tokens: int
    migrations: int
    latency_s: float
    # Mixture of experts: int16[len(prompt) + len(tokens), L, k], the experts each token used
    # in each layer when it was fed to the model; the last token was never fed: its row is -1
    # (the router's own choice, if replayed). None for dense models.
    routes: np.ndarray | None = None


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


# Requests as plain data (lists, numbers, numpy arrays) for a message to another process; the
# channel's codec (dora_jax.distributed) makes them bytes.


def request_as_data(r: Request) -> dict:
    return asdict(r) | {"key": np.asarray(r.key, np.uint32)}


def request_from_data(d: dict) -> Request:
    return Request(**d)


def exported_as_data(x: ExportedRequests, with_kv: bool = True) -> dict:
    """``with_kv=False`` leaves the pack buffer out (it travels as an array of its own)."""
    return {
        "requests": [request_as_data(r) for r in x.requests],
        "page_counts": list(x.page_counts),
        "kv": np.asarray(x.kv) if with_kv else None,
    }


def exported_from_data(d: dict, kv: object = None) -> ExportedRequests:
    requests = [request_from_data(r) for r in d["requests"]]
    return ExportedRequests(requests, list(d["page_counts"]), d["kv"] if kv is None else kv)
