"""The rollout benchmark's bookkeeping (``launch/bench_rollout.py``): its two workloads separate
scheduling from per-step speed, and a greedy mismatch with Hugging Face stops it."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "launch" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_uniform_control_has_the_same_prompts_and_tokens_and_no_scheduling_slack(bench):
    tail, uniform = bench.make_workloads(bench.MODELS["tiny"], 64, np.random.default_rng(0))
    assert np.percentile(tail.lengths, 99) / np.median(tail.lengths) >= 10
    assert uniform.prompts == tail.prompts and uniform.lengths.sum() == tail.lengths.sum()
    assert uniform.lengths.max() - uniform.lengths.min() <= 1
    # static batches waste steps only on the long tail
    slots = bench.SLOTS
    assert uniform.static_batch_steps(slots) == uniform.continuous_steps_lower_bound(slots)
    assert tail.static_batch_steps(slots) > 1.5 * tail.continuous_steps_lower_bound(slots)


def test_step_counts_by_hand(bench):
    wl = bench.Workload("w", [[3]] * 4, np.array([1, 9, 2, 2]))
    assert wl.static_batch_steps(2) == 9 + 2  # batches (1, 9) and (2, 2)
    assert wl.continuous_steps_lower_bound(2) == 9  # the longest request
    assert (
        bench.Workload("w", [[3]] * 4, np.array([4, 4, 4, 5])).continuous_steps_lower_bound(2) == 9
    )


def test_greedy_mismatch_stops_the_benchmark(bench):
    wl = bench.Workload("long_tail", [[3], [4]], np.array([3, 2]))
    ours = bench.Result(1.0, {0: [5, 6, 7], 1: [8, 9]}, 3)
    bench.check_greedy_equal(wl, ours, bench.Result(1.0, {0: [5, 6, 7], 1: [8, 9]}, 3))
    with pytest.raises(SystemExit, match="request 1 differs from HF generate at response token 1"):
        bench.check_greedy_equal(wl, ours, bench.Result(1.0, {0: [5, 6, 7], 1: [8, 0]}, 3))


def test_greedy_agreement_counts_leading_equal_tokens(bench):
    wl = bench.Workload("uniform", [[3], [4], [5]], np.array([3, 3, 3]))
    ours = bench.Result(1.0, {0: [5, 6, 7], 1: [8, 9, 1], 2: [2, 2, 2]}, 3)
    theirs = bench.Result(1.0, {0: [5, 6, 7], 1: [8, 0, 1], 2: [4, 2, 2]}, 3)
    agree = bench.greedy_agreement(wl, ours, theirs)
    assert agree["leading_tokens_equal"] == [3, 1, 0]
    assert agree["requests_equal"] == 1 and agree["first_token_equal"] == 2


def test_real_shape_is_qwen2_5_0_5b(bench):
    """494,032,768 parameters: Qwen2.5-0.5B's published count (tied embeddings)."""
    import jax

    from dora_jax.model.params import abstract_params

    leaves = jax.tree.leaves(abstract_params(bench.MODELS["qwen2.5-0.5b"]))
    assert sum(int(np.prod(x.shape)) for x in leaves) == 494_032_768
