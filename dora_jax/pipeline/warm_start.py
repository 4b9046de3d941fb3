"""Supervised warm start: teacher-forced cross-entropy on the task's worked solutions.

The result is cached as a Hugging Face directory in ``run_dir/warm_start`` together with the
settings that made it; a later run with the same settings loads it instead of training again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dora_jax import faults
from dora_jax.config import ModelConfig, WarmStartConfig
from dora_jax.model import forward
from dora_jax.model.hf_checkpoint import load_hf_params, save_hf_checkpoint
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import Tokenizer, encode_prompt
from dora_jax.model.transformer import default_positions
from dora_jax.run_dir import pid_alive


@dataclass(frozen=True)
class Demonstration:
    """A worked example already as tokens (a multi-turn episode: model and environment turns):
    ``train[i]`` says whether token ``i`` is one the policy should learn to produce."""

    ids: tuple[int, ...]
    train: tuple[bool, ...]


# index -> (prompt, worked solution) or a Demonstration
Example = Callable[[int], tuple[str, str] | Demonstration]


def make_batch(
    example: Example, tokenizer: Tokenizer, start: int, cfg: WarmStartConfig
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
    """Packs worked examples ``start, start + 1, ...`` into ``batch_size`` rows of ``seq_len``
    tokens until the next one does not fit; returns ``((tokens, segment_ids, loss_mask), next)``.
    ``tokens, segment_ids`` are int32[B, T] (segments count from 1 within a row, 0 is padding);
    ``loss_mask`` float32[B, T] marks the positions that predict a response token or the final
    EOS. An example longer than a row is cut to ``seq_len``. Packing keeps the shape fixed (one
    compile) while most of the heavy-tailed examples are short, so a step costs a fraction of
    padding every example to the longest."""
    B, T = cfg.batch_size, cfg.seq_len
    tokens = np.zeros((B, T), np.int32)
    seg = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    row, col, index = 0, 0, start
    while row < B:
        demo = example(index)
        if isinstance(demo, Demonstration):
            seq, train = list(demo.ids)[:T], list(demo.train)[:T]
        else:
            prompt, solution = demo
            p = encode_prompt(tokenizer, prompt)
            seq = (p + tokenizer.encode(solution) + [tokenizer.eos_id])[:T]
            train = [False] * len(p) + [True] * (len(seq) - len(p))
        if col and col + len(seq) > T:  # a cut example always fits an empty row
            row, col = row + 1, 0
            continue
        n = int(seg[row, col - 1]) + 1 if col else 1
        tokens[row, col : col + len(seq)] = seq
        seg[row, col : col + len(seq)] = n
        mask[row, col : col + len(seq) - 1] = np.asarray(train[1:], np.float32)  # predicts i + 1
        col += len(seq)
        index += 1
    return (tokens, seg, mask), index


def _loss(params: Params, tokens, seg, mask, cfg: ModelConfig):
    logits = forward(params, tokens, default_positions(seg), seg, cfg)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, :-1]
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def warm_start(
    params: Params,
    model_cfg: ModelConfig,
    cfg: WarmStartConfig,
    example: Example,
    tokenizer: Tokenizer,
    *,
    cache_dir: Path | None = None,
    cache_key: str = "",
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Params, list[float]]:
    """``cfg.steps`` AdamW steps from ``params``; returns ``(params, losses)``. With
    ``cache_dir``, reuses a previous result made with the same settings (losses then empty)."""
    settings = {"warm_start": cfg.__dict__, "key": cache_key}
    if cache_dir is not None and (cache_dir / "settings.json").is_file():
        if json.loads((cache_dir / "settings.json").read_text()) == settings:
            return load_hf_params(cache_dir, model_cfg), []
    opt = optax.adamw(cfg.lr, weight_decay=0.0)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, seg, mask):
        loss, grads = jax.value_and_grad(_loss)(params, tokens, seg, mask, model_cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    index = 0
    for i in range(cfg.steps):
        batch, index = make_batch(example, tokenizer, index, cfg)
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
        faults.point("warm_start")
        if on_step is not None:
            on_step(i, losses[-1])
    if cache_dir is not None and cfg.steps:  # written aside, then renamed: never half a cache
        for left in cache_dir.parent.glob(f".{cache_dir.name}.tmp-*"):
            if not pid_alive(left.name.rsplit("-", 1)[-1]):  # left by a killed run
                shutil.rmtree(left, ignore_errors=True)
        tmp = cache_dir.with_name(f".{cache_dir.name}.tmp-{os.getpid()}")
        save_hf_checkpoint(params, model_cfg, tmp)
        (tmp / "settings.json").write_text(json.dumps(settings))
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    return params, losses
