"""The control plane's books of one engine backend: which group holds each request in flight,
the version each group holds, and what each submitted request started from. They change the
moment the control plane decides; the engines catch up through their handles."""

from __future__ import annotations

from dora_jax.execution.payloads import PromptPayload


class Books:
    """``n`` groups' versions and members (request ids in arrival order), each request's group,
    and each submitted request's prompt group, prompt and the versions it ran under."""

    def __init__(self, n: int):
        self.versions = [0] * n  # what each group holds, or is receiving
        self.members: list[dict[int, None]] = [{} for _ in range(n)]
        self.where: dict[int, int] = {}  # request id -> its group
        self.meta: dict[int, tuple[int, PromptPayload, list[int]]] = {}

    def join(self, rid: int, group: int) -> None:
        self.where[rid] = group
        self.members[group][rid] = None

    def leave(self, rid: int) -> None:
        g = self.where.pop(rid, None)
        if g is not None:
            self.members[g].pop(rid, None)
