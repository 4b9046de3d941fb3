"""The trainer as one program on every trainer process, in one process: the commands process 0
broadcasts (through the inter-process codec) run by another worker give its trainer process 0's
state bit for bit, through the same compiled executables; exports and host states are the
trainer's own; a command outside the vocabulary is refused. (Two real processes:
tests/test_multiprocess.py, slow.)"""

from pathlib import Path

import jax
import numpy as np
import pytest

from dora_jax.config import load_config
from dora_jax.distributed.codec import decode, encode
from dora_jax.execution import commands as c
from dora_jax.execution.trainer_worker import SpmdTrainer, TrainerWorker
from dora_jax.mesh import build_meshes, make_mesh
from dora_jax.model import abstract_params, param_axes
from dora_jax.sharding import rollout_rules, tree_shardings
from dora_jax.train import Trajectory

ROOT = Path(__file__).resolve().parents[1]
G = 4


def trajectories(seed: int, version: int, groups: int = 2) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, 60, int(rng.integers(2, 6))).tolist()
        for _ in range(G):
            n = int(rng.integers(2, 9))
            out.append(
                Trajectory(
                    prompt,
                    rng.integers(3, 60, n).tolist(),
                    (-rng.random(n) * 3).tolist(),
                    float(rng.random()),
                    version,
                    (seed, g),
                )
            )
    return out


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_same(a, b):
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def cfg():
    return load_config(
        ROOT / "configs" / "default.yaml",
        [
            f"train.group_size={G}",
            "train.length_buckets=[32]",
            "rollout.max_prompt_len=8",
            "rollout.max_new_tokens=16",
            "mesh.trainer.devices=0:4",
            "mesh.trainer.data=2",
            "mesh.trainer.model=2",
            "mesh.rollout.devices=4:8",
            "mesh.rollout.groups=4",
        ],
    )


# slow: 19-26 s; the multi-process tests (slow) run the spanning trainer end to end, and the
# default suite keeps this file's protocol test
@pytest.mark.slow
def test_broadcast_commands_give_the_other_worker_the_leads_state(cfg):
    meshes = build_meshes(cfg.mesh)
    sent: list = []
    lead = SpmdTrainer.start(
        cfg, meshes.trainer, {"hf": None}, lambda m: sent.append(decode(encode(m)))
    )
    # the other process's worker on other devices of the same layout (here: a whole copy)
    other = TrainerWorker(cfg, make_mesh(jax.devices()[4:8], 2, 2), lead=False, spans=True)
    v0 = lead.export_params()
    for v in range(2):
        lead.step(lead.pack(trajectories(v, v), num_groups=2, version=v))
    group = make_mesh(jax.devices()[6:8], 1, 2)
    in_groups = tree_shardings(
        param_axes(cfg.model), abstract_params(cfg.model), rollout_rules(), group
    )
    placed = lead.export_params(in_groups)
    whole = lead.export_params()
    state = lead.host_state()
    names = [
        "StartTrainer",
        "ExportParams",
        "TrainStep",
        "TrainStep",
        "ExportParams",
        "ExportParams",
        "GatherState",
    ]
    assert [type(m).__name__ for m in sent] == names == lead.worker.applied
    for m in sent:
        other.apply(m)

    assert other.applied == lead.worker.applied
    # one executable each, compiled by each worker (on other devices here: the two processes of
    # tests/test_multiprocess.py compare their fingerprints)
    assert other.fingerprints.keys() == lead.worker.fingerprints.keys() and len(other.fingerprints)
    assert_same(other.trainer.state, state)  # bit for bit, through the codec
    assert lead.version == other.trainer.version == 2
    assert_same(whole, lead.trainer.export_params())
    assert_same(placed, whole)
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves(whole))  # process 0's copy
    pairs = zip(jax.tree.leaves(placed), jax.tree.leaves(in_groups), strict=True)
    assert all(x.sharding == s for x, s in pairs)
    with pytest.raises(AssertionError):  # the first export is of version 0, not the last
        assert_same(v0, whole)
    batch = sent[2].batch
    assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.bool_


def test_commands_outside_the_vocabulary_are_refused(cfg):
    meshes = build_meshes(cfg.mesh)
    lead = SpmdTrainer.start(cfg, meshes.trainer, {"hf": None}, lambda m: None)
    with pytest.raises(ValueError, match="restores from a checkpoint only"):
        lead.load_host_state(lead.host_state())
    with pytest.raises(ValueError, match="restores from a checkpoint only"):
        lead.state = lead.host_state()
    with pytest.raises(ValueError, match="unknown trainer command Step"):
        lead.run(c.Step(0))
