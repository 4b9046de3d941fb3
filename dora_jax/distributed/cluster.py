"""The run's processes as process 0 sees them: who owns which group, the channels and transfers
to the others, and starting and stopping the groups they host."""

from __future__ import annotations

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

    def owner(self, mesh: Mesh, what: str) -> int:
        """The process whose devices hold ``mesh`` (a rollout group lives on one process)."""
        procs = sorted(processes(mesh))
        if len(procs) != 1:
            raise ProcessError(
                f"{what} spans processes {procs}: it must live on one host's devices"
            )
        return procs[0]

    def connect(self, post, now, stage_shardings) -> None:
        """Start listening to every other process (their reports go to ``post``)."""
        hosts = [p for p in range(self.count) if p != self.index]
        self.link = HostLink(self.channel, self.transfers, hosts, post, now, stage_shardings)

    def start_hosts(self, config: dict, eos_ids: list[int], seed: int, wall: bool) -> None:
        """Every other process builds the engines of its groups (a bounded wait for each); any of
        ``eos_ids`` ends a response there too."""
        for p in range(self.count):
            if p != self.index:
                msg = {
                    "op": "init",
                    "config": config,
                    "eos_ids": list(eos_ids),
                    "seed": seed,
                    "wall": wall,
                }
                self.link.request(p, msg, wait=True).result(WAIT_S)

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
            if p != self.index:
                try:  # the calls still queued go first: the shutdown travels alone
                    self.link.flush(p)
                    self.link.request(p, {"op": "shutdown"}, wait=False)
                    self.link.flush(p)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        self.channel.close()
