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
died or stopped answering. Every process also holds a lifeline to process 0 (``lifeline.py``): a
process that ends, however it ends, is seen at once by the other end instead of after the
runtime's heartbeat timeout (the fallback for a host that vanishes without closing its sockets).

Listeners: the coordinator and the transfer servers accept connections from anyone who can reach
them and authenticate nothing: keep them on a private network. They bind to ``DORA_BIND_ADDRESS``
when it is set (``0.0.0.0``: every interface), else (:func:`listen_host`) process 0 binds them to
the coordinator's host and every other process to its own address on the way to that host
(loopback for local runs), whether the settings are explicit or come from a scheduler. Messages
between processes are msgpack (``codec.py``), never pickles.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import uuid
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
    bind: str | None = None  # DORA_BIND_ADDRESS: this process's listeners; None: listen_host

    @property
    def auto(self) -> bool:
        return self.coordinator is None


def spec_from(args: Any = None, env: dict[str, str] | None = None) -> ProcessSpec | None:
    """The process settings from ``args`` (attributes ``coordinator``, ``num_processes``,
    ``process_id``), then the environment; None for a single-process run."""
    env = os.environ if env is None else env
    bind = env.get(ENV_BIND) or None
    coord = getattr(args, "coordinator", None) or env.get(ENV_COORDINATOR)
    num = getattr(args, "num_processes", None) or env.get(ENV_NUM)
    pid = getattr(args, "process_id", None)
    pid = pid if pid is not None else env.get(ENV_ID)
    if coord or num or pid is not None:
        missing = [
            n
            for n, v in (("coordinator", coord), ("num-processes", num), ("process-id", pid))
            if v is None
        ]
        if missing:
            raise ProcessError(
                f"multi-process settings need --coordinator, --num-processes and --process-id "
                f"(or {ENV_COORDINATOR}, {ENV_NUM}, {ENV_ID}); missing: {', '.join(missing)}"
            )
        try:
            num_i, pid_i = int(num), int(pid)
        except ValueError:
            raise ProcessError(
                f"--num-processes {num!r} and --process-id {pid!r} must be integers"
            ) from None
        if not 0 <= pid_i < num_i:
            raise ProcessError(f"--process-id {pid_i} is not in [0, {num_i})")
        return ProcessSpec(num_i, pid_i, coord, bind)
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(var, "1") or 1) > 1:
            return ProcessSpec(int(env[var]), None, None, bind)
    tpu_hosts = env.get("TPU_WORKER_HOSTNAMES", "").count(",") + 1
    return ProcessSpec(tpu_hosts, None, None, bind) if tpu_hosts > 1 else None


def listen_host(coordinator: str, process_id: int, bind: str | None = None, route=None) -> str:
    """The host this process's listeners bind to: ``bind`` (``DORA_BIND_ADDRESS``) when given;
    else the coordinator's host (``coordinator`` is ``"host:port"``) for process 0, which runs
    the coordinator there; else this machine's address on the way to that host
    (``route(host)``, default :func:`route_to`), the interface the others reach it through."""
    if bind:
        return bind
    host = coordinator.rsplit(":", 1)[0]
    if process_id == 0:
        return host
    return (route or route_to)(host)


def route_to(host: str) -> str:
    """This machine's address on the way to ``host`` (a UDP socket's local end once connected:
    nothing is sent), bracketed when it is IPv6."""
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((name, 9))
            local = s.getsockname()[0]
    except OSError as e:
        raise ProcessError(
            f"no route from this machine to the coordinator's host {host!r} ({e}); set "
            f"{ENV_BIND} to this machine's address"
        ) from None
    return f"[{local}]" if ":" in local else local


@dataclass
class Process:
    """This process's place in a multi-process run, and the runtime's services."""

    index: int
    count: int
    client: Any  # jax's DistributedRuntimeClient (key-value store, barriers, liveness)
    server: Any  # jax.experimental.transfer server of this process
    bind: str
    _conns: dict[str, Any] = field(default_factory=dict)
    _finishing: threading.Event = field(default_factory=threading.Event)  # set when leaving
    _lock: threading.RLock = field(default_factory=threading.RLock)  # losses and returns, in order
    coordinator: str = ""  # "host:port" of process 0
    lifelines: Any = None  # process 0: lifeline.Lifelines; the others hold theirs (start_watchdog)
    on_peer_lost: Callable[[str], None] | None = None  # says what to do next (last checkpoint)
    token: str = ""  # this incarnation's join token (``dora/join/<index>``): its messages' epoch
    # process 0: the processes whose loss stops the run (the trainer's); any other (a rollout
    # host) lost goes to on_host_lost(process, why) and, started again, to on_host_joined(process)
    essential: frozenset[int] = frozenset()
    on_host_lost: Callable[[int, str], None] | None = None
    on_host_joined: Callable[[int], None] | None = None
    gone: set[int] = field(default_factory=set)  # process 0: rollout hosts lost, not back

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
        """Watch the other processes. A peer that stops answering (or restarted: a new
        incarnation) ends this process (exit 3) with a message, except on process 0 for a
        process outside :attr:`essential` (it hosts rollout groups only): that one is handed to
        :attr:`on_host_lost`, and its coming back to :attr:`on_host_joined`. Processes other than
        0 care only about process 0 (which decides for the others). A lifeline closing says the
        same at once (a loss seen twice is handled once)."""
        from dora_jax.distributed import lifeline

        if self.is_main:
            self.lifelines = lifeline.Lifelines(
                self.bind, self.line_closed, self.count, current_token=self.join_token
            )
            host = self.coordinator.rsplit(":", 1)[0]  # (the others reach this machine so)
            self.client.key_value_set("dora/lifeline", f"{host}:{self.lifelines.port}")
        else:  # (process 0 may open its lifelines later, or never: then the heartbeat alone)

            def attach() -> None:
                try:
                    where = self.client.blocking_key_value_get("dora/lifeline", 86_400_000)
                    if not self._finishing.is_set():
                        lifeline.hold(
                            where, self.index, lambda: self.line_closed(0), token=self.token
                        )
                except Exception:  # noqa: BLE001 - no lifeline: the watchdog still watches
                    return

            threading.Thread(target=attach, name="dora-lifeline-attach", daemon=True).start()

        def watch() -> None:
            everyone = list(range(self.count))
            known: dict[int, Any] = {}  # process -> the incarnation last seen live
            first = True
            while not self._finishing.wait(period_s):
                try:
                    live = self.client.get_live_nodes(everyone)
                except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone
                    if not self._finishing.is_set():
                        self.lost(
                            f"process 0 is gone: the coordinator does not answer "
                            f"({type(e).__name__})"
                        )
                    return
                if self._finishing.is_set():
                    return
                if not self.is_main:
                    self._leave_if_replaced()
                if not isinstance(live, dict):  # (a list where the runtime gives no incarnations)
                    live = dict.fromkeys(live, 0)
                for p in everyone:
                    now, before = live.get(p), known.get(p)
                    if now is None and (before is not None or first):
                        known.pop(p, None)
                        self._peer_lost(p, "it stopped answering")
                    elif now is not None and before is not None and now != before:
                        known[p] = now
                        self._peer_lost(p, "it was restarted")
                        self._peer_joined(p)
                    elif now is not None and before is None:
                        known[p] = now
                        if not first:
                            self._peer_joined(p)
                first = False

        threading.Thread(target=watch, name="dora-watchdog", daemon=True).start()

    def join_token(self, process: int) -> str | None:
        """The join token of ``process``'s newest incarnation (None: not readable now)."""
        try:
            return self.client.key_value_try_get(f"dora/join/{process}")
        except Exception:  # noqa: BLE001 - not set, or the service is going away
            return None

    def _leave_if_replaced(self) -> None:
        """Another process joined the run under this one's index (its command started a second
        time while it runs): process 0 now serves that one, so this one says so and leaves
        (exit 3) rather than hold its devices for nothing."""
        newest = self.join_token(self.index)
        if not self.token or newest is None or newest == self.token:
            return
        print(
            f"error: process {self.index}: another process joined the run as process "
            f"{self.index} (was its command started a second time?) and took its place; this "
            "one leaves",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    def present(self) -> list[int]:
        """The processes in the run: every one but the rollout hosts gone (and not back)."""
        return [p for p in range(self.count) if p not in self.gone]

    def line_closed(self, p: int) -> None:
        """Process ``p``'s lifeline closed: it ended (unless this process is leaving)."""
        if not self._finishing.is_set():
            self._peer_lost(p, "it ended (its connection closed)")

    def _peer_lost(self, p: int, why: str) -> None:
        if p == self.index:
            return
        with self._lock:
            if self.is_main and self.on_host_lost is not None and p not in self.essential:
                if p not in self.gone:  # (its lifeline and the heartbeat may both say so)
                    self.gone.add(p)
                    self.on_host_lost(p, why)
            elif self.is_main or p == 0:
                self.lost(f"process {p} is gone: {why}")

    def _peer_joined(self, p: int) -> None:
        with self._lock:
            if self.is_main and p != self.index and self.on_host_joined is not None:
                self.gone.discard(p)
                self.on_host_joined(p)

    def finish(self, timeout_s: float = 60.0, among: list[int] | None = None) -> None:
        """Leave the run: meet the processes ``among`` (default: every one that is not gone;
        process 0 tells the others whom) at a last barrier (bounded), then disconnect."""
        import jax

        self._finishing.set()
        if among is None:
            among = self.present()
        try:
            self.client.wait_at_barrier("dora/end", int(timeout_s * 1e3), among)
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
        print(f"error: process {self.index}: {what}. {hint}".rstrip(), file=sys.stderr, flush=True)
        os._exit(3)


def initialize(spec: ProcessSpec, *, heartbeat_s: int = 10, timeout_s: int = 300) -> Process:
    """Join the run described by ``spec`` (call before anything touches a jax device)."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)  # a dead peer: our message, our exit
    coordinator, count, index = spec.coordinator, spec.num_processes, spec.process_id
    local_ids = None
    try:
        if spec.auto:  # the scheduler's settings, found as jax.distributed.initialize() does
            from jax._src import clusters

            detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
            coordinator, count, index, local_ids = detect(
                os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, None, None, timeout_s
            )
        bind = listen_host(coordinator, index, spec.bind)
        if index:  # (a run that has ended, or a coordinator not up yet: say what it waits for)
            print(
                f"process {index}: joining the run at {coordinator} (waiting up to "
                f"{timeout_s} s for process 0)",
                file=sys.stderr,
                flush=True,
            )
        jax.distributed.initialize(
            coordinator,
            count,
            index,
            local_device_ids=local_ids,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_s,
            coordinator_bind_address=f"{bind}:{coordinator.rsplit(':', 1)[1]}",
        )
    except ProcessError:
        raise
    except Exception as e:
        raise ProcessError(f"could not join the run at {coordinator or 'auto'}: {e}") from e
    from jax._src import distributed
    from jax.experimental import transfer

    client = distributed.global_state.client
    index, count = jax.process_index(), jax.process_count()
    server = transfer.start_transfer_server(
        jax.local_devices()[0].client, f"{bind}:0", [f"{bind}:0"]
    )
    # (a process started again after it died takes its place: its keys are overwritten)
    client.key_value_set(f"dora/addr/{index}", server.address(), allow_overwrite=True)
    token = uuid.uuid4().hex[:16]
    client.key_value_set(f"dora/join/{index}", token, allow_overwrite=True)
    proc = Process(index, count, client, server, bind, token=token, coordinator=coordinator)
    # leaving on its own (an error returned, the interpreter exiting): what peers do then (they
    # end too) is no news, and must not turn this exit into "a peer is gone" (exit 3)
    atexit.register(proc._finishing.set)
    return proc
