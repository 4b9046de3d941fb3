"""The GPU check's ``grpo`` section (``launch/gpu_check.py``): a few GRPO steps of the real
SmolLM2-135M-Instruct end to end on one device.

The task, reward and optimizer are the recipe's (``configs/recipes/smollm2-add-cpu.yaml``:
plain-English additions, the ``final_number`` reward, dora with K=2), adapted to one device as
``configs/qwen2.5-0.5b-1gpu.yaml`` is: the trainer and the rollout groups colocated on device 0,
the wall clock, and the plan's dtype, attention kernels and batch (``Plan.grpo``). The run is the
train command's own loop (``build``, ``run``, ``metrics.jsonl``, held-out evaluations before the
first step and after the last) in a temporary run directory, without checkpoints or plots.

The weights: the prepared Hugging Face directory (``Plan.grpo_model_dir``, written by
``python launch/prepare_model.py smollm2-135m-instruct``), else the GGUF that directory is made
from (``Plan.grpo_gguf``, checked against its sha256 and converted here, float32), else the case
is skipped with the reason. docs/gpu_checks.md says how the GGUF reaches the GPU machine.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from gpu_check_report import Recorder, SkipCase

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "recipes" / "smollm2-add-cpu.yaml"
DATA = ROOT / "configs" / "recipes" / "data" / "add-1-20"
MODEL = "smollm2-135m-instruct"
# the GGUF's sha256 (dora_jax/model/gguf_models.py KNOWN_MODELS, repeated here so that finding
# the weights imports nothing: a missing model is reported before jax loads the model code)
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HOW = "see docs/gpu_checks.md, 'The real model on the GPU machine'"


def _path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else ROOT / path


def _prepared(directory: Path) -> bool:
    """A Hugging Face directory the run can load: config, tokenizer and weights."""
    weights = (directory / "model.safetensors").is_file() or (
        directory / "model.safetensors.index.json"
    ).is_file()
    return (
        (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    ) and weights


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def find_weights(plan) -> tuple[Path | None, Path | None]:
    """``(prepared directory, None)`` or ``(None, GGUF to convert)``; raises SkipCase saying why
    neither is usable here."""
    directory, gguf = _path(plan.grpo_model_dir), _path(plan.grpo_gguf)
    if _prepared(directory):
        return directory, None
    if not gguf.is_file():
        raise SkipCase(
            f"no {MODEL} here: {directory} is not a prepared Hugging Face directory (config.json, "
            f"tokenizer.json, model.safetensors) and there is no GGUF at {gguf}; {HOW}"
        )
    got = _sha256(gguf)
    if got != GGUF_SHA256:
        raise SkipCase(
            f"{gguf} ({gguf.stat().st_size} bytes) is not the {MODEL} GGUF: sha256 {got}, expected "
            f"{GGUF_SHA256} (halves joined wrong, or one missing?); {HOW}"
        )
    try:
        import gguf as _  # noqa: F401  (the converter's reader; not in every image)
    except ImportError:
        raise SkipCase(
            f"{gguf} is here but the Python package gguf (which reads it) is not: carry its wheel; "
            f"{HOW}"
        ) from None
    return None, gguf


def overrides(plan, model_dir: Path, run_dir: Path) -> list[str]:
    """The recipe's settings that the case replaces (dotted overrides of the train command)."""
    g = plan.grpo
    page_size, prompt_len = 16, 64  # the recipe's
    pages = g["max_slots"] * -(-(prompt_len + g["max_new_tokens"]) // page_size) + 1
    return [
        f"run_dir={run_dir}",
        f"model.hf_path={model_dir}",
        f"model.param_dtype={g['dtype']}",
        f"model.compute_dtype={g['dtype']}",
        f"train.fp32_master_weights={str(g['dtype'] != 'float32').lower()}",
        "mesh.trainer.devices=0:1",
        "mesh.rollout.devices=0:1",
        f"mesh.rollout.groups={g['groups']}",
        "orchestrator.clock=wall",
        f"orchestrator.train_batch_prompts={g['train_batch_prompts']}",
        f"orchestrator.rollout_batch_prompts={g['rollout_batch_prompts']}",
        f"train.group_size={g['group_size']}",
        f"train.total_steps={g['steps']}",
        "train.microbatch_tokens=0",  # one device holds the whole batch
        # the layout of the first GPU run (each trajectory its own segment), so that its real
        # tokens per second compare one to one
        "train.share_prompts=false",
        "train.length_buckets=[128]",
        f"rollout.max_slots={g['max_slots']}",
        f"rollout.num_pages={pages}",
        f"rollout.max_new_tokens={g['max_new_tokens']}",
        f"rollout.attention_impl={g['attention_impl']}",
        f"data.path={DATA / 'train.jsonl'}",
        f"eval.path={DATA / 'held_out.jsonl'}",
        f"eval.num_prompts={g['eval_prompts']}",
        f"eval.every_steps={g['steps'] + 1}",  # before the first step and after the last only
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.samples_every=0",
    ]


def rollout_figures(records) -> dict:
    """Response tokens sampled by the rollout groups over the seconds some group was prefilling
    or decoding (the union: colocated groups share the device), with and without each group's
    first prefill and first decode call (the ones that compile, unless the evaluation engine
    compiled the same programs before: ``rollout_busy_s`` less ``rollout_busy_s_warm`` shows
    what they took)."""
    from dora_jax.orchestrator.records import merge_intervals

    spans = sorted(
        (s for s in records.spans if s.activity in ("prefill", "decode")), key=lambda s: s.t0
    )
    first: set[tuple[int, str]] = set()
    warm = []
    for s in spans:
        if (s.group, s.activity) in first:
            warm.append(s)
        first.add((s.group, s.activity))

    def rate(chosen) -> tuple[int, float, float | None]:
        tokens = sum(s.tokens for s in chosen)
        busy = sum(b - a for a, b in merge_intervals([(s.t0, s.t1) for s in chosen]))
        return tokens, busy, tokens / busy if busy > 0 else None

    tokens, busy, per_s = rate(spans)
    _, warm_busy, warm_per_s = rate(warm)
    return dict(
        rollout_tokens=tokens,
        prefill_tokens=sum(s.prefill_tokens for s in spans),
        rollout_busy_s=busy,
        rollout_tokens_per_s=per_s,
        rollout_busy_s_warm=warm_busy,
        rollout_tokens_per_s_warm=warm_per_s,
    )


def train_figures(rows: list[dict]) -> dict:
    """The train steps' seconds and real tokens per second from ``metrics.jsonl``: the first step
    apart (it may compile), the median of the others (of all when there is one)."""
    later = rows[1:] or rows
    return dict(
        train_step_s_first=rows[0]["train_step_s"] if rows else None,
        train_step_s=statistics.median(r["train_step_s"] for r in later) if later else None,
        train_real_tokens_per_s=(
            statistics.median(r["real_tokens_per_s"] for r in later) if later else None
        ),
        train_real_tokens_per_s_first=rows[0]["real_tokens_per_s"] if rows else None,
        train_tokens_per_step=statistics.median(r["num_tokens"] for r in rows) if rows else None,
        response_len_mean=statistics.mean(r["response_len_mean"] for r in rows) if rows else None,
        reward_first=rows[0]["reward"] if rows else None,
        reward_last=rows[-1]["reward"] if rows else None,
        losses=[r["loss"] for r in rows],
    )


def run_grpo(rec: Recorder, plan, out_dir: Path | None) -> dict:
    """The case: find the weights (or skip), run ``plan.grpo['steps']`` steps, read the run's
    files back into figures. The run's metrics.jsonl and eval.jsonl are copied to ``out_dir``."""
    model_dir, gguf = find_weights(plan)
    import math

    import jax

    from dora_jax.config import load_config
    from dora_jax.metrics import binomial_se, read_metrics
    from dora_jax.pipeline.experiment import build, run
    from dora_jax.pipeline.observers import HeldOutEval, MetricsLog

    g = plan.grpo
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_grpo_"))
    figures: dict = dict(model=MODEL)
    try:
        if gguf is not None:
            from dora_jax.model.gguf_import import convert_gguf

            t0 = time.perf_counter()
            model_dir = convert_gguf(gguf, tmp / MODEL, dtype="float32")
            figures.update(weights=f"converted from {gguf}", convert_s=time.perf_counter() - t0)
            rec.say(f"grpo: converted {gguf} in {figures['convert_s']:.1f} s")
        else:
            figures.update(weights=f"prepared directory {model_dir}")
        run_dir = tmp / "run"
        cfg = load_config(RECIPE, overrides(plan, model_dir, run_dir))
        figures.update(
            dtype=g["dtype"],
            impl=g["attention_impl"],
            groups=g["groups"],
            batch=f"{g['train_batch_prompts']} prompts x {g['group_size']}",
            max_new_tokens=g["max_new_tokens"],
            device=str(jax.devices()[0].device_kind),
        )
        t0 = time.perf_counter()
        exp = build(cfg, run_dir)
        figures["build_s"] = time.perf_counter() - t0
        try:
            metrics = MetricsLog(exp, run_dir, False)
            evals = HeldOutEval(exp, run_dir, cfg, False, echo=rec.say)
            evals.at(0)
            t0, eval_s = time.perf_counter(), evals.seconds
            result = run(exp, g["steps"], observers=(metrics, evals))
            run_s = time.perf_counter() - t0 - (evals.seconds - eval_s)  # (none runs inside)
            metrics.close()
            evals.at(exp.runtime.steps_done)
            evals.close()
        finally:
            exp.close()
        rows = [m for m in read_metrics(run_dir) if "reward" in m]
        s = result.summary
        figures.update(
            steps=len(rows),
            trajectories=s.trajectories,
            consumed_tokens=s.tokens,
            run_s=run_s,
            e2e_tokens_per_s=s.tokens / run_s if run_s > 0 else None,
            trajectories_per_s=s.trajectories / run_s if run_s > 0 else None,
            staleness_mean=s.staleness_mean,
            weight_transfers=s.weight_transfers,
            **rollout_figures(result.records),
            **train_figures(rows),
        )
        ev = evals.results
        if ev:
            n = len(exp.evaluator.prompts)
            figures.update(
                held_out_problems=n,
                held_out_solved_before=ev[0].solved,
                held_out_solved_after=ev[-1].solved,
                held_out_se=binomial_se(ev[-1].solved, n),
                held_out_response_len=[ev[0].response_len, ev[-1].response_len],
                eval_s=[e.seconds for e in ev],
            )
        if out_dir is not None:  # flat files: the device tool brings back no deeper ones
            for name in ("metrics.jsonl", "eval.jsonl"):
                if (run_dir / name).is_file():
                    shutil.copy(run_dir / name, out_dir / f"gpu_check_grpo_{name}")
        figures["ok"] = bool(
            len(rows) == g["steps"]
            and all(math.isfinite(x) for x in figures["losses"])
            and figures["rollout_tokens"] > 0
        )
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def grpo_section(rec: Recorder, plan) -> None:
    g = plan.grpo
    name = f"grpo/{MODEL}/{g['dtype']}/{g['attention_impl']}"
    case = partial(run_grpo, rec, plan, rec.out_dir)
    rec.run_case(
        "grpo", "grpo", name, case, model=MODEL, dtype=g["dtype"], impl=g["attention_impl"]
    )
