"""The memory plan: per-device bytes from configs and abstract compilation, refusal with advice,
KV pages sized from the memory left, and the trainer adopting the plan's compiled step."""

import jax
import numpy as np
import pytest

from dora_jax.config import load_config
from dora_jax.mesh import build_meshes
from dora_jax.model import count_params
from dora_jax.pipeline.experiment import ExperimentError, build
from dora_jax.pipeline.memory_plan import (
    TRANSIENT,
    MemoryPlanError,
    compiled_train_step,
    longest_bucket,
    plan_memory,
)
from dora_jax.train import Trainer, Trajectory

SMALL = [
    "model.vocab_size=64",
    "model.hidden_size=32",
    "model.intermediate_size=48",
    "model.num_layers=2",
    "train.group_size=4",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.length_buckets=[16,48,512]",
    "rollout.max_prompt_len=16",
    "rollout.max_new_tokens=24",
    "rollout.max_slots=4",
    "rollout.num_pages=40",
    "rollout.page_size=8",
    "rollout.prefill_chunk=8",
    "warm_start.steps=0",
    "eval.num_prompts=0",
    "logging.progress=false",
]
GiB = 1 << 30


def small(*overrides):
    return load_config(None, SMALL + list(overrides))


def by_what(plan, device):
    return {i.what.split(" (")[0]: i for i in plan.items if i.device == device}


def test_plan_counts_state_exports_engines_kv_and_compiled_temporaries():
    cfg = small()
    plan = plan_memory(cfg)
    n = count_params(cfg.model)
    t0 = by_what(plan, 0)
    # trainer 2 x 2: params and moments split over the model axis where they divide
    assert 0 < t0["train params"].bytes <= 4 * n
    moments = t0["optimizer moments"].bytes - 2 * t0["train params"].bytes
    assert 0 <= moments <= 64  # mu and nu, plus step counters
    assert t0["exports"].bytes == 3 * t0["train params"].bytes  # K + 1 = 3 live versions
    assert t0["train step temporaries"].kind == TRANSIENT
    # the longest bucket a sample can need: 16 + 24 = 40 tokens -> 48, not the largest (512)
    assert longest_bucket(cfg) == 48 and plan.train_bucket == (8, 48)
    ma = compiled_train_step(
        cfg.model, cfg.train, build_meshes(cfg.mesh).trainer, cfg.mesh.trainer, 8, 8, 48
    ).memory_analysis()
    assert t0["train step temporaries"].bytes >= ma.temp_size_in_bytes > 0
    g = by_what(plan, 4)  # one rollout group per device 4..7
    page = 2 * 2 * 8 * 2 * 8 * 4  # K, V x layers x page size x kv heads x head dim x float32
    assert g["KV caches"].bytes == 40 * page
    assert g["engine params"].bytes == 4 * n  # one version (one engine), float32, replicated
    assert g["engine step temporaries"].kind == TRANSIENT
    # a device's total: everything resident plus the larger transient only
    resident = sum(i.bytes for i in t0.values() if i.kind != TRANSIENT)
    assert plan.total([0]) == resident + t0["train step temporaries"].bytes
    assert "device 0" in plan.table() and "KV pages per engine: 40" in plan.table()
    plan.check()  # a tiny model fits anything


def test_multiprocess_exports_are_counted_in_the_groups_layout(monkeypatch):
    """A multi-process run on accelerators exports versions in the rollout groups' layout (tp 1:
    whole models) on process 0's first device: the plan counts them there, not split over the
    trainer mesh (checked here by pretending to be such a run)."""
    from dora_jax.pipeline import memory_plan

    cfg = small()
    n = count_params(cfg.model)
    before = by_what(plan_memory(cfg), 1)["exports"].bytes
    monkeypatch.setattr(memory_plan, "exports_in_group_layout", lambda: True)
    plan = plan_memory(cfg)
    on = {
        d: [i for i in plan.items if i.device == d and i.what.startswith("exports")] for d in (0, 1)
    }
    v0, later = (i.bytes for i in on[0])
    assert later == 3 * 4 * n  # K + 1 = 3 whole float32 models on device 0
    assert v0 == before // 3 and [i.bytes for i in on[1]] == [before // 3]  # version 0 only


def test_colocated_engines_alias_the_trainer_exports():
    cfg = small(
        "mesh.trainer.devices=0:1",
        "mesh.trainer.data=1",
        "mesh.trainer.model=1",
        "mesh.rollout.devices=0:1",
        "mesh.rollout.groups=3",
    )
    plan = plan_memory(cfg)
    mine = by_what(plan, 0)
    assert "engine params" not in mine and any(
        "share the trainer's exports" in n for n in plan.notes
    )
    assert "3 engine(s) x 40 pages" in mine["KV caches"].what
    assert plan.devices() == [0]


def test_wall_clock_counts_the_trainer_and_every_engine_step_at_once():
    """A trainer and three engines on one device: the logical clock steps them one after another
    (the largest transient counts); the wall clock steps each on its own worker thread, so the
    train step's and all three engines' temporaries count together."""
    colocated = [
        "mesh.trainer.devices=0:1",
        "mesh.trainer.data=1",
        "mesh.trainer.model=1",
        "mesh.rollout.devices=0:1",
        "mesh.rollout.groups=3",
    ]
    plans = {
        c: plan_memory(small(*colocated, f"orchestrator.clock={c}")) for c in ("logical", "wall")
    }
    mine = {c: by_what(p, 0) for c, p in plans.items()}
    train = mine["logical"]["train step temporaries"].bytes
    engine = mine["logical"]["engine step temporaries"].bytes
    assert mine["wall"]["train step temporaries"].bytes == train > 0
    assert mine["wall"]["engine step temporaries"].bytes == 3 * engine > 0
    resident = sum(i.bytes for i in mine["logical"].values() if i.kind != TRANSIENT)
    assert plans["logical"].total([0]) == resident + max(train, engine)
    assert plans["wall"].total([0]) == resident + train + 3 * engine
    assert plans["wall"].to_dict()["transients_summed"] and "summed" in plans["wall"].table()
    assert not plans["logical"].to_dict()["transients_summed"]


def test_a_config_over_the_memory_is_refused_with_what_to_change():
    plan = plan_memory(small("mesh.device_memory_gib=0.0001"))
    with pytest.raises(MemoryPlanError) as e:
        plan.check()
    text = str(e.value)
    assert "the memory plan does not fit" in text and "mesh.device_memory_gib" in text
    assert "to change:" in text and "largest items:" in text
    assert any(k in text for k in ("train.microbatches", "rollout.num_pages", "max_slots"))


def test_null_num_pages_takes_the_memory_left():
    budget_gib = 0.05
    cfg = small("rollout.num_pages=null", f"mesh.device_memory_gib={budget_gib}")
    plan = plan_memory(cfg)
    assert plan.pages_sized and plan.num_pages > 40
    plan.check()  # sized to fit
    group = [i for i in plan.items if i.device == 4]
    kv = next(i for i in group if i.what.startswith("KV"))
    page = kv.bytes // plan.num_pages
    # the fullest rollout device has less than one more page per engine left
    fullest = max(plan.total([d]) for d in (4, 5, 6, 7))
    assert fullest <= plan.budget < fullest + page
    with pytest.raises(MemoryPlanError, match="rollout.num_pages: .* fewer than"):
        plan_memory(small("rollout.num_pages=null", "mesh.device_memory_gib=0.0002"))


def test_build_refuses_before_loading_anything(tmp_path):
    cfg = small("mesh.device_memory_gib=0.0001", f"run_dir={tmp_path}")
    with pytest.raises(ExperimentError, match="the memory plan does not fit"):
        build(cfg, tmp_path)


@pytest.mark.slow  # 12 s (the default suite stays under 15 minutes)
def test_trainer_runs_the_plans_compiled_step_without_compiling_again():
    cfg = small()
    meshes = build_meshes(cfg.mesh)
    compiled = compiled_train_step(cfg.model, cfg.train, meshes.trainer, cfg.mesh.trainer, 8, 8, 48)
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            rng.integers(3, 64, 5).tolist(),
            rng.integers(3, 64, 30).tolist(),
            (-rng.random(30)).tolist(),
            float(rng.random()),
            0,
            g,
        )
        for g in range(2)
        for _ in range(4)
    ]
    params = jax.device_get(Trainer(cfg.model, cfg.train).state.params)
    plain = Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params)
    adopted = Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params)
    adopted.adopt_compiled(compiled, 8, 48)
    batch = plain.pack(trajs)
    assert (batch.num_rows, batch.seq_len) == (8, 48)
    m_plain, m_adopted = plain.step(batch), adopted.step(batch)
    assert adopted.num_compiles == 0 and plain.num_compiles == 1
    np.testing.assert_allclose(float(m_adopted["loss"]), float(m_plain["loss"]), rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(adopted.state.params), jax.tree.leaves(plain.state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="accelerators report their memory; the host share is CPU-only",
)
def test_cpu_devices_share_the_host(monkeypatch):
    """No reported memory (CPU): the devices the run uses share the host's memory, so their sum
    is checked against it, however many fake devices the process has and however unevenly the
    run loads them (a trainer device carries most of a real model's footprint)."""
    from dora_jax.pipeline import memory_plan

    assert jax.device_count() == 8  # the process has eight; the runs below use two
    one = ["mesh.trainer.devices=0:1", "mesh.trainer.data=1", "mesh.trainer.model=1"]
    two = small(*one, "mesh.rollout.devices=1:2", "mesh.rollout.groups=1")
    monkeypatch.setattr(memory_plan, "host_memory", lambda: 1 * GiB)
    plan = plan_memory(two)
    assert plan.shared and plan.devices() == [0, 1] and plan.limit == GiB
    assert list(plan.pools()) == ["the host (CPU devices 0, 1)"]
    total = plan.total([0, 1])
    assert plan.summary().startswith(f"memory plan: {total / (1 << 20):.1f} MiB on 2 CPU devices")
    assert plan.summary().endswith(": ok")
    # the whole run fits the host although one device holds more than an even share of it
    monkeypatch.setattr(memory_plan, "host_memory", lambda: int(total / 0.9) + 1)
    assert plan_memory(two).total([0]) > plan_memory(two).budget / 2
    plan_memory(two).check()
    monkeypatch.setattr(memory_plan, "host_memory", lambda: int(total / 0.9) - (1 << 20))
    with pytest.raises(MemoryPlanError, match=r"the host \(CPU devices 0, 1\) needs .* over 90%"):
        plan_memory(two).check()
    # a per-device figure from the config is checked per device, as on accelerators
    assert not plan_memory(small("mesh.device_memory_gib=2")).shared


def test_the_one_line_summary_and_the_written_plan(tmp_path):
    plan = plan_memory(small("mesh.device_memory_gib=1"))
    device = max(plan.devices(), key=lambda d: plan.total([d]))
    line = plan.summary()
    assert line.startswith("memory plan: at most ") and f"per device (device {device})" in line
    assert "against 921.6 MiB (90% of 1.00 GiB, mesh.device_memory_gib): ok" in line
    assert "\n" not in line
    over = plan_memory(small("mesh.device_memory_gib=0.0001"))
    assert over.summary().endswith(": over")
    path = plan.write(tmp_path / "memory_plan.txt")
    assert path.read_text() == plan.table() + "\n" and "device 0:" in path.read_text()
