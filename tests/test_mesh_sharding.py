"""Meshes from config device slices; sharded forward == unsharded forward on 8 fake devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax import sharding as sh
from dora_jax.config import ConfigError, load_config
from dora_jax.mesh import build_meshes
from dora_jax.model import abstract_params, forward, init_params, param_axes


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_default_meshes_are_disjoint():
    ms = build_meshes(load_config().mesh)
    assert dict(ms.trainer.shape) == {"data": 2, "expert": 1, "model": 2}
    assert len(ms.groups) == 4 and not ms.colocated
    ids = [d.id for m in ms.groups for d in m.devices.flat]
    assert sorted(ids) == [4, 5, 6, 7]
    assert all(dict(m.shape) == {"data": 1, "expert": 1, "model": 1} for m in ms.groups)


def test_expert_axes_widen_the_trainer_and_each_rollout_group():
    cfg = load_config(
        None,
        [
            "mesh.trainer.devices=0:8",
            "mesh.trainer.expert=2",
            "mesh.rollout.devices=0:8",
            "mesh.rollout.groups=2",
            "mesh.rollout.expert=2",
            "mesh.rollout.tp=2",
        ],
    )
    ms = build_meshes(cfg.mesh)
    assert dict(ms.trainer.shape) == {"data": 2, "expert": 2, "model": 2}
    assert [dict(m.shape) for m in ms.groups] == [{"data": 1, "expert": 2, "model": 2}] * 2
    assert [d.id for d in ms.groups[1].devices.flat] == [4, 5, 6, 7]
    rules = sh.trainer_rules(cfg.mesh.trainer)
    # the batch splits over data and expert; experts over expert; a size-1 axis is left out
    assert sh.spec_for(("batch", "seq"), rules, ms.trainer, (8, 4)) == PartitionSpec(
        ("data", "expert"), None
    )
    spec = sh.spec_for(
        ("layers", "experts", "embed", "mlp"), sh.rollout_rules(), ms.groups[0], (2, 8, 16, 32)
    )
    assert spec == PartitionSpec(None, "expert", None, "model")
    with pytest.raises(ConfigError, match=r"needs groups x expert x tp = 2 x 2 x 2 = 8"):
        build_meshes(
            load_config(
                None,
                [
                    "mesh.rollout.devices=2:8",
                    "mesh.rollout.groups=2",
                    "mesh.rollout.expert=2",
                    "mesh.rollout.tp=2",
                ],
            ).mesh
        )


def test_colocated_groups_share_devices():
    cfg = load_config(None, ["mesh.rollout.devices=0:2", "mesh.rollout.tp=2"])
    ms = build_meshes(cfg.mesh)
    assert ms.colocated and len(ms.groups) == 4
    assert all(m.devices.flat[0].id == 0 and m.devices.flat[1].id == 1 for m in ms.groups)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.trainer.devices=0:3"], r"^mesh\.trainer\.devices: slice '0:3' has 3 device"),
        (["mesh.trainer.devices=4:12"], r"^mesh\.trainer\.devices: .* out of range for 8"),
        (["mesh.rollout.devices=4:7"], r"^mesh\.rollout\.devices: slice '4:7' has 3 device"),
        (["mesh.rollout.devices=a:b"], r"^mesh\.rollout\.devices: expected a device slice"),
    ],
)
def test_bad_device_slices_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_meshes(load_config(None, overrides).mesh)


def test_spec_for_replicates_indivisible_dims_and_rejects_unknown_axes():
    ms = build_meshes(load_config(None, ["mesh.trainer.devices=0:8", "mesh.trainer.model=4"]).mesh)
    rules = sh.trainer_rules(load_config().mesh.trainer)
    dropped: list[str] = []
    spec = sh.spec_for(("vocab", "embed"), rules, ms.trainer, (6, 8), dropped)
    assert spec == PartitionSpec(None, None)
    assert dropped == ["dimension 0 (vocab, size 6) over mesh axis 'model' (4)"]
    assert sh.spec_for(("batch", "mlp"), rules, ms.trainer, (4, 8)) == PartitionSpec(
        "data", "model"
    )
    with pytest.raises(KeyError, match="logical axis 'nonsense' has no sharding rule"):
        sh.spec_for(("nonsense",), rules, ms.trainer, (4,))


def test_tree_shardings_warn_naming_the_parameter_and_axis():
    """A parameter dimension that does not divide by its mesh axis is replicated, and said."""
    ms = build_meshes(load_config(None, ["mesh.trainer.devices=0:8", "mesh.trainer.model=4"]).mesh)
    cfg = load_config(None, ["model.num_heads=6", "model.num_kv_heads=2", "model.hidden_size=48"])
    rules = sh.trainer_rules(cfg.mesh.trainer)
    with pytest.warns(sh.ShardingWarning) as record:
        out = sh.tree_shardings(
            param_axes(cfg.model), abstract_params(cfg.model), rules, ms.trainer
        )
    message = str(record[0].message)
    assert "layers/wq: dimension 2 (q_heads, size 6) over mesh axis 'model' (4)" in message
    assert "layers/wk: dimension 2 (kv_heads, size 2)" in message
    assert out["layers"]["wq"].spec == PartitionSpec(None, None, None, None)
    assert out["embed"].spec == PartitionSpec("model", None)  # 64 divides by 4: sharded


@pytest.mark.parametrize("data, model, fsdp", [(2, 4, False), (4, 2, True)])
def test_sharded_forward_equals_unsharded(data, model, fsdp):
    cfg = load_config(
        None,
        [
            "mesh.trainer.devices=0:8",
            f"mesh.trainer.data={data}",
            f"mesh.trainer.model={model}",
            f"mesh.trainer.fsdp={str(fsdp).lower()}",
            "model.num_heads=8",
            "model.num_kv_heads=4",
            "model.vocab_size=128",
        ],
    )
    mesh = build_meshes(cfg.mesh).trainer
    rules = sh.trainer_rules(cfg.mesh.trainer)
    mcfg = cfg.model
    shardings = sh.tree_shardings(param_axes(mcfg), abstract_params(mcfg), rules, mesh)
    key = jax.random.key(7)
    params = init_params(mcfg, key)
    params_sharded = jax.jit(lambda k: init_params(mcfg, k), out_shardings=shardings)(key)
    # Params really are spread over the mesh (not replicated everywhere).
    wq = params_sharded["layers"]["wq"]
    assert wq.sharding.spec == PartitionSpec(None, "data" if fsdp else None, "model", None)
    assert wq.addressable_shards[0].data.shape[2] == mcfg.num_heads // model

    B, T = 8, 16
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, mcfg.vocab_size, (B, T)), jnp.int32)
    seg = np.ones((B, T), np.int32)
    seg[3, 10:] = 0
    seg[5, 6:] = 2  # two sequences packed in one row
    seg = jnp.asarray(seg)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data", None))
    tokens_s, pos_s, seg_s = (jax.device_put(x, batch_sharding) for x in (tokens, pos, seg))

    ref = forward(params, tokens, pos, seg, mcfg)
    with sh.use_rules(mesh, rules):
        out = jax.jit(lambda p, t, q, s: forward(p, t, q, s, mcfg))(
            params_sharded, tokens_s, pos_s, seg_s
        )
    assert out.sharding.spec == PartitionSpec("data", None, "model")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
