"""The run's processes as process 0 sees them: who owns which group, the channels and transfers
to the others, and starting and stopping the groups they host."""

from __future__ import annotations

import time
from concurrent.futures import Future

from jax.sharding import Mesh

from dora_jax.distributed.channel import Channel
from dora_jax.distributed.process import Process, ProcessError
from dora_jax.distributed.remote import WAIT_S, HostLink, RemoteTransport
from dora_jax.distributed.transfers import Transfers
from dora_jax.mesh import processes


class Cluster:
    def __init__(self, proc: Process):
        self.proc = proc
        self.index, self.count = proc.index, proc.count
        self.channel = Channel(proc.client, proc.index)
        self.transfers = Transfers(proc)
        self.link: HostLink | None = None
        self.joins: dict[int, int] = {}  # rollout host -> times it was started again
        self._init: dict = {}

    def owner(self, mesh: Mesh, what: str) -> int:
        """The process whose devices hold ``mesh`` (a rollout group lives on one process)."""
        procs = sorted(processes(mesh))
        if len(procs) != 1:
            raise ProcessError(
                f"{what} spans processes {procs}: it must live on one host's devices"
            )
        return procs[0]

    def connect(self, post, now, stage_shardings, essential: set[int] | None = None) -> None:
        """Start listening to every other process (their reports go to ``post``). A process not
        in ``essential`` (the trainer's processes) that dies is a lost rollout host: the run goes
        on without it, and takes it back when it is started again (:meth:`start_host`)."""
        hosts = [p for p in range(self.count) if p != self.index]
        for p in hosts:
            self.channel.reconnect(p, self._token(p))
        self.link = HostLink(self.channel, self.transfers, hosts, post, now, stage_shardings)
        every = range(self.count) if essential is None else essential  # (None: every process)
        self.proc.essential = frozenset(every) | {self.index}
        self.proc.on_host_lost = self._lost
        self.proc.on_host_joined = self._joined

    def _lost(self, p: int, why: str) -> None:
        left = self.link.left.get(p)
        if left is not None:  # (asked to stop: it handed its requests over first)
            print(
                f"process {p} left ({left}) after handing its requests over: the run goes on "
                "without its rollout groups; start it again with its own command to bring them "
                "back",
                flush=True,
            )
        else:
            print(
                f"process {p} is gone ({why}): the run goes on without its rollout groups, whose "
                "requests continue elsewhere; start it again with its own command to bring them "
                "back",
                flush=True,
            )
        self.link.host_lost(p, why)

    def _token(self, p: int, not_: str | None = None, timeout_s: float = 120.0) -> str:
        """Process ``p``'s join token (a new one, other than ``not_``, once it was started
        again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(1, int((deadline - time.monotonic()) * 1e3))
            token = self.proc.client.blocking_key_value_get(f"dora/join/{p}", left)
            if token != not_ or time.monotonic() > deadline:
                return token
            time.sleep(0.2)

    def _joined(self, p: int) -> None:
        old = self.channel.epoch_of(p)
        self.joins[p] = self.joins.get(p, 0) + 1
        self.link.host_joined(p, self._token(p, not_=old))
        print(
            f"process {p} is back: its rollout groups rejoin once they hold a version", flush=True
        )

    def start_hosts(self, config: dict, eos_ids: list[int], seed: int, clock: str) -> None:
        """Every other process builds the engines of its groups (a bounded wait for each) on
        ``clock`` (its kind); any of ``eos_ids`` ends a response there too."""
        self._init = {"op": "init", "config": config, "eos_ids": list(eos_ids), "seed": seed}
        self._init["clock"] = clock
        for p in range(self.count):
            if p != self.index:
                self.start_host(p).result(WAIT_S)

    def start_host(self, p: int) -> Future:
        """Process ``p`` builds the engines of its groups (again, when it was started again):
        the future completes with its reply."""
        return self.link.request(p, self._init | {"epoch": self.joins.get(p, 0)}, wait=True)

    def remote(self, group: int, host: int, sync: bool, pages_total: int) -> RemoteTransport:
        return RemoteTransport(group, host, self.link, sync, pages_total)

    def trainer_broadcast(self, mesh: Mesh):
        """A function that sends a trainer command to every other process holding devices of
        the trainer ``mesh`` (each runs it as this one does: ``execution/trainer_worker.py``)."""
        others = sorted(processes(mesh) - {self.index})

        def send(cmd) -> None:
            for p in others:
                self.channel.send(p, {"op": "trainer", "cmd": cmd})

        return send

    def flush(self) -> None:
        """Send every call queued for the other processes (once per control round)."""
        if self.link is not None:
            self.link.flush()

    def stop_hosts(self) -> None:
        for p in range(self.count):
            if p != self.index and p not in self.link.lost:
                try:  # the calls still queued go first: the shutdown travels alone
                    self.link.flush(p)
                    msg = {"op": "shutdown", "among": self.proc.present()}  # (its last barrier)
                    self.link.request(p, msg, wait=False)
                    self.link.flush(p)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        self.channel.close()
