"""The real-data path end to end: a Hugging Face checkpoint (tiny, random, built offline), its
tokenizer.json with a chat template, JSONL prompts and the boxed-math reward, one GRPO step."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import transformers
from hf_tokenizer_files import write_word_tokenizer  # tests/hf_tokenizer_files.py

from dora_jax.config import EvalConfig, load_config
from dora_jax.pipeline.experiment import build, run
from dora_jax.pipeline.inputs import eval_problems

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hf_dir(tmp_path):
    words = [
        "what",
        "is",
        "7",
        "times",
        "8",
        "?",
        "put",
        "the",
        "final",
        "answer",
        "in",
        "\\",
        "boxed",
        "{",
        "}",
        ".",
        "user",
        "assistant",
        "56",
        "2",
    ]
    write_word_tokenizer(tmp_path, words)
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.slow  # long: the default run stays under its time limit
def test_hf_checkpoint_jsonl_prompts_boxed_reward(hf_dir, tmp_path):
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [
            f"model.hf_path={hf_dir}",
            "data.tokenizer=hf",
            "data.task=jsonl",
            f"data.path={ROOT / 'configs' / 'examples' / 'math.jsonl'}",
            "data.reward=boxed_math",
            "rollout.max_prompt_len=64",
            "rollout.max_new_tokens=16",
            "train.group_size=4",
            "orchestrator.train_batch_prompts=2",
            "orchestrator.rollout_batch_prompts=4",
            "train.length_buckets=[96]",
            f"run_dir={tmp_path / 'run'}",
            f"eval.path={ROOT / 'configs' / 'examples' / 'math.jsonl'}",
            "eval.num_prompts=2",
        ],
    )
    exp = build(cfg, tmp_path / "run")
    # the configured reward is boxed_math: the last \\boxed{} counts, a bare answer does not
    # (the exact-match reward would give 0 and 1 here)
    assert exp.reward("7 times 8 is \\boxed{54}, no: \\boxed{56}", "56") == 1.0
    assert exp.reward("56", "56") == 0.0
    assert exp.reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    # a JSONL run evaluates on eval.path (its first num_prompts lines), and skips without it
    assert len(exp.evaluator.prompts) == 2 and exp.evaluate(0).step == 0
    assert eval_problems(dataclasses.replace(cfg, eval=EvalConfig())) == []
    assert exp.cfg.model.vocab_size == 32 and exp.cfg.model.hidden_size == 32  # from config.json
    logs = []
    run(exp, 1, logs.append)
    assert exp.runtime.steps_done == 1 and len(logs[0].rewards) == 2 * 4
    assert all(r in (0.0, 1.0) for r in logs[0].rewards)
    assert np.isfinite(float(logs[0].metrics["loss"]))
    assert exp.reward.errors == 0
