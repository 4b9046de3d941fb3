"""Finished trajectories, gathered by prompt group, until the trainer takes them.

A prompt group is *ready* when all ``G`` of its requests have finished. The trainer takes ready
prompt groups oldest version first (ties: the order they became ready); every taken trajectory's
staleness (``trainer version - prompt-group version``) is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_jax.orchestrator.backend import FinishedRequest


@dataclass(frozen=True)
class ReadyGroup:
    """The ``G`` trajectories of one prompt group, all generated under ``version``."""

    prompt_group: int
    version: int
    trajectories: tuple[FinishedRequest, ...]
    ready_tick: int

    @property
    def response_tokens(self) -> int:
        return sum(t.response_len for t in self.trajectories)


@dataclass(frozen=True)
class ConsumedRecord:
    """One trajectory handed to the trainer."""

    request_id: int
    prompt_group: int
    version: int
    trainer_version: int
    staleness: int
    response_len: int
    version_span: int
    tick: int
    prompt_len: int = 0


class TransferQueue:
    """Prompt groups from dispatch until they are consumed or discarded."""

    def __init__(self, group_size: int):
        if group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {group_size}")
        self.group_size = group_size
        self._open: dict[int, tuple[int, list[FinishedRequest]]] = {}  # pg -> (version, done)
        self._ready: dict[int, ReadyGroup] = {}  # in the order they became ready
        self.consumed: list[ConsumedRecord] = []

    def state_dict(self) -> dict:
        """The prompt groups in flight (``consumed`` is the runtime's records': saved there)."""
        return {
            "open": {pg: (v, list(done)) for pg, (v, done) in self._open.items()},
            "ready": list(self._ready.values()),
        }

    def load_state_dict(self, state: dict) -> None:
        self._open = {pg: (v, list(done)) for pg, (v, done) in state["open"].items()}
        self._ready = {rg.prompt_group: rg for rg in state["ready"]}

    def open(self, prompt_group: int, version: int) -> None:
        """Expect ``G`` trajectories of ``prompt_group``, tagged ``version``."""
        if prompt_group in self._open or prompt_group in self._ready:
            raise ValueError(f"prompt group {prompt_group} is already open")
        self._open[prompt_group] = (version, [])

    def retag(self, prompt_group: int, version: int) -> None:
        """Change the version of a prompt group none of whose requests has run yet."""
        _, done = self._open[prompt_group]
        if done:
            raise ValueError(f"prompt group {prompt_group} has finished requests; cannot re-tag")
        self._open[prompt_group] = (version, done)

    def add(self, fr: FinishedRequest, tick: int) -> ReadyGroup | None:
        """Store a finished request; returns its prompt group if that made it ready."""
        if fr.prompt_group not in self._open:
            raise ValueError(f"request {fr.request_id}: prompt group {fr.prompt_group} is not open")
        version, done = self._open[fr.prompt_group]
        done.append(fr)
        if len(done) < self.group_size:
            return None
        del self._open[fr.prompt_group]
        rg = ReadyGroup(fr.prompt_group, version, tuple(done), tick)
        self._ready[fr.prompt_group] = rg
        return rg

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_open(self) -> int:
        """Prompt groups dispatched and not ready yet."""
        return len(self._open)

    def open_groups(self) -> list[int]:
        """Prompt groups dispatched and not ready yet, in dispatch order."""
        return list(self._open)

    def ready_groups(self) -> list[ReadyGroup]:
        return list(self._ready.values())

    def select(self, n: int) -> list[ReadyGroup]:
        """The ``n`` ready prompt groups the trainer would take: oldest version first."""
        order = sorted(enumerate(self._ready.values()), key=lambda iv: (iv[1].version, iv[0]))
        return [rg for _, rg in order[:n]]

    def take(self, groups: list[ReadyGroup], trainer_version: int, tick: int) -> list[ReadyGroup]:
        """Hand ``groups`` to the step at ``trainer_version``; records every staleness."""
        for rg in groups:
            if self._ready.pop(rg.prompt_group, None) is None:
                raise ValueError(f"prompt group {rg.prompt_group} is not ready")
            for t in rg.trajectories:
                self.consumed.append(
                    ConsumedRecord(
                        t.request_id,
                        rg.prompt_group,
                        rg.version,
                        trainer_version,
                        trainer_version - rg.version,
                        t.response_len,
                        t.version_span,
                        tick,
                        t.prompt_len,
                    )
                )
        return groups

    def discard(self, prompt_group: int) -> tuple[int, list[int]]:
        """Drop a prompt group (ready or not); returns its version and its finished request ids."""
        if prompt_group in self._ready:
            rg = self._ready.pop(prompt_group)
            return rg.version, [t.request_id for t in rg.trajectories]
        version, done = self._open.pop(prompt_group)
        return version, [t.request_id for t in done]
