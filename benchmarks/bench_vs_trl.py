"""TRL's ``GRPOTrainer`` and dora_jax (``sync`` and ``dora`` modes) side by side: the same model,
task, GRPO settings and number of samples, one after the other on this machine's CPU.

1. TRL (``pip install 'dora-jax[bench]'``): ``trl.GRPOTrainer`` on the CPU, twice: in float32
   (part ``trl``) and with ``bf16=True`` (``trl_bf16``: torch's bfloat16 autocast over float32
   weights, the faster of the two on a CPU with bfloat16 dot-product instructions), the
   model loaded from the recipe's ``model.hf_path`` with transformers, its own generation (no
   vLLM), every setting taken from the dora_jax recipe (:func:`trl_settings`): ``G`` samples per
   prompt, ``orchestrator.train_batch_prompts x G`` new completions and one optimizer step per
   generation batch (on-policy, like ``sync``), the recipe's learning rate schedule, Adam, clipping
   and loss aggregation, no KL. The prompts are the first ``TBS x steps`` of the stream a dora_jax
   run trains on, in its order, as chat messages; the reward is dora_jax's own
   ``final_number_reward``, ``finish_reason`` "eos" when the completion ends with an EOS token.
   The final model is saved as a Hugging Face directory. The ratios are against each TRL run and
   against the faster one.
2. dora_jax: ``launch/train.py --config RECIPE train.total_steps=N eval.every_steps=N`` in
   ``sync`` and in ``dora`` mode (subprocesses; the recipe's clock and other settings as they are).
3. The held-out score after the same samples, measured the same way: dora_jax's evaluator
   (``eval.num_prompts`` problems of ``eval.path``, one sample each at the rollout temperature,
   the run's sampling keys) on TRL's final model and on the base model; dora_jax's own figures
   come from each run's ``eval.jsonl`` (step 0 is the base model; step N the trained one).

Seconds per optimizer step: TRL's from a ``TrainerCallback`` (one ``on_step_end`` to the next,
the first from ``on_train_begin``); dora_jax's from ``metrics.jsonl``'s ``elapsed_s`` (the same
interval, held-out evaluations subtracted). The training part is ``trainer.train()`` for TRL and
the run loop for dora_jax (model loading, setup and evaluations excluded, jit compilation
included). Writes ``benchmarks/results/bench_vs_trl.json`` and prints a table.

    python benchmarks/bench_vs_trl.py --config configs/recipes/smollm2-add-cpu.yaml --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from quiet import add_arguments, provenance, rel, wait_for_quiet  # noqa: E402

from dora_jax.config import ExperimentConfig, load_config  # noqa: E402
from dora_jax.data.rewards import final_number_reward  # noqa: E402
from dora_jax.metrics import binomial_se  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "recipes" / "smollm2-add-cpu.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_vs_trl.json"
PARTS = ("trl", "trl_bf16", "sync", "dora")
TRL_PARTS = {"trl": "float32", "trl_bf16": "bfloat16"}  # TRL's dtype: its model in float32, and
# with bf16=True its forward and backward under torch's bfloat16 autocast (float32 master weights)

# dora_jax's train.loss_agg -> TRL's loss_type, and how the two normalise the summed token losses
LOSS_TYPES = {
    "token_mean": (
        "dapo",
        "the same: the token losses of the whole generation batch summed and divided by its "
        "number of completion tokens (dora_jax token_mean)",
    ),
    "seq_mean_token_mean": (
        "grpo",
        "the same: the mean over each completion's tokens, then the mean over completions",
    ),
    "seq_mean_token_sum_norm": (
        "dr_grpo",
        "each completion's token sum divided by a constant: TRL's is max_completion_length, "
        "dora_jax's train.resolved_loss_norm_len",
    ),
}


def overrides(steps: int, extra: Sequence[str] = ()) -> list[str]:
    """The recipe overrides every system runs with: ``extra`` (``--set``), then ``steps``
    optimizer steps and held-out evaluations at step 0 and ``steps`` only."""
    return [*extra, f"train.total_steps={steps}", f"eval.every_steps={steps}"]


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Samples per second of each dora_jax mode over each TRL run's (float32: ``TRL``,
    bfloat16: ``TRL bfloat16``) and, when both ran, over the faster of the two (``TRL fastest``)."""
    bases = {
        name: systems[part]["samples_per_s"]
        for part, name in (("trl", "TRL"), ("trl_bf16", "TRL bfloat16"))
        if part in systems
    }
    if len(bases) == 2:
        bases["TRL fastest"] = max(bases.values())
    return {
        f"samples_per_s dora_jax-{mode} / {name}": systems[mode]["samples_per_s"] / base
        for name, base in bases.items()
        for mode in ("sync", "dora")
        if mode in systems
    }


def lr_factor(total_steps: int, warmup_steps: int, schedule: str, n: int) -> float:
    """dora_jax's learning-rate multiplier at optimizer step ``n`` (0-based), from
    ``dora_jax.train.state.lr_schedule`` itself: a linear warmup ``(n + 1) / W``, then constant
    or a cosine decay to 0 at ``total_steps``. (transformers' own warmup is ``n / W``: one step
    later, and the first step at learning rate 0, so TRL's trainer is given this one instead.)"""
    from dora_jax.config import TrainConfig
    from dora_jax.train.state import lr_schedule  # jax: after main() chose the platform

    cfg = dataclasses.replace(
        TrainConfig(), lr=1.0, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule
    )
    return float(lr_schedule(cfg)(n))


def micro_batch(cfg: ExperimentConfig) -> int:
    """Completions per TRL micro-batch: what one of dora_jax's train microbatches holds at
    most (``train.microbatch_tokens`` over the length bucket of a prompt and response of full
    length, else the batch over ``train.microbatches``), lowered to a divisor of the batch."""
    t, r = cfg.train, cfg.rollout
    batch = cfg.orchestrator.train_batch_prompts * t.group_size
    if t.microbatch_tokens:
        need = r.max_prompt_len + r.max_new_tokens
        bucket = min((b for b in t.length_buckets if b >= need), default=t.length_buckets[-1])
        rows = max(1, t.microbatch_tokens // bucket)
    else:
        rows = max(1, batch // t.microbatches)
    return max(d for d in range(1, min(rows, batch) + 1) if batch % d == 0)


def trl_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments (all but ``output_dir``) equal to the dora_jax
    recipe's settings; ``ValueError`` for a recipe TRL cannot follow."""
    t, r, o = cfg.train, cfg.rollout, cfg.orchestrator
    if t.advantage != "grpo":
        raise ValueError(f"train.advantage={t.advantage!r}: only 'grpo' has a GRPOTrainer twin")
    if cfg.data.reward != "final_number":
        raise ValueError(f"data.reward={cfg.data.reward!r}: the TRL side scores final_number only")
    if cfg.env.spec is not None:
        raise ValueError("env.spec: the TRL side runs single-turn prompts only")
    batch = o.train_batch_prompts * t.group_size
    micro = micro_batch(cfg)
    schedule = {"constant": "constant_with_warmup" if t.warmup_steps else "constant"}
    return {
        # the model and the machine
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        # TRL at its fastest: no gradient checkpointing (the models this compares fit without
        # it); dora_jax's model.remat is a speed choice on a CPU (settings_notes)
        "activation_checkpointing": False,
        "seed": cfg.seed,
        # one generation batch of TBS x G completions, one optimizer step on it (on-policy),
        # in micro-batches of at most what one of dora_jax's microbatches holds
        "num_generations": t.group_size,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": batch // micro,
        "steps_per_generation": batch // micro,
        "num_iterations": 1,
        "max_steps": t.total_steps,
        "shuffle_dataset": False,  # the prompts come in dora_jax's own order
        # sampling
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_k": r.top_k,
        "top_p": r.top_p,
        # the objective
        "beta": t.kl_beta,
        "epsilon": t.clip_eps_low,
        "epsilon_high": t.clip_eps_high,
        "loss_type": LOSS_TYPES[t.loss_agg][0],
        "scale_rewards": "group" if t.normalize_std else "none",
        "mask_truncated_completions": False,  # dora_jax trains on truncated completions too
        # the optimizer (AdamW, global-norm clipping; the schedule: see lr_factor)
        "learning_rate": t.lr,
        "lr_scheduler_type": schedule.get(t.schedule, t.schedule),
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_b1,
        "adam_beta2": t.adam_b2,
        "adam_epsilon": t.adam_eps,
        "max_grad_norm": t.max_grad_norm,
        # bookkeeping
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def settings_notes(cfg: ExperimentConfig) -> list[str]:
    """Where TRL's run differs from dora_jax's under :func:`trl_settings`."""
    t, m = cfg.train, cfg.model
    batch = cfg.orchestrator.train_batch_prompts * t.group_size
    notes = [
        "advantages: TRL divides by the group's sample std (n - 1) + 1e-4, dora_jax by the "
        f"population std (n) + {t.adv_eps:g}: TRL's advantages are sqrt((G-1)/G) = "
        f"{math.sqrt((t.group_size - 1) / t.group_size):.3f} of dora_jax's (Adam's update is "
        "nearly scale-free, so this acts mostly through gradient clipping)",
        f"loss: TRL loss_type={LOSS_TYPES[t.loss_agg][0]!r} for dora_jax "
        f"train.loss_agg={t.loss_agg!r}: {LOSS_TYPES[t.loss_agg][1]}",
        "ratio: TRL's old log-probabilities are its own trainer's (ratio 1 on-policy); dora_jax's "
        "are the engine's sampling log-probabilities",
        "learning rate: TRL's trainer gets dora_jax's schedule as a LambdaLR (transformers' "
        "warmup starts one step later, at 0)",
        "TRL's mask_truncated_completions=False: like dora_jax, truncated completions are "
        "trained on (and the final_number reward gives them 0)",
        "TRL runs twice, in float32 and under torch's bfloat16 autocast (bf16=True); dora_jax "
        f"with the recipe's dtypes (model.param_dtype={m.param_dtype}, compute_dtype="
        f"{m.compute_dtype})",
        f"recomputation: TRL without gradient checkpointing; dora_jax with model.remat="
        f"{cfg.model.remat} (on a CPU, recomputing a layer's products in the backward pass "
        "can be faster than saving them: XLA's CPU backend copies saved bfloat16 activations "
        "to float32 and back)",
        "weight decay (if any): both skip norms and biases; transformers also by name",
    ]
    if t.tis_cap is not None:
        notes.append(f"train.tis_cap={t.tis_cap}: no TRL twin without vLLM (not applied)")
    micro = micro_batch(cfg)
    notes.append(
        f"micro-batches: TRL accumulates {batch // micro} micro-batches of {micro} completions "
        "(each padded to its longest) for one optimizer step; dora_jax packs trajectories into "
        "rows and microbatches"
        + (f" of train.microbatch_tokens={t.microbatch_tokens}" if t.microbatch_tokens else "")
    )
    return notes


def finish_reason(completion_ids: Sequence[int], eos_ids: Sequence[int]) -> str:
    """How a TRL completion ended, as dora_jax's engine says it: ``eos`` when its last token is
    an EOS id (TRL cuts a completion after its first EOS), else ``length`` (the token limit)."""
    return "eos" if len(completion_ids) and int(completion_ids[-1]) in set(eos_ids) else "length"


def completion_text(completion: Any) -> str:
    """A TRL completion's text: a string, or a conversational ``[{"role", "content"}]``."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")


class FinalNumberReward:
    """TRL reward function: dora_jax's ``final_number_reward`` of each completion against its
    row's ``answer``, with ``finish_reason`` from its token ids. Keeps each call's means of the
    score and of the reward's ``correct`` and ``ended`` figures in ``calls``."""

    __name__ = "final_number"

    def __init__(self, eos_ids: Sequence[int]):
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.calls: list[dict[str, float]] = []

    def __call__(self, completions, completion_ids, answer, **_) -> list[float]:
        out = []
        for text, ids, ans in zip(completions, completion_ids, answer, strict=True):
            meta = {"finish_reason": finish_reason(ids, self.eos_ids)}
            out.append(final_number_reward(completion_text(text), str(ans), meta))
        n = max(len(out), 1)
        self.calls.append({k: sum(o[k] for o in out) / n for k in ("score", "correct", "ended")})
        return [o["score"] for o in out]


def per_step(seconds: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(seconds) if seconds else math.nan,
        "mean": statistics.fmean(seconds) if seconds else math.nan,
        "first": seconds[0] if seconds else math.nan,
    }


def dora_jax_figures(run_dir: Path, num_prompts: int) -> dict[str, Any]:
    """A finished run's figures from its ``metrics.jsonl`` and ``eval.jsonl``: seconds per step
    (``elapsed_s`` from one step's line to the next, the first from the run loop's start,
    held-out evaluations in between subtracted), the training part's seconds, the train-step
    seconds (``train_step_s``), the mean training reward and the held-out figures."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    eval_s = {e["step"]: e["eval/seconds"] for e in evals}
    steps, prev, prev_step = [], 0.0, 0
    for m in rows:
        steps.append(m["elapsed_s"] - prev - eval_s.get(prev_step, 0.0))
        prev, prev_step = m["elapsed_s"], m["step"]
    train_s = sum(steps)
    samples = int(sum(m["num_samples"] for m in rows))
    trainer_s = sum(m["train_step_s"] for m in rows)
    first, last = evals[0], evals[-1]
    return {
        "steps": len(rows),
        "samples": samples,
        "step_seconds": steps,
        "seconds_per_step": per_step(steps),
        "train_seconds": train_s,
        "samples_per_s": samples / train_s,
        "profile": {
            "train_step_s": trainer_s,
            "rest_s": train_s - trainer_s,
            "train_step_share": trainer_s / train_s,
            "what": "train_step_s: the trainer's steps (metrics.jsonl train_step_s); rest: "
            "sampling, scoring and the control plane",
        },
        "train_reward_mean": statistics.fmean(m["reward"] for m in rows),
        "train_reward_per_step": [m["reward"] for m in rows],
        "train_response_len_mean": statistics.fmean(m["response_len_mean"] for m in rows),
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in rows),
        "held_out": held_out_row(
            last["eval/solved"],
            num_prompts,
            last["step"],
            last["eval/response_len"],
            last["eval/seconds"],
        ),
        "held_out_step0": held_out_row(
            first["eval/solved"],
            num_prompts,
            first["step"],
            first["eval/response_len"],
            first["eval/seconds"],
        ),
    }


def held_out_row(solved: float, n: int, step: int, response_len: float, seconds: float) -> dict:
    return {
        "solved": solved,
        "se": binomial_se(solved, n),
        "problems": n,
        "step": step,
        "response_len": response_len,
        "seconds": seconds,
    }


# --- the parts that run things ----------------------------------------------------------------


def _inputs(cfg: ExperimentConfig):
    """The run's tokenizer, prompt encoder, prompt source and inline reward, as dora_jax builds
    them (``dora_jax.pipeline.experiment.build``)."""
    import functools

    from dora_jax.model.tokenizer import load_tokenizer
    from dora_jax.pipeline.grpo import encode_chat
    from dora_jax.pipeline.inputs import task_parts

    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, cfg.model.hf_path)
    encode = functools.partial(
        encode_chat, tokenizer, system_prompt=d.system_prompt, template=d.prompt_template
    )
    source, inline, _, _ = task_parts(cfg, encode)
    return tokenizer, encode, source, inline


def training_rows(cfg: ExperimentConfig, source, n: int) -> list[dict[str, Any]]:
    """The first ``n`` prompts of ``source`` (the prompt stream a dora_jax run of ``cfg``
    trains on, in its order), as TRL conversational rows ``{"prompt": [messages], "answer"}``."""
    from dora_jax.data.examples import chat_messages

    d = cfg.data
    return [
        {"prompt": chat_messages(p.text, d.system_prompt, d.prompt_template), "answer": p.answer}
        for p in source.take(n)
    ]


def _trl_trainer_class():
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class StepTimer(TrainerCallback):
        """Seconds of each optimizer step: one ``on_step_end`` to the next (the first from
        ``on_train_begin``), and of the whole ``train()``."""

        def __init__(self):
            self.t0 = self.last = self.end = 0.0
            self.steps: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now

        def on_train_end(self, args, state, control, **kw):
            self.end = time.perf_counter()

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with dora_jax's learning-rate schedule and timings of its sampling
        (``generate`` alone) and of generating-and-scoring a batch (tokenising, sampling,
        decoding, rewards, advantages); the first batch's prompt ids are kept."""

        def __init__(self, *a, lr_lambda: Callable[[int], float], **kw):
            self.lr_lambda = lr_lambda
            self.sample_s: list[float] = []
            self.generate_s: list[float] = []
            self.first_prompt_ids: list[list[int]] | None = None
            super().__init__(*a, **kw)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                opt = optimizer if optimizer is not None else self.optimizer
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
                self._created_lr_scheduler = True
            return self.lr_scheduler

        def _tokenize_prompts(self, prompts):
            out = super()._tokenize_prompts(prompts)
            if self.first_prompt_ids is None:
                self.first_prompt_ids = [[int(t) for t in p] for p in out[0]]
            return out

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                self.sample_s.append(time.perf_counter() - t0)

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generate_s.append(time.perf_counter() - t0)

    return TimedGRPOTrainer, StepTimer


def save_hf_dir(trainer, src: Path, dest: Path) -> list[str]:
    """``trainer.save_model(dest)`` plus the files of ``src`` the save leaves out that a model
    directory needs (chat template, generation config); the names copied."""
    trainer.save_model(str(dest))
    copied = []
    for name in ("chat_template.jinja", "generation_config.json"):
        if (src / name).is_file() and not (dest / name).is_file():
            shutil.copy2(src / name, dest / name)
            copied.append(name)
    return copied


def run_trl(cfg: ExperimentConfig, work: Path, bf16: bool = False) -> dict[str, Any]:
    """TRL's GRPO run of ``cfg``'s settings (``bf16``: under torch's bfloat16 autocast); its
    final model in ``work / "model"``."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora_jax.model.tokenizer import eos_ids

    t_setup = time.perf_counter()
    kwargs = {**trl_settings(cfg), "bf16": bf16}
    steps = cfg.train.total_steps
    batch = cfg.orchestrator.train_batch_prompts * cfg.train.group_size
    tokenizer, encode, source, _ = _inputs(cfg)
    rows = training_rows(cfg, source, cfg.orchestrator.train_batch_prompts * steps)
    reward = FinalNumberReward(eos_ids(tokenizer))
    src = Path(cfg.model.hf_path)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(src)
    trainer_cls, timer_cls = _trl_trainer_class()
    timer = timer_cls()
    args = trl.GRPOConfig(output_dir=str(work / "trl_output"), **kwargs)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=hf_tok,
        callbacks=[timer],
        lr_lambda=lambda n: lr_factor(steps, cfg.train.warmup_steps, cfg.train.schedule, n),
    )
    setup_s = time.perf_counter() - t_setup
    trainer.train()
    train_s = timer.end - timer.t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    out_dir = work / "model"
    copied = save_hf_dir(trainer, src, out_dir)
    want = [encode(r["prompt"]) for r in rows[: cfg.orchestrator.train_batch_prompts]]
    got = trainer.first_prompt_ids or []
    got_unique = [p for i, p in enumerate(got) if i % cfg.train.group_size == 0]
    gen_s, sample_s = sum(trainer.generate_s), sum(trainer.sample_s)
    result = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "grpo_config": kwargs,
        "grpo_config_resolved": {
            k: getattr(args, k)
            for k in (
                "generation_batch_size",
                "steps_per_generation",
                "loss_type",
                "scale_rewards",
                "lr_scheduler_type",
            )
        },
        "lr_schedule": "dora_jax's (lr_factor) through a LambdaLR; the lr per step: "
        + ", ".join(f"{h.get('learning_rate', math.nan):.3g}" for h in logs),
        "eos_ids": {"reward": list(reward.eos_ids), "trl": list(trainer.eos_token_ids)},
        "prompts": "the first TBS x steps prompts of the dora_jax run's stream, in its order "
        "(sync mode trains on the same prompts at the same steps; dora mode's steps take "
        "prompt groups as they finish)",
        "prompt_tokens_match_dora_jax": got_unique == want,
        "steps": len(timer.steps),
        "samples": batch * len(timer.steps),
        "step_seconds": timer.steps,
        "seconds_per_step": per_step(timer.steps),
        "train_seconds": train_s,
        "samples_per_s": batch * len(timer.steps) / train_s,
        "setup_seconds": setup_s,
        "profile": {
            "generate_and_score_s": gen_s,
            "sampling_s": sample_s,
            "rest_s": train_s - gen_s,
            "generate_share": gen_s / train_s,
            "what": "generate_and_score: TRL's _generate_and_score_completions (tokenising, "
            "transformers generate = sampling_s, decoding, rewards, advantages); rest: the "
            "loss forward/backward and the optimizer step, logging",
        },
        "train_reward_mean": statistics.fmean(c["score"] for c in reward.calls),
        "train_reward_per_step": [c["score"] for c in reward.calls],
        "train_correct_per_step": [c["correct"] for c in reward.calls],
        "train_ended_per_step": [c["ended"] for c in reward.calls],
        "train_response_len_mean": statistics.fmean(
            h.get("completions/mean_length", math.nan) for h in logs
        ),
        "trl_logged_reward_per_step": [h["reward"] for h in logs],
        "saved_model": {"copied_from_original": copied},
    }
    del trainer, model
    return result


def run_dora_jax(
    config: Path, mode: str, steps: int, run_dir: Path, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """``launch/train.py`` on the recipe in ``mode`` for ``steps`` steps, into ``run_dir``."""
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "train.py"),
        "--config",
        str(config),
        *overrides(steps, extra),
        f"run_dir={run_dir}",
        f"orchestrator.mode={mode}",
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"dora_jax {mode} run failed (exit {rc}); {log}:\n{tail}")
    return {"command": " ".join(cmd[1:]), "process_seconds": wall}


def held_out_problems(cfg: ExperimentConfig) -> int:
    """How many held-out samples an evaluation of ``cfg`` scores."""
    from dora_jax.pipeline.inputs import eval_problems

    _, encode, _, _ = _inputs(cfg)
    return len(eval_problems(cfg, encode)) * cfg.eval.samples_per_prompt


class HeldOut:
    """dora_jax's held-out evaluator of the recipe (``eval.path``, ``eval.num_prompts``, the
    rollout's temperature, ``seed``, the run's eval scorer), for params from HF directories."""

    def __init__(self, cfg: ExperimentConfig):
        import jax

        from dora_jax.pipeline.evaluation import Evaluator
        from dora_jax.pipeline.inputs import eval_problems, scorers

        tokenizer, encode, _, inline = _inputs(cfg)
        problems = eval_problems(cfg, encode)
        if not problems:
            raise SystemExit("the recipe has no held-out problems (eval.path, eval.num_prompts)")
        _, scorer = scorers(cfg, inline, time.monotonic)
        self.cfg, self.n = cfg, len(problems) * cfg.eval.samples_per_prompt
        self.evaluator = Evaluator(
            cfg.model,
            cfg.rollout,
            jax.devices()[0],
            tokenizer,
            problems,
            scorer,
            cfg.seed,
            encode=encode,
            samples_per_prompt=cfg.eval.samples_per_prompt,
        )

    def __call__(self, model_dir: Path, step: int) -> dict[str, Any]:
        from dora_jax.model.hf_checkpoint import load_hf_params

        params = load_hf_params(model_dir, self.cfg.model)
        r = self.evaluator(params, step)
        del params
        return held_out_row(r.solved, self.n, step, r.response_len, r.seconds)


def check_saved_dir(model_dir: Path, original: Path) -> dict[str, Any]:
    """TRL's saved directory as dora_jax reads a model directory: the architecture, the float32
    tensors, the chat template and the EOS ids equal the original's."""
    from safetensors import safe_open

    from dora_jax.model.hf_checkpoint import load_hf_config
    from dora_jax.model.tokenizer import HFTokenizer, eos_ids

    dtypes = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "np") as s:
            dtypes |= {str(s.get_slice(k).get_dtype()) for k in s.keys()}  # noqa: SIM118
    a, b = HFTokenizer(model_dir), HFTokenizer(original)
    return {
        "files": sorted(p.name for p in model_dir.iterdir()),
        "tensor_dtypes": sorted(dtypes),
        "same_architecture": load_hf_config(model_dir) == load_hf_config(original),
        "same_chat_template": a.chat_template == b.chat_template,
        "same_eos_ids": eos_ids(a) == eos_ids(b),
    }


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'system':<16}{'s/step med':>11}{'s/step mean':>12}{'train s':>9}{'samples/s':>10}"
        f"{'held-out solved':>20}{'train reward':>13}"
    )
    lines = [head]
    names = {
        "trl": "TRL GRPOTrainer",
        "trl_bf16": "TRL bfloat16",
        "sync": "dora_jax sync",
        "dora": "dora_jax dora",
    }
    for part, name in names.items():
        r = results["systems"].get(part)
        if r is None:
            continue
        h = r.get("held_out") or {}
        solved = f"{h['solved']:.3f} +- {h['se']:.3f}" if h else "-"
        lines.append(
            f"{name:<16}{r['seconds_per_step']['median']:>11.2f}"
            f"{r['seconds_per_step']['mean']:>12.2f}{r['train_seconds']:>9.1f}"
            f"{r['samples_per_s']:>10.3f}{solved:>20}{r['train_reward_mean']:>13.3f}"
        )
    base = results.get("base_model")
    if base:
        solved = f"{base['solved']:.3f} +- {base['se']:.3f}"
        lines.append(f"{'base model':<16}{'':>11}{'':>12}{'':>9}{'':>10}{solved:>20}")
    for part, name in names.items():
        prof = results["systems"].get(part, {}).get("profile")
        if prof and "generate_share" in prof:
            lines.append(
                f"{name}: generating and scoring {prof['generate_share']:.0%} of the "
                f"training part, loss and optimizer the rest"
            )
        elif prof:
            lines.append(
                f"{name}: train steps {prof['train_step_share']:.0%} of the training "
                f"part, sampling, scoring and control the rest"
            )
    for k, v in results.get("ratios", {}).items():
        lines.append(f"{k}: {v:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the dora_jax recipe")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of every system")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the run directories and TRL's model under DIR",
    )
    p.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only this system (repeatable; development)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for every system (repeatable; e.g. eval.num_prompts=8)",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    config = Path(args.config).resolve()
    out = Path(args.out).resolve()
    parts = tuple(x for x in PARTS if x in (args.only or PARTS))
    os.chdir(ROOT)  # the recipe's paths are relative to the checkout
    # jax starts (in the evaluations) on the platform launch/train.py gives the runs
    from dora_jax.platform import fake_cpu_devices

    fake_cpu_devices(8)
    cfg = load_config(config, overrides(args.steps, args.set))
    if set(parts) & set(TRL_PARTS):
        if importlib.util.find_spec("trl") is None:
            raise SystemExit(
                "error: TRL is not installed; pip install -e '.[bench]' (trl 1.16.0), or run "
                "without it: --only sync --only dora"
            )
        trl_settings(cfg)  # refuse a recipe TRL cannot follow before anything runs
    problems = held_out_problems(cfg)
    load = wait_for_quiet(args.max_load, args.wait)
    keep = Path(args.keep).resolve() if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        work = keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_vs_trl-"))
        )
        results: dict[str, Any] = {"systems": {}}
        phase_s: dict[str, float] = {}
        for part, dtype in TRL_PARTS.items():
            if part not in parts:
                continue
            t0 = time.perf_counter()
            (work / part).mkdir(exist_ok=True)
            results["systems"][part] = run_trl(cfg, work / part, bf16=dtype == "bfloat16")
            phase_s[f"{part}_training"] = time.perf_counter() - t0
            print(f"TRL {dtype}: {phase_s[f'{part}_training']:.0f} s", flush=True)
        runs = {}
        for mode in ("sync", "dora"):
            if mode not in parts:
                continue
            t0 = time.perf_counter()
            run_dir = work / mode
            if run_dir.exists():
                shutil.rmtree(run_dir)
            info = run_dora_jax(config, mode, args.steps, run_dir, args.set)
            runs[mode] = run_dir
            fig = dora_jax_figures(run_dir, problems)
            results["systems"][mode] = {**info, **fig}
            phase_s[f"dora_jax_{mode}"] = time.perf_counter() - t0
            print(f"dora_jax {mode}: {phase_s[f'dora_jax_{mode}']:.0f} s", flush=True)
        # the held-out evaluations, in this process, after every run
        from dora_jax.pipeline.experiment import resolve_model

        t0 = time.perf_counter()
        cfg = resolve_model(cfg)
        held_out = HeldOut(cfg)
        results["base_model"] = held_out(Path(cfg.model.hf_path), 0)
        for part in TRL_PARTS:
            if part not in parts:
                continue
            trl_dir = work / part / "model"
            trl = results["systems"][part]
            trl["saved_model"].update(check_saved_dir(trl_dir, Path(cfg.model.hf_path)))
            trl["held_out"] = held_out(trl_dir, args.steps)
        phase_s["held_out_evaluation"] = time.perf_counter() - t0
        # the same evaluator on the same base model: the runs' step-0 figures, reproduced
        results["base_model"]["runs_step0"] = {
            mode: {
                k: results["systems"][mode]["held_out_step0"][k] for k in ("solved", "response_len")
            }
            for mode in runs
        }
        results["ratios"] = ratios(results["systems"])
    out_json = {
        "what": "TRL's GRPOTrainer and dora_jax (sync, dora) on the same model, task, GRPO "
        "settings and samples, one after the other on this machine's CPU; the held-out score "
        "of each after the same number of samples, by dora_jax's evaluator",
        "recipe": rel(config),
        "steps": args.steps,
        "samples_per_step": cfg.orchestrator.train_batch_prompts * cfg.train.group_size,
        "held_out_problems": problems,
        "units": {
            "seconds_per_step": "wall seconds per optimizer step (median, mean, first)",
            "train_seconds": "wall seconds of the training part (TRL: trainer.train(); "
            "dora_jax: the run loop, held-out evaluations excluded)",
            "samples_per_s": "trained completions per wall second of the training part",
            "held_out.solved": "share of held-out problems with full reward (one sample each), "
            "se: its binomial standard error",
            "train_reward_mean": "mean over steps of the batch's mean reward",
            "phase_seconds": "wall seconds of each phase of this script",
        },
        "trl_settings_notes": settings_notes(cfg),
        "parts": list(parts),
        **results,
        "phase_seconds": phase_s,
        **provenance(load),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(out_json, indent=1) + "\n")
    print(table(out_json))
    print(f"wrote {rel(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
