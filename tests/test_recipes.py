"""The ``configs/recipes/`` presets load, and read the user's files the way their comments say."""

from pathlib import Path

import pytest

from dora_jax.config import load_config

RECIPES = sorted((Path(__file__).resolve().parents[1] / "configs" / "recipes").glob("*.yaml"))


def test_there_are_gsm8k_and_math_recipes_for_both_sizes():
    names = {p.stem for p in RECIPES}
    assert {f"{t}-qwen2.5-{s}" for t in ("gsm8k", "math") for s in ("0.5b", "1.5b")} <= names


@pytest.mark.parametrize("path", [p for p in RECIPES if "qwen2.5" in p.stem], ids=lambda p: p.stem)
def test_recipe_loads(path):
    cfg = load_config(path)
    d = cfg.data
    assert d.reward == "boxed_math" and d.tokenizer == "hf" and cfg.model.hf_path
    assert cfg.eval.path and cfg.eval.num_prompts > 0
    if path.stem.startswith("gsm8k"):
        assert (d.task, d.prompt_field, d.answer_field) == ("jsonl", "question", "answer")
        assert "\\boxed{}" in d.prompt_template and "{prompt}" in d.prompt_template
    else:
        assert (d.task, d.answer_field) == ("parquet", "reward_model.ground_truth")
        assert cfg.eval.samples_per_prompt == 4
    size = path.stem.rsplit("-", 1)[1]
    assert cfg.model.hf_path.endswith(f"Qwen2.5-{size.upper()}-Instruct")


def test_the_agentic_recipe_is_a_built_in_environment_on_the_cpu():
    cfg = load_config(RECIPES[0].with_name("tool-arithmetic-cpu.yaml"))
    assert cfg.env.spec == "tool_arithmetic" and cfg.data.tokenizer == "char"
    assert cfg.model.hf_path is None and cfg.eval.num_prompts > 0
    # a conversation of the longest problem fits: the prompt, 10 calls and the answer
    assert cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens == cfg.train.length_buckets[-1]


def test_the_real_model_recipe_on_cpu():
    """The SmolLM2 recipe: the prepared model's directory, its chat template through the HF
    tokenizer, the final_number reward, and held-out sums no training row asks."""
    import json

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "recipes" / "smollm2-add-cpu.yaml")
    d = cfg.data
    assert cfg.model.hf_path == "models/smollm2-135m-instruct"
    assert (d.task, d.tokenizer, d.reward) == ("jsonl", "hf", "final_number")
    assert cfg.orchestrator.mode == "dora" and cfg.orchestrator.clock == "logical"
    read = lambda p: [json.loads(s) for s in (root / p).read_text().splitlines()]  # noqa: E731
    train, held = read(d.path), read(cfg.eval.path)
    assert len(held) == cfg.eval.num_prompts == 200
    pairs = lambda rows: {(r["a"], r["b"]) for r in rows}  # noqa: E731
    assert not pairs(train) & pairs(held)
    assert all(int(r["answer"]) == r["a"] + r["b"] for r in train + held)
