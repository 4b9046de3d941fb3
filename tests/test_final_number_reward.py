"""``data.reward: final_number``: the last number of a response against the reference, full
credit only for a response that ended on its own (an EOS, not the token limit)."""

import json
from pathlib import Path

import pytest

from dora_jax.config import ConfigError, load_config
from dora_jax.data.rewards import final_number, final_number_reward
from dora_jax.pipeline.experiment import build

ROOT = Path(__file__).resolve().parents[1]
EOS, CUT = {"finish_reason": "eos"}, {"finish_reason": "length"}


@pytest.mark.parametrize(
    "text, want",
    [
        ("13 + 14 = 27", "27"),
        ("13 + 10 = 13 + 10 = 23.", "23"),
        ("The answer is -4", "-4"),
        ("about 1,024 of them", "1024"),
        ("x = 2.50", "2.50"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_final_number(text, want):
    assert final_number(text) == want


def test_full_credit_needs_the_right_number_and_an_ending():
    assert final_number_reward("13 + 14 = 27", "27", EOS) == {
        "score": 1.0,
        "correct": 1.0,
        "ended": 1.0,
    }
    # right number, but the response ran into the token limit: no credit, counted as correct
    assert final_number_reward("13 + 14 = 27 and so", "27", CUT)["score"] == 0.0
    assert final_number_reward("27 and so 3", "27", EOS) == {
        "score": 0.0,
        "correct": 0.0,
        "ended": 1.0,
    }
    assert final_number_reward("2.5 + 0.5 = 3.0", "3", EOS)["score"] == 1.0  # numerically
    assert final_number_reward("nothing", "3", EOS)["score"] == 0.0


def test_configured_on_a_file_task_and_refused_on_the_built_in_one(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "what is 13 + 14?", "answer": "27"}) + "\n")
    small = [
        "warm_start.steps=0",
        "eval.num_prompts=0",
        "mesh.trainer.devices=0:1",
        "mesh.trainer.data=1",
        "mesh.trainer.model=1",
        "mesh.rollout.devices=1:2",
        "mesh.rollout.groups=1",
        "data.task=jsonl",
        f"data.path={rows}",
        "data.reward=final_number",
        f"run_dir={tmp_path / 'run'}",
    ]
    exp = build(load_config(ROOT / "configs" / "default.yaml", small), tmp_path / "run")
    assert exp.reward("13 + 14 = 27", "27", EOS) == 1.0
    assert exp.reward("13 + 14 = 27", "27", CUT) == 0.0
    assert exp.reward("13 + 14 = 25", "27", EOS) == 0.0 and exp.reward.errors == 0
    with pytest.raises(ConfigError, match=r"data\.reward.*'final_number' does not apply"):
        load_config(ROOT / "configs" / "default.yaml", ["data.reward=final_number"])
