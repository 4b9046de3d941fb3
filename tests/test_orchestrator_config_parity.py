"""The simulator reads the orchestrator's own config: for every orchestrator config below, the
simulator's loader and a real run's loader both accept it (and then run the same orchestrator
config), or both refuse it with the same field and the same reason."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from dora_jax.config import ConfigError, load_config
from dora_jax.config.schema import OrchestratorConfig, PlannerConfig
from dora_jax.orchestrator import PlanPolicy, mode_for
from dora_jax.sim.config import OrchestrationConfig, load_sim_config
from dora_jax.sim.run import build

ROOT = Path(__file__).resolve().parents[1]
TICK_S = 0.5  # the simulator's modeled seconds per tick in these configs

# the fields whose defaults differ (the simulator models large clusters): every config below
# states them, so both sides read one orchestrator config
REAL = {f.name: f.default for f in dataclasses.fields(OrchestratorConfig)}
SIM = {f.name: f.default for f in dataclasses.fields(OrchestrationConfig)}
BASE = {k: v for k, v in REAL.items() if k in SIM and SIM[k] != v and k != "clock"}

ACCEPTED = [
    {},
    {"mode": "sync", "staleness_k": 0},
    {"mode": "sync", "staleness_k": 3},  # sync runs at K = 0 whatever staleness_k says
    {"mode": "one_step", "staleness_k": 1},
    {"mode": "one_step", "staleness_k": 2},  # one_step runs at K = 1
    {"mode": "partial", "staleness_k": 0},
    {"mode": "oversample", "train_batch_prompts": 2, "rollout_batch_prompts": 6},
    {"mode": "dora", "staleness_k": "auto", "k_min": 1, "k_max": 3, "ess_min": 0.8},
    {"mode": "dora", "staleness_k": "auto", "k_min": 0, "k_max": 0},
    {"train_batch_prompts": 3, "rollout_batch_prompts": 3, "kv_pressure_threshold": 1.0},
    {"legacy_fill": False, "plan_on_idle": False, "plan_hysteresis": False, "admission": "fill"},
    {"plan_period_ticks": 1, "prefer_local_moves": False, "stall_s": 5.0},
    {"planner": {"kv_aware": False, "consolidate": False, "spread": False, "prewarm": False}},
    {"planner": {"legacy_fill_margin": 1}},
]
REFUSED = [
    {"staleness_k": -1},
    {"staleness_k": 1.5},
    {"staleness_k": "two"},
    {"mode": "partial", "staleness_k": "auto"},
    {"mode": "sync", "staleness_k": "auto"},
    {"mode": "one_step", "staleness_k": "auto"},
    {"mode": "one_step", "staleness_k": 0},
    {"mode": "async"},
    {"train_batch_prompts": 8, "rollout_batch_prompts": 4},
    {"train_batch_prompts": 0, "rollout_batch_prompts": 4},
    {"ess_min": 1.0},
    {"ess_min": 0.0},
    {"k_min": 3, "k_max": 2},
    {"k_min": -1},
    {"kv_pressure_threshold": 0.0},
    {"kv_pressure_threshold": 1.5},
    {"plan_period_ticks": 0},
    {"admission": "random"},
    {"legacy_fill": "yes"},
    {"stall_s": 0.0},
    {"staleness": 2},  # unknown key
    {"planner": {"legacy_fill_margin": 0}},
    {"planner": {"spred": False}},  # unknown key
    {"planner": {"kv_aware": 1}},
    {"planner": "off"},
]


def load_both(tmp_path: Path, orch: dict):
    """(real outcome, simulator outcome) of the orchestrator config ``orch``: the loaded config
    or the ConfigError. The simulator takes ``mode`` from run.modes and the plan period in
    modeled seconds."""
    orch = {**BASE, **orch}
    real_file, sim_file = tmp_path / "real.yaml", tmp_path / "sim.yaml"
    real_file.write_text(yaml.safe_dump({"orchestrator": orch}))
    sim = {k: v for k, v in orch.items() if k not in ("mode", "plan_period_ticks")}
    period = orch.get("plan_period_ticks", REAL["plan_period_ticks"])
    sim["plan_period_s"] = period * TICK_S if isinstance(period, int) else period
    mode = orch.get("mode", REAL["mode"])
    run = {"modes": [mode], "colocated": [], "tick_s": TICK_S}
    sim_file.write_text(yaml.safe_dump({"orchestration": sim, "run": run}))
    out = []
    for loader, path in ((load_config, real_file), (load_sim_config, sim_file)):
        try:
            out.append(loader(path))
        except ConfigError as e:
            out.append(e)
    return out


@pytest.mark.parametrize("orch", ACCEPTED, ids=repr)
def test_both_accept_and_run_the_same_orchestrator_config(tmp_path, orch):
    real, sim = load_both(tmp_path, orch)
    assert not isinstance(real, ConfigError), real
    assert not isinstance(sim, ConfigError), sim
    run = sim.orchestration.for_run(real.orchestrator.mode, sim.run.tick_s)
    assert run == dataclasses.replace(real.orchestrator, clock="logical")
    assert type(run) is OrchestratorConfig
    mode_for(real.orchestrator)  # a real run's last check (its mode may refuse the config)
    mode_for(run)


@pytest.mark.parametrize("orch", REFUSED, ids=repr)
def test_both_refuse_naming_the_same_field(tmp_path, orch):
    real, sim = load_both(tmp_path, orch)
    assert isinstance(real, ConfigError), f"a real run accepts {orch}"
    assert isinstance(sim, ConfigError), f"the simulator accepts {orch}"
    field = real.path.removeprefix("orchestrator.")
    moved = {"mode": "run.modes", "plan_period_ticks": "orchestration.plan_period_s"}
    if field in moved:  # the simulator's runs take their mode from run.modes, and seconds
        assert sim.path == moved[field]
        return
    assert sim.path == f"orchestration.{field}"
    why = real.reason.removesuffix(f" (in {tmp_path / 'real.yaml'})")
    sim_why = sim.reason.removesuffix(f" (in {tmp_path / 'sim.yaml'})")
    assert sim_why == why or sim_why.startswith(f"{why} (the "), (why, sim_why)


def test_every_mode_the_simulator_runs_is_checked():
    """run.modes and run.colocated: each run's orchestrator config is checked at load."""
    auto = ["orchestration.staleness_k=auto", "run.modes=[dora]"]
    with pytest.raises(
        ConfigError, match=r"^orchestration\.staleness_k: .*\(the sync run of run.modes"
    ):
        load_sim_config(overrides=auto)  # run.colocated: [sync, partial] by default
    cfg = load_sim_config(overrides=[*auto, "run.colocated=[]"])
    assert cfg.orchestration.for_run("dora", 1.0).staleness_k == "auto"
    with pytest.raises(ConfigError, match=r"^orchestration\.staleness_k: one_step mode"):
        load_sim_config(overrides=["orchestration.staleness_k=0", "run.modes=[one_step]"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("orchestration.mode=sync", "each run's mode is one of run.modes"),
        ("orchestration.clock=wall", "the simulator runs on the logical clock"),
        ("orchestration.plan_period_ticks=8", "the simulator takes plan_period_s"),
    ],
)
def test_the_fields_the_simulator_sets_are_refused(override, message):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{field}: {message}"):
        load_sim_config(overrides=[override])


def test_the_planner_switches_reach_both_planners():
    """orchestrator.planner is the one place: the real mode's PlanPolicy and the simulator's
    both carry it; by default a real run plans as it did before the section existed."""
    assert mode_for(OrchestratorConfig()).plan_policy == PlanPolicy(
        rollout_batch_prompts=8,
        kv_pressure_threshold=0.9,
        legacy_fill=True,
        prefer_local=True,
        kv_aware=True,
        consolidate=True,
        spread=True,
        prewarm=True,
        legacy_fill_margin=2,
    )
    off = PlannerConfig(kv_aware=False, consolidate=False, spread=False, legacy_fill_margin=3)
    policy = mode_for(OrchestratorConfig(planner=off)).plan_policy
    assert dataclasses.asdict(policy) == {**dataclasses.asdict(policy), **dataclasses.asdict(off)}
    tiny = ROOT / "configs" / "sim" / "tiny_qwen7b_h100.yaml"
    over = ["orchestration.planner.spread=false", "orchestration.planner.legacy_fill_margin=3"]
    runtime, _, _ = build(load_sim_config(tiny, over), "dora")
    assert not runtime.mode.plan_policy.spread and runtime.mode.plan_policy.legacy_fill_margin == 3
    assert runtime.mode.plan_policy.kv_pressure_threshold == 0.95  # the simulator's default
