"""The rollout benchmark's bookkeeping (``launch/bench_rollout.py``, and
``launch/bench_rollout_real.py`` for a real model's weights): its two workloads separate
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


@pytest.fixture(scope="module")
def real(bench):
    sys.path.insert(0, str(ROOT / "launch"))  # bench_rollout.main imports it from there
    import bench_rollout_real

    yield bench_rollout_real
    sys.path.remove(str(ROOT / "launch"))
    del sys.modules["bench_rollout_real"]


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


SMOL = "smollm2-135m-instruct"


def test_real_model_arguments(bench):
    args = bench.parse_args(["--model", SMOL])
    assert args.model_dir == Path("models/smollm2-135m-instruct")
    assert (args.requests, args.tokens, args.rounds) == bench.REAL_DEFAULTS[SMOL]
    args = bench.parse_args(["--model", SMOL, "--quick", "--tokens", "3", "--model-dir", "d"])
    assert (args.requests, args.tokens, args.rounds) == (bench.QUICK_DEFAULTS[SMOL][0], 3, 1)
    assert args.model_dir == Path("d")
    assert bench.parse_args(["--model", "qwen2.5-0.5b", "--quick"]).requests == 8
    assert bench.parse_args([]).model_dir is None
    for bad in (["--model-dir", "d"], ["--model", SMOL, "--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2


def test_missing_model_directory_names_the_command_that_makes_it(bench, real, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # a directory without config.json
    for d in (tmp_path / "absent", tmp_path):
        with pytest.raises(SystemExit, match=f"python launch/prepare_model.py {SMOL}`") as e:
            bench.main(["--model", SMOL, "--model-dir", str(d), "--wait", "0"])
        assert str(d) in str(e.value) and "\n" not in str(e.value)


class ChatTokenizer:
    """A stand-in: a chat template that marks the turns, one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]


def test_real_workloads_are_chat_templated_questions_with_a_long_tail(real):
    from dora_jax.data.word_arithmetic import problems

    tail, uniform = real.make_workloads(ChatTokenizer(), 32, median=4)
    texts = ["".join(map(chr, p)) for p in tail.prompts]
    assert texts == [f"<user>{r['prompt']}<assistant>" for r in problems("+", 10, 99, 32, 0)]
    assert texts[0].startswith("<user>What is ") and len(set(texts)) == 32
    assert uniform.prompts == tail.prompts and uniform.lengths.sum() == tail.lengths.sum()
    assert uniform.lengths.max() - uniform.lengths.min() <= 1
    assert np.median(tail.lengths) == 4 and tail.lengths.max() <= 64
    assert np.percentile(tail.lengths, 99) / np.median(tail.lengths) >= 10
    small, _ = real.make_workloads(ChatTokenizer(), 4, median=2)  # too few for the shape: allowed
    assert len(small.prompts) == 4 and small.prompts == tail.prompts[:4]


def test_eos_positions_in_responses(bench, real):
    wl = bench.Workload("w", [[3], [4], [5]], np.array([4, 4, 4]))
    res = bench.Result(1.0, {0: [5, 2, 6, 2], 1: [7, 7, 7, 9], 2: [2, 1, 1, 1]}, 4)
    eos = real.eos_in_responses(wl, res, (2, 9))
    assert eos == {"eos_ids": [2, 9], "requests_with_eos": 3, "first_eos_position_median": 1.0}
