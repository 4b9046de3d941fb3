"""The train-step benchmark's pure parts (``benchmarks/bench_train_step.py``, and
``benchmarks/train_step_real.py`` for SmolLM2's case): the model-FLOP count against a hand count,
the packed segments it is counted over, the trajectories' rewards and lengths, the arguments."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from dora_jax.config import ModelConfig, TrainConfig
from dora_jax.train.batch import Trajectory, pack_batch

ROOT = Path(__file__).resolve().parents[1]

# V 10, D 4, F 6, L 2, 2 query heads and 1 KV head of dim 2
TINY = ModelConfig(
    family="llama",
    vocab_size=10,
    hidden_size=4,
    intermediate_size=6,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
)


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_train_step", ROOT / "benchmarks" / "bench_train_step.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    import train_step_real

    yield mod, train_step_real
    del sys.modules[spec.name], sys.modules["train_step_real"]
    sys.path.remove(str(ROOT / "benchmarks"))


def test_non_embedding_params_by_hand(bench):
    _, real = bench
    # a layer: norms 4 + 4, wq 4x2x2 = 16, wk 4x1x2 = 8, wv 8, wo 2x2x4 = 16, MLP 3 x 4x6 = 72
    assert real.non_embedding_params(TINY) == 2 * 128 + 4  # + the final norm
    untied = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": False})
    assert real.non_embedding_params(untied) == 260  # the LM head is not in N either
    biased = ModelConfig(**{**TINY.__dict__, "attention_bias": True})
    assert real.non_embedding_params(biased) == 260 + 2 * (4 + 2 + 2)  # bq, bk, bv
    with pytest.raises(ValueError, match="dense models"):
        real.non_embedding_params(ModelConfig(family="qwen3_moe"))


def test_train_flops_by_hand(bench):
    _, real = bench
    f = real.train_flops(TINY, [3, 1])
    assert f["tokens"] == 4
    assert f["dense"] == 6 * 260 * 4
    assert f["lm_head"] == 6 * 10 * 4 * 4  # once, though the embedding matrix is tied
    # segment of 3: queries score 1, 2, 3 keys (and sum as many values), of 1: 1 key; a score
    # or value is 2 FLOPs x (2 heads x dim 2) = 8, a forward over both layers 2 x 2 x 8 = 32 per
    # key, the backward twice the forward
    keys = (1 + 2 + 3) + 1
    assert f["attention"] == 3 * 32 * keys == 672
    assert f["total"] == 6240 + 960 + 672
    assert real.train_flops(TINY, [4])["attention"] == 3 * 32 * (1 + 2 + 3 + 4)


def test_attended_keys_by_hand(bench):
    _, real = bench
    from dora_jax.model.attention import ROOT_SPAN

    # a shared prompt of 2 (root 1), members of 2 and 1 after it, an unshared segment of 3
    seg = np.array([[1, 1, 1 + ROOT_SPAN, 1 + ROOT_SPAN, 1 + 2 * ROOT_SPAN, 2, 2, 2, 0]])
    # prefix: 1 + 2; member 1: (2 + 1) + (2 + 2); member 2: 2 + 1; the unshared one: 1 + 2 + 3
    assert real.attended_keys(seg) == 3 + 7 + 3 + 6
    assert real.attended_keys(np.array([[1, 1, 1, 2, 0]])) == 6 + 1  # as train_flops' default


def test_executed_flops_by_hand(bench):
    _, real = bench
    # 2 rows of 4 positions: 8 x (6 x 260 + 8 x 10 x 4) + the whole 4 x 4 scores of each row
    # (2 matmuls x 2 FLOPs x 16 x 4 wide x 2 layers x 3 for forward and backward)
    assert real.executed_flops(TINY, 2, 4) == 8 * (1560 + 320) + 2 * (2 * 2 * 16 * 4 * 2 * 3)


def test_segment_lengths_of_a_packed_batch(bench):
    _, real = bench
    lengths = [(3, 5), (2, 1), (4, 6), (1, 2)]  # (prompt, response)
    trajs = [
        Trajectory(list(range(1, p + 1)), [1] * r, [-0.5] * r, float(i % 2), 0, "g")
        for i, (p, r) in enumerate(lengths)
    ]
    cfg = TrainConfig(group_size=4, length_buckets=(16,), packing="tokens", microbatch_tokens=32)
    batch = pack_batch(trajs, cfg, trainer_version=0)
    assert sorted(real.segment_lengths(batch.segment_ids)) == [3, 3, 8, 10]
    assert real.segment_lengths(np.array([[1, 1, 2, 0], [0, 0, 0, 0]])) == [2, 1]


def test_trajectories_vary_rewards_within_groups_and_keep_lengths(bench):
    _, real = bench
    prompts = [[5] * 35, [6] * 36]
    out = real.batches(prompts, vocab=100, G=8, n_batches=20, cap=64, seed=0)
    assert len(out) == 20 and all(len(b) == 16 for b in out)
    for b in out:
        for g in range(2):
            group = b[8 * g : 8 * g + 8]
            assert 0 < sum(t.reward for t in group) < 8  # nonzero advantages
            assert all(list(t.prompt_tokens) == prompts[g] for t in group)
    lens = np.array([len(t.response_tokens) for b in out for t in b])
    assert lens.min() >= 10 and lens.max() == 64 and 25 <= np.median(lens) <= 35
    again = real.batches(prompts, vocab=100, G=8, n_batches=20, cap=64, seed=0)
    assert [len(t.response_tokens) for t in again[3]] == [len(t.response_tokens) for t in out[3]]


def test_arguments(bench):
    mod, real = bench
    a = mod.parse_args([])
    assert a.case == "synthetic" and a.out == mod.RESULTS and a.model_dir is None
    a = mod.parse_args(["--model", "smollm2-135m-instruct"])
    assert a.case == "smollm2" and a.out == real.RESULTS
    assert a.model_dir == ROOT / "models" / "smollm2-135m-instruct"
    a = mod.parse_args(["--case", "smollm2", "--model-dir", "elsewhere", "--out", "x.json"])
    assert a.model_dir == Path("elsewhere") and a.out == Path("x.json")
    bad_args = (
        ["--model-dir", "d"],
        ["--case", "synthetic", "--model", "smollm2-135m-instruct"],
        ["--case", "smollm2", "--smollm2-steps", "0"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def test_missing_model_dir_names_the_prepare_command(bench, tmp_path, capsys):
    mod, _ = bench
    with pytest.raises(SystemExit) as e:  # before waiting for a quiet machine or loading jax
        mod.main(["--case", "smollm2", "--model-dir", str(tmp_path / "none"), "--wait", "0"])
    msg = str(e.value)
    assert "`python launch/prepare_model.py smollm2-135m-instruct`" in msg
    assert str(tmp_path / "none") in msg and "\n" not in msg
