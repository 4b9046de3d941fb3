"""Simulated workloads: the distributions have the configured shape and are order-free."""

import numpy as np
import pytest

from dora_jax.sim.config import PromptConfig, ResponseConfig
from dora_jax.sim.workload import ResponseLengths, SimPrompts, load_lengths, workload_stats


def test_lognormal_median_p99_and_cap():
    cfg = ResponseConfig(median=1000, p99_ratio=10, max_tokens=1_000_000, prompt_corr=0.5)
    x = ResponseLengths(cfg, 16, seed=1).sample(4000).ravel()
    assert abs(np.median(x) / 1000 - 1) < 0.03
    assert abs(np.percentile(x, 99) / np.median(x) / 10 - 1) < 0.1
    capped = ResponseLengths(ResponseConfig(median=1000, p99_ratio=10, max_tokens=5000), 16)
    y = capped.sample(500)
    assert y.max() == 5000 and y.min() >= 1


def test_lengths_are_a_pure_function_of_the_ids():
    cfg = ResponseConfig(median=50, p99_ratio=8, max_tokens=2000)
    a, b = ResponseLengths(cfg, 4, seed=3), ResponseLengths(cfg, 4, seed=3)
    pg = np.array([5, 900, 3, 5, 70_000])
    j = np.array([0, 3, 1, 2, 0])
    first = a.lengths(pg, j)
    b.lengths(np.array([70_000]), np.array([0]))  # touch blocks in another order
    assert np.array_equal(first, b.lengths(pg, j))
    assert np.array_equal(first[[2, 0]], a.lengths(pg[[2, 0]], j[[2, 0]]))
    c = ResponseLengths(cfg, 4, seed=4)
    assert not np.array_equal(a.sample(64), c.sample(64))


def test_prompt_correlation_is_the_difficulty_share():
    for corr in (0.0, 0.6):
        cfg = ResponseConfig(median=500, p99_ratio=10, max_tokens=10**7, prompt_corr=corr)
        logx = np.log(ResponseLengths(cfg, 2, seed=0).sample(20_000))
        r = np.corrcoef(logx[:, 0], logx[:, 1])[0, 1]
        assert abs(r - corr) < 0.03


def test_mixture_and_file(tmp_path):
    body = ResponseConfig(median=500, p99_ratio=4, max_tokens=50_000)
    mix = ResponseConfig(
        kind="mixture",
        median=500,
        p99_ratio=4,
        max_tokens=50_000,
        tail_weight=0.05,
        tail_median=20_000,
        tail_p99_ratio=2,
    )
    a = ResponseLengths(body, 8).sample(2000).ravel()
    b = ResponseLengths(mix, 8).sample(2000).ravel()
    assert np.percentile(b, 99) > 5 * np.percentile(a, 99)
    assert abs(np.mean(b > 5000) - 0.05) < 0.01
    f = tmp_path / "lengths.txt"
    f.write_text("# measured\n100\n200\n\n300\n400\n")
    emp = ResponseLengths(ResponseConfig(kind="file", path=str(f), max_tokens=350), 4)
    x = emp.sample(3000).ravel()
    assert x.min() >= 100 and x.max() == 350  # quantiles of the data, capped
    assert abs(np.median(x) - 250) <= 15
    f.write_text("12\nabc\n")
    with pytest.raises(ValueError, match="lengths.txt:2: expected a token count"):
        load_lengths(f)
    with pytest.raises(FileNotFoundError):
        load_lengths(tmp_path / "missing.txt")


def test_prompts_and_stats():
    cfg = PromptConfig(median=200, p99_ratio=3, min_tokens=16, max_tokens=400)
    first = SimPrompts(cfg, seed=2)
    a = [first.next_prompt().prompt_len for _ in range(3)]
    p = SimPrompts(cfg, seed=2)
    b = [p.next_prompt().prompt_len for _ in range(5000)]
    assert a == b[:3] and 16 <= min(b) and max(b) == 400
    assert abs(np.median(b) / 200 - 1) < 0.05
    flat = ResponseLengths(ResponseConfig(median=100, p99_ratio=1, max_tokens=1000), 4)
    st = workload_stats(flat, batch_prompts=8)
    assert st["sync_inter_node_bubble"] == 0.0 and st["median"] == 100
    tail = workload_stats(ResponseLengths(ResponseConfig(), 16), batch_prompts=512, batches=2)
    assert 0.8 < tail["sync_inter_node_bubble"] < 0.95  # the paper's appendix C.3: 75-89%
