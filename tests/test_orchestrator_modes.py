"""What each of the five modes does on the fake backend. Its throughput ranking follows the costs
it is given (prefill rate, weight-transfer and migration ticks), so no speed is asserted here:
the ranking of the modes is tested on the simulator's cost model (``test_sim_run.py``)."""

import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

from dora_jax.config.schema import ConfigError, OrchestratorConfig
from dora_jax.orchestrator import FakeBackendConfig, run_fake

ROOT = Path(__file__).resolve().parents[1]

# a small long-tailed workload: p99 / median = 12, 4 groups of 4 slots, G = 4
BACKEND = FakeBackendConfig(
    num_groups=4,
    max_slots=4,
    max_prompt_len=64,
    max_new_tokens=400,
    length_median=20,
    length_p99_ratio=12,
    prefill_tokens_per_tick=32,
    weight_transfer_ticks=3,
    migrate_ticks=1,
    seed=1,
)


def _run(mode: str, k: int = 2, steps: int = 8, **kw):
    cfg = OrchestratorConfig(
        mode=mode,
        staleness_k=k,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=8,
        **kw,
    )
    return run_fake(cfg, 4, BACKEND, num_steps=steps, step_ticks=10, prompt_len=(8, 64))


def _decoding_while_training(rec) -> int:
    return sum(
        1
        for row, c in zip(rec.groups, rec.cluster, strict=True)
        if c.training and any(g.activity in ("decode", "prefill") for g in row)
    )


def _versions_per_step(rec) -> dict[int, set[int]]:
    out = defaultdict(set)
    for c in rec.consumed:
        out[c.trainer_version].add(c.version)
    return out


def test_sync_idles_rollout_during_training():
    run = _run("sync", k=3)  # K is ignored: sync is on-policy
    rec, s = run.result.records, run.result.summary
    assert _decoding_while_training(rec) == 0
    assert s.staleness_max == 0 and s.max_live_versions == 1 and s.bubble > 0.2
    assert all(len(b) == 2 * 4 for _, b in run.trainer.batches)  # TBS prompt groups of G


def test_one_step_overlaps_one_version_per_batch():
    run = _run("one_step", k=3)  # one-step off-policy: K = 1 whatever the config says
    rec, s = run.result.records, run.result.summary
    assert _decoding_while_training(rec) > 0
    assert s.staleness_max == 1 and s.max_live_versions == 1
    assert all(len(vs) == 1 for vs in _versions_per_step(rec).values())
    with pytest.raises(ConfigError, match="^staleness_k: one_step mode .* needs staleness_k >= 1"):
        OrchestratorConfig(mode="one_step", staleness_k=0)


def test_partial_reprefills_and_spans_versions():
    run = _run("partial")
    s = run.result.summary
    assert s.reprefill_tokens > 0 and s.max_version_span > 1
    assert s.staleness_max <= 2 and s.migrated == 0


def test_oversample_discards_the_long_tail():
    run = _run("oversample")
    s, rec = run.result.summary, run.result.records
    assert s.discarded > 0 and s.staleness_max == 0
    consumed = [c.response_len for c in rec.consumed]
    assert sum(consumed) / len(consumed) < BACKEND.length_median * 1.5  # biased to short ones


def test_dora_keeps_versions_apart_and_migrates_kv():
    run = _run("dora")
    s, rec = run.result.summary, run.result.records
    assert s.max_live_versions > 1 and s.max_version_span == 1 and s.reprefill_tokens == 0
    assert s.migrated > 0 and s.plans > 0 and s.staleness_max <= 2
    assert _decoding_while_training(rec) > 0
    triggers = {p.trigger for p in rec.plans}
    assert {"new_version", "period"} <= triggers


def test_mode_config_is_validated():
    with pytest.raises(ConfigError, match="legacy_fill"):
        OrchestratorConfig(legacy_fill="yes")
    with pytest.raises(ConfigError, match="rollout_batch_prompts"):
        OrchestratorConfig(train_batch_prompts=4, rollout_batch_prompts=2)


def _compare_module():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "launch/compare_modes_fake.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_command_prints_every_mode(capsys):
    cmp = _compare_module()
    assert cmp.main(["--steps", "2", "--modes", "sync,dora"]) == 0
    out = capsys.readouterr().out
    assert "traj/tick" in out and "sync" in out and "dora" in out


def test_fill_admission_packs_the_fewest_groups():
    """orchestrator.admission=fill: a batch goes to the fullest group with room first (groups that
    share cores cost a whole step each); spread: to the group with the most room."""
    busy, done = {}, {}
    for admission in ("spread", "fill"):
        run = _run("sync", steps=3, admission=admission)
        rec = run.result.records
        first = next(row for row in rec.groups if any(g.activity == "prefill" for g in row))
        busy[admission] = sorted(g.group for g in first if g.activity == "prefill")
        done[admission] = run.result.summary.trajectories
    # the first batch, 2 prompt groups of 4, over 4 groups of 4 slots
    assert busy == {"spread": [0, 1, 2, 3], "fill": [0, 1]}
    assert done["fill"] == done["spread"] > 0


def test_admission_is_validated():
    with pytest.raises(ConfigError, match="admission"):
        OrchestratorConfig(admission="pack")
