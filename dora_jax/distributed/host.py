"""The main loop of every process but 0: build the engines of this process's rollout groups when
process 0 says so (and, when this process holds devices of the trainer mesh, its part of the
trainer), then carry out its calls until it says stop (or goes away).

A SIGTERM (the notice before a preemption) makes a rollout host leave without loss: it tells
process 0, which pauses its groups, takes a host copy of their requests (KV included) and hands
them to other groups of their versions, then lets it go (exit 0). A host holding part of the
trainer, one whose engines are not built yet, or a second signal, stops at once (143)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback

from dora_jax.distributed.channel import Channel
from dora_jax.distributed.process import Process
from dora_jax.distributed.remote import GroupHost
from dora_jax.distributed.transfers import Transfers
from dora_jax.execution.trainer_worker import FollowTrainer
from dora_jax.orchestrator.clock import make_clock

LEAVE_S = 60.0  # how long a leaving host waits for process 0 to take its requests


def serve(proc: Process, log=print) -> int:
    """Host this process's groups for process 0; returns the exit code."""
    from dora_jax.config import ExperimentConfig
    from dora_jax.config.loading import from_dict
    from dora_jax.mesh import build_meshes, processes
    from dora_jax.rollout import Engine

    channel = Channel(proc.client, proc.index, token=proc.token)
    transfers = Transfers(proc)
    done = threading.Event()
    host: list[GroupHost] = []
    follower: list[FollowTrainer] = []  # this process's part of a trainer spanning processes
    among: list[int] = []  # the processes at the last barrier (process 0 says)

    def trainer_failed(e: BaseException) -> None:
        traceback.print_exc()
        print(
            f"error: process {proc.index}: the trainer's command failed "
            f"({type(e).__name__}: {e}); this process stops",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    def on_message(msg: dict) -> None:
        if msg["op"] == "init":
            transfers.epoch = msg.get("epoch", 0)
            cfg = from_dict(ExperimentConfig, msg["config"])
            meshes = build_meshes(cfg.mesh)
            mine = {g: m for g, m in enumerate(meshes.groups) if processes(m) == {proc.index}}
            stops = msg["eos_ids"]  # the tokenizer's EOS ids (rollout.extra_eos_ids: the config)
            engines = {g: Engine(cfg.model, cfg.rollout, m, stops) for g, m in mine.items()}
            host.append(GroupHost(channel, transfers, engines, make_clock(msg["clock"])))
            log(f"process {proc.index}: hosting rollout groups {sorted(engines)}", flush=True)
            if proc.index in processes(meshes.trainer):
                follower.append(FollowTrainer(cfg, meshes.trainer))
                log(f"process {proc.index}: running the trainer's commands", flush=True)
            channel.send(0, {"op": "reply", "reply": msg["reply"], "value": sorted(engines)})
        elif msg["op"] == "trainer":
            follower[0].handle(msg["cmd"], trainer_failed)
        elif msg["op"] == "shutdown":
            among.extend(msg.get("among", range(proc.count)))
            done.set()
        elif msg["op"] == "leave":
            handed.set()
        else:
            host[0].handle(msg)

    handed, leaving = threading.Event(), threading.Event()

    def leave(signum: int) -> None:
        log(f"process {proc.index}: signal {signum}: handing my requests over", flush=True)
        channel.send(0, {"op": "leaving", "why": f"signal {signum}"})
        ok = handed.wait(LEAVE_S)
        log(
            f"process {proc.index}: "
            + ("requests handed over; leaving" if ok else f"no answer in {LEAVE_S:.0f} s; leaving"),
            flush=True,
        )
        sys.stderr.flush()
        os._exit(0 if ok else 128 + signum)

    def on_sigterm(signum, frame) -> None:
        if leaving.is_set() or not host or follower:
            os._exit(128 + signum)
        leaving.set()
        threading.Thread(target=leave, args=(signum,), name="dora-leave", daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    channel.listen(0, on_message)
    proc.start_watchdog()
    while not done.wait(0.5):  # (woken now and then: a signal's handler runs on this thread)
        pass
    if host:
        host[0].stopped.set()
        for t in host[0].transports.values():
            t.stop()
    for f in follower:
        f.close()
        w = f.worker
        record = {
            "process": proc.index,
            "applied": w.applied,
            "executables": {"x".join(map(str, k)): v for k, v in sorted(w.fingerprints.items())},
        }
        log(f"process {proc.index}: trainer commands: {json.dumps(record)}", flush=True)
    channel.close()
    log(f"process {proc.index}: done", flush=True)
    proc.finish(among=among or None)
    return 0
