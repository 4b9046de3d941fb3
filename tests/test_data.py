"""Prompt sources, the built-in task's long tail, rewards and bad data files."""

import json

import numpy as np
import pytest

from dora_jax.data import (
    ArithmeticTask,
    DataError,
    Scorer,
    boxed_math_reward,
    exact_reward,
    load_jsonl_prompts,
)
from dora_jax.data.prompts import PromptSource, shuffled_epochs
from dora_jax.model.tokenizer import CharTokenizer


def test_arithmetic_task_is_deterministic_long_tailed_and_tokenizable():
    task = ArithmeticTask(seed=3)
    assert task.problem(17) == ArithmeticTask(seed=3).problem(17)
    assert task.problem(17) != ArithmeticTask(seed=4).problem(17)
    lengths = np.array([len(task.solution(i)) + 1 for i in range(4000)])  # + EOS
    assert np.percentile(lengths, 99) / np.median(lengths) >= 10
    tok = CharTokenizer()
    for i in range(50):
        prompt, reference = task.problem(i)
        solution = task.solution(i)
        assert reference == solution
        tok.encode(prompt + solution)  # every character is in the alphabet
        assert task.reward(solution, reference) == 1.0
    assert ArithmeticTask.render(23, 5) == ("23-5=", "23,18,13,8,3#3", "3")
    ref = "23,18,13,8,3#3"
    assert task.reward("23,18,13,8,3#3", ref) == 1.0
    assert task.reward("23,18,12,7,2#2", ref) == 0.5 * 2 / 5  # two leading values right
    assert task.reward("23,18,13,8,3#4", ref) == 0.5  # the whole countdown, a wrong answer
    assert task.reward("9,4#4", ref) == 0.0 and task.reward("", ref) == 0.0


def test_answer_reward_checks_only_the_remainder():
    ref = "23,18,13,8,3#3"
    assert ArithmeticTask.answer_reward("23,18,13,8,3#3", ref) == 1.0
    assert ArithmeticTask.answer_reward("#3", ref) == 1.0  # a bare answer counts if right
    assert ArithmeticTask.answer_reward("23,18,12,7,2#2", ref) == 0.0
    assert ArithmeticTask.answer_reward("23,18,13,8,3", ref) == 0.0  # no answer given
    assert (
        ArithmeticTask.answer_reward("#33", ref) == 0.0
        and ArithmeticTask.answer_reward("", ref) == 0.0
    )


def test_teacher_demonstrations_mix_bare_answers_at_the_asked_rate():
    task = ArithmeticTask(seed=3)
    for frac in (0.0, 0.3, 1.0):
        demos = [task.demonstration(i, frac) for i in range(2000)]
        bare = [resp.startswith("#") for _, resp in demos]
        assert abs(np.mean(bare) - frac) < 0.04
        for i, (prompt, resp) in enumerate(demos):
            assert prompt == task.problem(i)[0]
            assert ArithmeticTask.answer_reward(resp, task.solution(i)) == 1.0  # always right
            assert resp == (
                f"#{task.solution(i).rpartition('#')[2]}" if bare[i] else task.solution(i)
            )
    assert task.demonstration(5, 0.5) == ArithmeticTask(seed=3).demonstration(5, 0.5)


def test_prompt_source_resumes_exactly():
    src = ArithmeticTask(seed=1).source()
    first = src.take(5)
    state = src.state()
    more = src.take(3)
    again = ArithmeticTask(seed=1).source()
    again.restore(state)
    assert again.take(3) == more and [p.index for p in first] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="prompt source mismatch"):
        ArithmeticTask(seed=2).source().restore(state)


def test_shuffled_epochs_cover_everything_once_per_epoch():
    items = [(str(i), str(i)) for i in range(7)]
    src = PromptSource(shuffled_epochs(items, seed=0), "list")
    epoch1 = sorted(p.text for p in src.take(7))
    epoch2 = [p.text for p in src.take(7)]
    assert epoch1 == sorted(t for t, _ in items) and sorted(epoch2) == epoch1


def test_rewards():
    assert exact_reward(" 42\n", "42") == 1.0 and exact_reward("41", "42") == 0.0
    assert boxed_math_reward("so \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert boxed_math_reward("\\boxed{1} then \\boxed{2}", "2") == 1.0
    assert boxed_math_reward("\\boxed{x^{2}+1}", "\\boxed{x^{2}+1}") == 1.0
    assert boxed_math_reward("\\boxed{3}", "4") == 0.0
    assert boxed_math_reward("no box: 4", "4") == 0.0
    assert boxed_math_reward("\\boxed{1,000}", "1000") == 1.0


def test_scorer_counts_errors_by_kind_and_returns_zero():
    def bad(response, answer):
        if response == "boom":
            raise RuntimeError("broken reward")
        return float("nan") if response == "nan" else 1.0

    r = Scorer(bad)
    assert r("ok", "x") == 1.0
    assert r("boom", "x") == 0.0 and r("nan", "x") == 0.0
    assert r.errors == 2
    assert r.error_counts() == {"timeout": 0, "exception": 1, "invalid": 1, "crash": 0}


def test_jsonl_errors_name_the_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1?", "answer": 2}\n\n{"prompt": "2+2?", "answer": "4"}\n')
    assert load_jsonl_prompts(good) == [("1+1?", "2"), ("2+2?", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: missing field 'answer'"):
        load_jsonl_prompts(bad)
    bad.write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        load_jsonl_prompts(bad)
    bad.write_text(json.dumps({"question": "a", "solution": "b"}) + "\n")
    assert load_jsonl_prompts(bad, "question", "solution") == [("a", "b")]
    with pytest.raises(DataError, match="no such file"):
        load_jsonl_prompts(tmp_path / "missing.jsonl")
