"""The main loop of every process but 0: build the engines of this process's rollout groups when
process 0 says so (and, when this process holds devices of the trainer mesh, its part of the
trainer), then carry out its calls until it says stop (or goes away)."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

from dora_jax.distributed.channel import Channel
from dora_jax.distributed.process import Process
from dora_jax.distributed.remote import GroupHost
from dora_jax.distributed.transfers import Transfers
from dora_jax.execution.trainer_worker import FollowTrainer


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
            host.append(GroupHost(channel, transfers, engines, msg["wall"]))
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
        else:
            host[0].handle(msg)

    channel.listen(0, on_message)
    proc.start_watchdog()
    done.wait()
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
