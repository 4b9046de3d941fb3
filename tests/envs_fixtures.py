"""Helpers of the environment tests: an episode played in-process (the pool's checks without a
worker), a conversation driven by a scripted policy, and a small byte-level BPE tokenizer with a
Qwen-style chat template, trained offline."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dora_jax.envs.protocol import EnvOutcome, check_reset, check_step

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "find 3 numbers in 1..16: 8? lower higher correct not a number",
    "<call>23-5</call> 18 13 8 3 #3 error",
    "user assistant tool system <think> </think> hello",
]


def local_reset(env, seed: int, task: dict) -> EnvOutcome:
    t0 = time.monotonic()
    step = check_reset(env.reset(seed, task))
    return EnvOutcome(step, seconds=time.monotonic() - t0)


def local_step(env, action: str) -> EnvOutcome:
    t0 = time.monotonic()
    step = check_step(env.step(action))
    return EnvOutcome(step, seconds=time.monotonic() - t0)


def play(env, seed: int, index: int, actions: list[str]) -> list:
    """The checked results of reset and then each action, stopping at the episode's end."""
    out = [local_reset(env, seed, {"index": index}).step]
    for a in actions:
        out.append(local_step(env, a).step)
        if out[-1].terminated or out[-1].truncated:
            break
    return out


def write_bpe_tokenizer(directory: Path, template: str = QWEN_STYLE) -> Path:
    """``tokenizer.json`` (byte-level BPE, 300 ids, trained on ``CORPUS``) and
    ``tokenizer_config.json`` with ``template``; EOS ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tk.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": template,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
