"""benchmarks/sim_agentic_cpu.py: the simulator's prediction of a real multi-turn run from its
measured conversations (the fits, and a short prediction on the teacher's ideal play)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_agentic_cpu as sac  # noqa: E402


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return sac.synthesize(tmp_path_factory.mktemp("conv") / "conversations.jsonl", 24)


def test_the_ideal_play_is_counted_in_the_character_tokenizer(synthetic):
    rows = sac.read_conversations(synthetic)
    assert len(rows) == 24 * 8
    for r in rows:
        turns = r["model_turn_tokens"]
        assert len(turns) == r["turns"] and sum(turns) == r["model_tokens"]
        assert 3 <= turns[-1] <= 4  # "#r" and EOS
        assert all(13 <= t <= 19 for t in turns[:-1])  # "<call>23-5</call>"
        assert (r["env_tokens"] == 0) == (r["turns"] == 1) and r["prompt_tokens"] >= 4
        assert (r["env_seconds"] > 0) == (r["turns"] > 1)
    assert 0.3 < np.mean([r["turns"] == 1 for r in rows]) < 0.7  # direct answers


def test_fits(tmp_path):
    rows = [{"turns": t, "env_tokens": 2 * (t - 1)} for t in (1, 2, 3, 4) * 10]
    f = sac.fit_observations(rows, 240)
    assert f["measured_mean"] == 2.0 and abs(f["simulated_mean"] / 2.0 - 1) <= 0.01
    rows = [{"turns": t, "env_tokens": e} for t, e in [(2, 1), (2, 2), (3, 3), (3, 2)] * 20]
    f = sac.fit_observations(rows, 240)
    assert f["measured_mean"] == pytest.approx(8 / 6) and f["sigma"] > 0.05
    assert abs(f["simulated_mean"] / f["measured_mean"] - 1) <= 0.01
    # turns shared within blocks of G: correlation 1; independent: near 0
    rng = np.random.default_rng(0)
    shared = np.repeat(rng.integers(1, 6, 50), 8)
    assert sac.group_correlation(shared, 8) == pytest.approx(1.0)
    assert sac.group_correlation(rng.integers(1, 6, 400), 8) < 0.15
    assert sac.group_correlation(shared[:20], 8) is None  # not whole groups
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"turns": 1}) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:1: missing model_tokens"):
        sac.read_conversations(p)


def test_a_short_prediction(synthetic):
    res = sac.predict(synthetic, 0.1, 1.0, modes=("sync", "dora"), steps=3)
    rate = res["model_tokens_per_s"]
    assert set(rate) == {"sync", "dora"} and all(v > 0 for v in rate.values())
    assert res["dora_over_sync"] == pytest.approx(rate["dora"] / rate["sync"])
    assert res["dora_over_partial"] is None
    cfg = res["config"]
    assert cfg["cluster"]["hardware"] == "cpu" and cfg["cluster"]["shared_rollout_device"]
    assert cfg["turns"]["kind"] == "file" and cfg["turns"]["max_total_tokens"] == 240
    assert cfg["turns"]["latency"]["workers"] == 2 and cfg["turns"]["latency"]["per_prompt"]
    assert cfg["turns"]["latency"]["p99_ratio"] == pytest.approx(math.exp(2.3263 * 1.0), 1e-3)
    assert cfg["prompt"]["max_tokens"] == 16 and cfg["run"]["colocated"] == []
    w = res["workload"]
    assert w["fit"]["kv_capacity_tokens"] == 159 * 16
    assert abs(w["simulated"]["turns"]["mean"] / w["measured"]["turns"]["mean"] - 1) < 0.1
    for f in res["modes"].values():
        assert 0 < f["rollout_core_load"] <= 1.0 + 1e-6 and 0 < f["env_worker_load"] <= 1.0


def test_single_turn_rows_recipe_overrides_and_other_constants(tmp_path):
    """Single-turn responses (the regime sweep's rows): the prompt groups' length correlation is
    estimated into ``response.prompt_corr``; the recipe's overrides and another calibration file
    reach the simulator's config."""
    rng = np.random.default_rng(0)
    base = np.repeat(rng.integers(4, 60, 32), 8)  # lengths shared within each prompt group
    rows = [
        {
            "turns": 1,
            "model_tokens": int(n),
            "env_tokens": 0,
            "env_seconds": 0.0,
            "prompt_tokens": 10,
            "model_turn_tokens": [int(n)],
        }
        for n in base
    ]
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calib = json.loads((ROOT / "benchmarks" / "results" / "calibrate_cpu.json").read_text())
    calib["constants"]["decode_step_s"] = 0.0123
    other = tmp_path / "calib.json"
    other.write_text(json.dumps(calib))
    overrides, fit = sac.build_overrides(
        sac.read_conversations(path),
        0.0,
        0.0,
        tmp_path / "work",
        modes=("sync",),
        steps=3,
        seed=0,
        recipe=ROOT / "configs" / "default.yaml",
        recipe_overrides=["orchestrator.rollout_batch_prompts=12"],
        calibration=other,
    )
    assert fit["response_prompt_corr"] == pytest.approx(1.0)
    assert "response.prompt_corr=1.0" in overrides
    assert "orchestration.rollout_batch_prompts=12" in overrides
    used = json.loads((tmp_path / "work" / "calibration.json").read_text())
    assert used["constants"]["decode_step_s"] == 0.0123
    assert used["constants"]["kv_capacity_tokens"] == 99 * 16  # the default config's pages
