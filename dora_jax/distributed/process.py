"""One process per host on JAX's multi-controller runtime (``jax.distributed``).

Where the process settings come from, first match wins:

1. explicit: ``--coordinator``/``--num-processes``/``--process-id`` on the command line, or the
   environment variables ``DORA_COORDINATOR``, ``DORA_NUM_PROCESSES``, ``DORA_PROCESS_ID`` (the
   local launcher sets these);
2. a scheduler JAX detects by itself: SLURM (``SLURM_NTASKS`` > 1), Open MPI
   (``OMPI_COMM_WORLD_SIZE`` > 1), Cloud TPU pods (``jax.distributed.initialize()`` with no
   arguments finds the coordinator);
3. otherwise a single process, and nothing here is started.

:func:`initialize` then starts the runtime (gloo collectives on CPU), a transfer server for
point-to-point array pulls between processes (its address is published in the runtime's
key-value store), and a watchdog that ends this process with a message naming the process that
died or stopped answering.

Listeners: the coordinator and the transfer servers accept connections from anyone who can reach
them and authenticate nothing. They bind to ``DORA_BIND_ADDRESS`` (default: the coordinator's
host, loopback for local runs): keep them on a private network. Messages between processes are
msgpack (``codec.py``), never pickles.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ENV_COORDINATOR, ENV_NUM, ENV_ID = "DORA_COORDINATOR", "DORA_NUM_PROCESSES", "DORA_PROCESS_ID"
ENV_BIND = "DORA_BIND_ADDRESS"


class ProcessError(RuntimeError):
    """The process settings are wrong, or a peer process died or stopped answering."""


@dataclass(frozen=True)
class ProcessSpec:
    num_processes: int
    process_id: int | None  # None: the scheduler says (auto-detection)
    coordinator: str | None  # "host:port"; None: the scheduler says
    bind: str = "127.0.0.1"  # interface of this process's listeners (transfer server)

    @property
    def auto(self) -> bool:
        return self.coordinator is None


def spec_from(args: Any = None, env: dict[str, str] | None = None) -> ProcessSpec | None:
    """The process settings from ``args`` (attributes ``coordinator``, ``num_processes``,
    ``process_id``), then the environment; None for a single-process run."""
    env = os.environ if env is None else env
    coord = getattr(args, "coordinator", None) or env.get(ENV_COORDINATOR)
    num = getattr(args, "num_processes", None) or env.get(ENV_NUM)
    pid = getattr(args, "process_id", None)
    pid = pid if pid is not None else env.get(ENV_ID)
    if coord or num or pid is not None:
        missing = [n for n, v in (("coordinator", coord), ("num-processes", num),
                                  ("process-id", pid)) if v is None]  # fmt: skip
        if missing:
            raise ProcessError(
                f"multi-process settings need --coordinator, --num-processes and --process-id "
                f"(or {ENV_COORDINATOR}, {ENV_NUM}, {ENV_ID}); missing: {', '.join(missing)}"
            )
        try:
            num_i, pid_i = int(num), int(pid)
        except ValueError:
            raise ProcessError(f"--num-processes {num!r} and --process-id {pid!r} must be "
                               "integers") from None  # fmt: skip
        if not 0 <= pid_i < num_i:
            raise ProcessError(f"--process-id {pid_i} is not in [0, {num_i})")
        host = coord.rsplit(":", 1)[0]
        return ProcessSpec(num_i, pid_i, coord, env.get(ENV_BIND, host))
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(var, "1") or 1) > 1:
            return ProcessSpec(int(env[var]), None, None, env.get(ENV_BIND, "0.0.0.0"))
    if env.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
        n = env["TPU_WORKER_HOSTNAMES"].count(",") + 1
        return ProcessSpec(n, None, None, env.get(ENV_BIND, "0.0.0.0"))
    return None


@dataclass
class Process:
    """This process's place in a multi-process run, and the runtime's services."""

    index: int
    count: int
    client: Any  # jax's DistributedRuntimeClient (key-value store, barriers, liveness)
    server: Any  # jax.experimental.transfer server of this process
    bind: str
    _conns: dict[str, Any] = field(default_factory=dict)
    _watchdog: threading.Thread | None = None
    on_peer_lost: Callable[[str], None] | None = None  # says what to do next (last checkpoint)

    @property
    def is_main(self) -> bool:
        return self.index == 0

    def address(self, process: int, timeout_s: float = 120) -> str:
        return self.client.blocking_key_value_get(f"dora/addr/{process}", int(timeout_s * 1e3))

    def connection(self, address: str):
        if address not in self._conns:
            self._conns[address] = self.server.connect(address)
        return self._conns[address]

    def start_watchdog(self, period_s: float = 2.0) -> None:
        """End this process (exit code 3) with a message when a peer stops answering."""
        self._finishing = threading.Event()

        def watch() -> None:
            everyone = list(range(self.count))
            while not self._finishing.wait(period_s):
                try:
                    live = self.client.get_live_nodes(everyone)
                    lost = [p for p in everyone if p not in live]
                except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone
                    lost, why = [0], f"the coordinator does not answer ({type(e).__name__})"
                else:
                    why = "it stopped answering"
                if lost and not self._finishing.is_set():
                    self.lost(f"process {lost[0]} is gone: {why}")

        self._watchdog = threading.Thread(target=watch, name="dora-watchdog", daemon=True)
        self._watchdog.start()

    def finish(self, timeout_s: float = 60.0) -> None:
        """Leave the run: meet every process at a last barrier (bounded), then disconnect."""
        import jax

        if getattr(self, "_finishing", None) is not None:
            self._finishing.set()
        try:
            self.client.wait_at_barrier("dora/end", int(timeout_s * 1e3))
        except Exception as e:  # noqa: BLE001 - a peer already gone: nothing left to wait for
            print(f"process {self.index}: the last barrier failed ({e}); leaving", file=sys.stderr)
        if not self.is_main:
            # Leave without the runtime's own shutdown call: process 0 may already have closed
            # the service (which the others' disconnect would need), and there is nothing left.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        jax.distributed.shutdown()

    def lost(self, what: str) -> None:
        hint = self.on_peer_lost(what) if self.on_peer_lost else ""
        print(f"error: process {self.index}: {what}. {hint}".rstrip(), file=sys.stderr,
              flush=True)  # fmt: skip
        os._exit(3)


def initialize(spec: ProcessSpec, *, heartbeat_s: int = 10, timeout_s: int = 300) -> Process:
    """Join the run described by ``spec`` (call before anything touches a jax device)."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)  # a dead peer: our message, our exit
    try:
        if spec.auto:
            jax.distributed.initialize(
                initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s
            )
        else:
            port = spec.coordinator.rsplit(":", 1)[1]
            jax.distributed.initialize(
                spec.coordinator, spec.num_processes, spec.process_id,
                initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s,
                coordinator_bind_address=f"{spec.bind}:{port}",
            )  # fmt: skip
    except Exception as e:
        raise ProcessError(f"could not join the run at {spec.coordinator or 'auto'}: {e}") from e
    from jax._src import distributed
    from jax.experimental import transfer

    client = distributed.global_state.client
    index, count = jax.process_index(), jax.process_count()
    server = transfer.start_transfer_server(
        jax.local_devices()[0].client, f"{spec.bind}:0", [f"{spec.bind}:0"]
    )
    client.key_value_set(f"dora/addr/{index}", server.address())
    return Process(index, count, client, server, spec.bind)
