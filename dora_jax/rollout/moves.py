"""What requests carry when they leave and enter an engine with their KV (export/import between
groups of one version, park to host memory, snapshot/restore for checkpoints): the engine's
snapshot, a handover between engines, and a pack buffer split per request. The moves themselves
are :class:`~dora_jax.rollout.engine.Engine`'s methods.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from dora_jax.rollout.requests import ExportedRequests, Request


class EngineError(RuntimeError):
    """A request or operation the engine refuses (wrong version, too long, no capacity)."""


@dataclass
class EngineSnapshot:
    version: int | None
    running: ExportedRequests  # every request with KV on the device (KV as host numpy)
    pending: list[Request]  # requests without KV (queued, or waiting after an interrupt)
    parked: list[ExportedRequests]


@dataclass
class Handover:
    """Requests leaving an engine for another of the same version: those with KV on the device
    packed (``running``), those without KV as they are (``queued``), parked ones with their KV in
    host memory (``parked``). Nothing is recomputed where they land."""

    running: ExportedRequests | None
    queued: list[Request]
    parked: list[ExportedRequests]

    @property
    def ids(self) -> list[Hashable]:
        out = [r.id for r in self.running.requests] if self.running else []
        out += [r.id for r in self.queued]
        return out + [r.id for p in self.parked for r in p.requests]


def split_parked(x: ExportedRequests) -> list[ExportedRequests]:
    """One host-memory export per request, so parked requests resume, end or move one by one.

    A pack buffer ``[2, 1, K, L * w, Z, H]`` holds ``n`` pages per layer padded to ``w``, the
    next power of two (page ``j`` of layer ``l`` at ``l * w + j``); each part is laid out the
    same way for its own pages."""
    if len(x.requests) == 1:
        return [x]
    kv = np.asarray(x.kv)
    width = padded_pages(x.num_pages)
    layers = kv.shape[3] // width
    out, first = [], 0
    for r, c in zip(x.requests, x.page_counts, strict=True):
        w = padded_pages(c)
        part = np.zeros((*kv.shape[:3], layers * w, *kv.shape[4:]), kv.dtype)
        for l in range(layers):
            part[:, :, :, l * w : l * w + c] = kv[
                :, :, :, l * width + first : l * width + first + c
            ]
        out.append(ExportedRequests([r], [c], part))
        first += c
    return out


def padded_pages(n: int) -> int:
    """The padded page count of a pack buffer (the engine's ``_page_ids``): the next power of two
    (1 for none)."""
    return 1 << max(n - 1, 0).bit_length()
