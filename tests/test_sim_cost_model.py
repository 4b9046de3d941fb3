"""Presets and cost-model formulas of the simulator, checked by hand."""

import math

import numpy as np
import pytest

from dora_jax.sim.config import EfficiencyConfig
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import HARDWARE, get_hardware
from dora_jax.sim.models import MODELS, get_model

EFF = EfficiencyConfig()


def test_qwen_parameter_counts_match_the_model_cards():
    q7, q32 = get_model("qwen2.5-7b"), get_model("qwen2.5-32b")
    assert q32.params_total == 32_763_876_352  # the architecture of config.json, exactly
    assert abs(q32.params_total / 32.5e9 - 1) < 0.01  # model card: 32.5B
    assert abs(q7.params_total / 7.61e9 - 1) < 0.005  # model card: 7.61B
    assert q32.params_active == q32.params_total - 152064 * 5120  # the input embedding is a lookup
    assert q32.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert q7.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert q32.attn_flops_per_pair == 4 * 64 * 40 * 128


def test_qwen3_parameter_counts_match_the_model_cards():
    dense, a3b, a22b = (get_model(n) for n in ("qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b"))
    embed = 151936 * 5120
    assert abs(dense.params_total / 32.8e9 - 1) < 0.005  # model card: 32.8B
    assert abs((dense.params_total - 2 * embed) / 31.2e9 - 1) < 0.005  # 31.2B non-embedding
    assert not dense.is_moe and dense.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert dense.attn_flops_per_pair == 4 * 64 * 64 * 128
    # MoE: the model cards' activated counts include the input embedding, ours leave it out
    for m, total, activated, hidden in ((a3b, 30.5e9, 3.3e9, 2048), (a22b, 235e9, 22e9, 4096)):
        assert m.is_moe and m.num_experts == 128 and m.active_experts == 8
        assert abs(m.params_total / total - 1) < 0.005, m.name
        assert abs((m.params_active + 151936 * hidden) / activated - 1) < 0.03, m.name
    assert a3b.expert_params == 48 * 128 * 3 * 2048 * 768
    assert a22b.expert_params == 94 * 128 * 3 * 4096 * 1536
    assert a3b.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_moe_preset_is_consistent():
    m = get_model("longcat-flash-560b")
    assert m.is_moe and m.params_total == 560e9 and m.params_active == 27e9
    assert m.expert_params == 28 * 512 * 3 * 6144 * 2048
    # the non-expert part is close to the paper's minimum activation (18.6B: no FFN expert used)
    assert 18e9 < m.params_total - m.expert_params < 19.5e9
    assert 5 < m.active_experts < 12  # of top-12, the rest are zero-computation experts
    assert m.kv_bytes_per_token == 56 * 576 * 2


def test_presets_are_positive_and_named():
    for name, hw in HARDWARE.items():
        assert hw.peak_flops > 0 and hw.hbm_bw > 0 and hw.inter_bw > 0, name
    assert get_hardware("h800").intra_bw == 200e9 and get_hardware("h100").intra_bw == 450e9
    assert set(MODELS) >= {
        "qwen2.5-7b",
        "qwen2.5-32b",
        "longcat-flash-560b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
    }
    with pytest.raises(KeyError, match="unknown hardware"):
        get_hardware("h9000")
    with pytest.raises(KeyError, match="unknown model"):
        get_model("gpt-5")


def test_decode_step_by_hand():
    m, hw = get_model("qwen2.5-32b"), get_hardware("h800")
    cm = CostModel(m, hw, 4, EFF)
    # one request, no context: memory-bound (the weights), plus 128 all-reduces and the overhead
    mem = m.weight_bytes / (4 * hw.hbm_bw * EFF.hbm)
    ar = 128 * (EFF.allreduce_latency_s + 1.5 * 5120 * 2 / (hw.intra_bw * EFF.comm))
    assert math.isclose(float(cm.decode_step_s(1, 0)), mem + ar + EFF.step_overhead_s)
    # KV read grows the step linearly with context
    extra = float(cm.decode_step_s(1, 100_000) - cm.decode_step_s(1, 0))
    assert math.isclose(extra, 100_000 * m.kv_bytes_per_token / (4 * hw.hbm_bw * EFF.hbm))
    # a large batch is compute-bound: 2 P n / (tp F e)
    n = 4096
    comp = 2 * m.params_active * n / (4 * hw.peak_flops * EFF.decode_mfu)
    assert comp > mem
    step = float(cm.decode_step_s(n, 0))
    assert math.isclose(step, comp + float(cm._allreduce_s(n, 128)) + EFF.step_overhead_s)
    # monotone in batch and context
    s = cm.decode_step_s(np.arange(1, 600, 7), 0)
    assert np.all(np.diff(s) >= 0)
    # tp = 1: no all-reduce
    assert float(CostModel(m, get_hardware("h200"), 1, EFF)._allreduce_s(64, 128)) == 0.0


def test_moe_streams_only_touched_experts():
    m = get_model("longcat-flash-560b")
    cm = CostModel(m, get_hardware("h800"), 32, EFF)
    w = cm.weight_bytes_streamed(np.array([1, 8, 64, 512, 10_000]))
    assert np.all(np.diff(w) > 0) and w[-1] <= m.weight_bytes
    assert w[0] < 0.1 * m.weight_bytes  # one token touches ~8 of 512 experts per layer
    assert w[-1] > 0.99 * m.weight_bytes


def test_prefill_moves_and_training_by_hand():
    m, hw = get_model("qwen2.5-7b"), get_hardware("h100")
    cm = CostModel(m, hw, 2, EFF)
    t, pairs = 16_384, 16_384**2 / 2
    comp = (2 * m.params_active * t + m.attn_flops_per_pair * pairs) / (2 * hw.peak_flops * 0.5)
    want = comp + float(cm._allreduce_s(t, 2 * m.allreduces_per_forward))  # 2 chunks of 8192
    assert math.isclose(float(cm.prefill_s(t, pairs)), want)
    assert float(cm.prefill_s(0, 0)) == 0.0
    assert np.allclose(cm.prefill_s(np.array([t, t]), np.array([pairs, pairs])), want)
    assert float(cm.causal_pairs(100, 300)) == (300**2 - 100**2) / 2
    wt = EFF.weight_sync_latency_s + m.weight_bytes / (2 * hw.inter_bw * EFF.comm)
    assert math.isclose(cm.weight_transfer_s(), wt)
    kv = EFF.kv_transfer_latency_s + 10_000 * m.kv_bytes_per_token / (2 * hw.inter_bw * EFF.comm)
    assert math.isclose(cm.kv_transfer_s(10_000), kv)
    seqs = np.array([1000, 3000])
    f = EFF.exp_prep_forwards
    flops = (6 + 2 * f) * m.params_active * 4000 + (3 + f) * m.attn_flops_per_pair * (
        (1000**2 + 3000**2) / 2
    )
    train = flops / (16 * hw.peak_flops * EFF.train_mfu) + EFF.train_step_overhead_s
    assert math.isclose(cm.train_step_s(seqs, 16), train)


def test_kv_capacity_and_what_does_not_fit():
    m, hw = get_model("qwen2.5-32b"), get_hardware("h800")
    cm = CostModel(m, hw, 4, EFF, mem_util=0.8)
    assert cm.kv_capacity_tokens == int((4 * 80e9 * 0.8 - m.weight_bytes) // 262_144)
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(m, get_hardware("a100"), 1, EFF, mem_util=0.8)  # 65.5 GB > 64 GB usable


def test_measured_cpu_preset(tmp_path):
    import json

    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.cost_model import MeasuredCost
    from dora_jax.sim.run import cost_model, simulate

    consts = {
        "decode_step_s": 0.004,
        "decode_steps_per_call": 4,
        "prefill_step_s": 0.008,
        "prefill_chunk_tokens": 64,
        "max_slots": 8,
        "weight_load_s": 0.002,
        "kv_move_s": 0.001,
        "train_step_s": 0.5,
        "kv_capacity_tokens": 1584,
    }
    path = tmp_path / "calibrate_cpu.json"
    path.write_text(json.dumps({"constants": consts}))
    cm = MeasuredCost.from_file(path)
    assert np.allclose(cm.decode_step_s(np.array([1, 8]), np.array([10, 900])), 0.001)
    assert float(cm.prefill_s(80, 0)) == 0.008 and float(cm.prefill_s(0, 0)) == 0.0
    assert float(cm.prefill_s(8 * 64 + 1, 0)) == 0.016  # a second call
    assert cm.train_step_s(np.array([100, 200]), 4) == 0.5 and cm.kv_capacity_tokens == 1584
    assert cm.weight_transfer_s() == 0.002 and cm.kv_transfer_s(10_000) == 0.001
    assert cm.weight_trip_s() == 0.0  # neither optional constant given: none
    # the host's seconds per engine call and the cross-process weight trip, when measured
    path2 = tmp_path / "cross_process.json"
    path2.write_text(
        json.dumps(
            {"constants": {**consts, "engine_call_overhead_s": 0.0004, "weight_trip_s": 0.05}}
        )
    )
    cm2 = MeasuredCost.from_file(path2)
    assert np.allclose(cm2.decode_step_s(np.array([1, 8]), np.array([10, 900])), 0.0044 / 4)
    assert float(cm2.prefill_s(8 * 64 + 1, 0)) == pytest.approx(2 * 0.0084)
    assert cm2.weight_trip_s() == 0.05 and cm2.weight_transfer_s() == 0.002
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(x) for x in (4, 8, 10, 12, 30, 160)) + "\n")
    from pathlib import Path

    cfg = load_sim_config(
        Path(__file__).resolve().parents[1] / "configs" / "sim" / "cpu_default_task.yaml",
        [f"calibration={path}", f"response.path={lens}", "run.steps=3", "run.warmup_steps=1"],
    )
    assert isinstance(cost_model(cfg), MeasuredCost)
    m = simulate(cfg, "dora").metrics
    assert m.steps == 2 and m.tokens_per_s > 0 and m.train_s == 0.5
