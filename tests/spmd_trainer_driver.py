"""Every trainer command on a trainer mesh that spans two processes (started by
``dora_jax.distributed.launcher.launch_local``, one copy per process). Process 0 drives the
trainer through ``SpmdTrainer``: start, exports (whole and in the groups' layout), train steps of
two batch shapes, the state gathered, saved, restored from the run directory, and a step after
it. Every trainer process logs the commands it ran and the fingerprints of the executables it
compiled (``trainer commands: {json}``), which the test compares.

    python tests/spmd_trainer_driver.py key=value ...
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas  # noqa: E402

fake_cpu_devices(8)
limit_malloc_arenas()


def main(argv: list[str]) -> int:
    from dora_jax.distributed.process import initialize, spec_from

    proc = initialize(spec_from())
    if not proc.is_main:
        from dora_jax.distributed.host import serve

        return serve(proc)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from dora_jax.config import load_config, to_dict
    from dora_jax.distributed.cluster import Cluster
    from dora_jax.execution.trainer_worker import SpmdTrainer
    from dora_jax.mesh import build_meshes, make_mesh
    from dora_jax.model import abstract_params, param_axes
    from dora_jax.orchestrator.clock import Bus, LogicalClock
    from dora_jax.sharding import rollout_rules, tree_shardings
    from dora_jax.train import Trajectory

    cfg = load_config(ROOT / "configs" / "default.yaml", argv)
    run_dir = Path(cfg.run_dir)
    meshes = build_meshes(cfg.mesh)
    layout = tree_shardings(
        param_axes(cfg.model),
        abstract_params(cfg.model),
        rollout_rules(),
        make_mesh(jax.local_devices()[:1], 1, 1),
    )
    clock, bus = LogicalClock(), Bus()
    cluster = Cluster(proc)
    cluster.connect(bus.post, clock.now, lambda: layout)
    cluster.start_hosts(to_dict(cfg), [-1], cfg.seed, "logical")
    trainer = SpmdTrainer.start(
        cfg, meshes.trainer, {"hf": None}, cluster.trainer_broadcast(meshes.trainer)
    )
    rng = np.random.default_rng(0)
    G = cfg.train.group_size

    def batch(version: int, groups: int, max_len: int):
        trajs = []
        for g in range(groups):
            prompt = rng.integers(3, 60, 4).tolist()
            for _ in range(G):
                n = int(rng.integers(2, max_len))
                trajs.append(
                    Trajectory(
                        prompt,
                        rng.integers(3, 60, n).tolist(),
                        (-rng.random(n)).tolist(),
                        float(rng.random()),
                        version,
                        (version, g),
                    )
                )
        return trainer.pack(trajs, num_groups=groups, version=version)

    trainer.export_params()
    trainer.step(batch(0, 2, 8))
    trainer.step(batch(1, 3, 60))  # another batch shape: another executable
    trainer.export_params(layout)
    state = trainer.host_state()
    mp = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
    opts = ocp.CheckpointManagerOptions(multiprocessing_options=mp, create=False)
    ckpt = (run_dir / "checkpoints").absolute()
    ckpt.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(ckpt, options=opts, item_names=("train_state",))
    manager.save(2, args=ocp.args.Composite(train_state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()
    trainer.load_host_state(state, checkpoint=(ckpt, 2))
    trainer.step(batch(2, 2, 8))
    final = trainer.host_state()
    w = trainer.worker
    print(
        "trainer commands: "
        + json.dumps(
            {
                "process": 0,
                "applied": w.applied,
                "executables": {
                    "x".join(map(str, k)): v for k, v in sorted(w.fingerprints.items())
                },
                "version": int(final.version),
            }
        ),
        flush=True,
    )
    cluster.stop_hosts()
    proc.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
