"""``boxed_math`` on math-verify: a table of answers users write, each with the truth value we
expect, checked against math-verify itself and through our reward; and the fallback to our own
normaliser where math-verify is missing (said once, on start)."""

import pytest
from math_verify import parse, verify

from dora_jax.data import math_answers
from dora_jax.data.math_answers import boxed_math_reward

# (the model's boxed answer, the reference, equivalent?)
TABLE = [
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac12", "0.5", True),
    (r"\dfrac12", r"\frac{1}{2}", True),
    ("1/2", "0.5", True),
    ("1,000", "1000", True),
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}", True),
    (r"3\sqrt{2}", r"\sqrt{18}", True),
    ("[1, 3)", "[1,3)", True),
    (r"(0,\infty)", r"(0, \infty)", True),
    (r"\{1,2,3\}", r"\{3,2,1\}", True),
    ("2, 3", r"\{2,3\}", True),
    ("x=3", "3", True),
    (r"5\text{ cm}", "5", True),
    (r"10 \text{ dollars}", "10", True),
    ("x^2+2x+1", "(x+1)^2", True),
    (r"50\%", "0.5", True),
    # wrong answers: must score 0
    ("3", "4", False),
    (r"\frac{1}{3}", "0.5", False),
    ("[1,3]", "[1,3)", False),
    (r"\{1,2\}", r"\{1,2,3\}", False),
    ("x=4", "3", False),
    (r"\sqrt{3}", r"\sqrt{2}", False),
    ("1000", "100", False),
    ("-2", "2", False),
    (r"2\pi", r"\pi", False),
    ("0.333", r"\frac{1}{3}", False),
]


def test_the_table_is_large_and_has_both_kinds():
    assert len(TABLE) >= 20
    assert sum(t for *_, t in TABLE) >= 10 and sum(not t for *_, t in TABLE) >= 8


@pytest.mark.parametrize("got,want,truth", TABLE)
def test_math_verify_itself_agrees_with_the_table(got, want, truth):
    gold = parse(f"${want}$", parsing_timeout=None)
    pred = parse(f"${got}$", parsing_timeout=None)
    assert verify(gold, pred, timeout_seconds=None) is truth


@pytest.mark.parametrize("got,want,truth", TABLE)
def test_boxed_math_reward_follows_the_table(got, want, truth):
    response = f"Let me think. First \\boxed{{7}} was a guess; the answer is \\boxed{{{got}}}."
    assert boxed_math_reward(response, want) == float(truth)
    assert boxed_math_reward(response, f"\\boxed{{{want}}}") == float(truth)


def test_no_box_scores_zero():
    assert boxed_math_reward("the answer is 0.5", "0.5") == 0.0


def test_without_math_verify_our_normaliser_is_used_and_said_once(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(math_answers, "MATH_VERIFY", False)
    assert boxed_math_reward(r"\boxed{\frac{1}{2}}", "0.5") == 1.0  # the normaliser can
    assert boxed_math_reward(r"\boxed{1,000}", "1000") == 1.0
    # what only math-verify can: symbolic equivalence
    assert boxed_math_reward(r"\boxed{\sqrt{2}/2}", r"\frac{1}{\sqrt{2}}") == 0.0
    from dora_jax.config import load_config
    from dora_jax.pipeline import inputs

    monkeypatch.setattr(inputs, "MATH_VERIFY", False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg = load_config(None, ["data.task=jsonl", f"data.path={rows}", "data.reward=boxed_math"])
    train, _ = inputs.scorers(cfg, None, lambda: 0.0)
    train.close()
    out = capsys.readouterr().out
    assert out.count("math-verify is not installed") == 1
