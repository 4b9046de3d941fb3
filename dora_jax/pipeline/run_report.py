"""The end of a run: timeline plots, reward curves, ``summary.json``/``summary.md``, and the lines
printed to the terminal."""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections import Counter
from pathlib import Path

from dora_jax.curves import reward_curve_plot
from dora_jax.execution.commands import HOST_GONE
from dora_jax.metrics import METRICS_FILE, binomial_se, read_metrics
from dora_jax.orchestrator.clock import CLOCKS
from dora_jax.orchestrator.runtime import RunResult
from dora_jax.pipeline.experiment import Experiment
from dora_jax.pipeline.grpo import FAILURE_FIGURES
from dora_jax.pipeline.observers import HeldOutEval, step_reward, step_solved
from dora_jax.report import head, plot_timeline, reward_stats, write_summary


def write_run_report(
    exp: Experiment,
    result: RunResult,
    evals: HeldOutEval,
    run_dir: Path,
    wall_s: float,
    warm_start_s: float,
    health=None,
) -> None:
    """Plots and summary files in ``run_dir``; prints the run's figures. ``health`` (a
    :class:`~dora_jax.pipeline.health.RunHealth`) adds the skipped steps and policy warnings."""
    cfg, o = exp.cfg, exp.cfg.orchestrator
    rows = step_rows(exp, run_dir)
    rewards = [(m["step"], m["reward"]) for m in rows]
    solved = [(m["step"], m["solved"]) for m in rows]
    trainer = trainer_figures(rows)
    rec = result.records
    units = CLOCKS[rec.clock]
    title = f"{o.mode}: rollout groups over time, coloured by policy version"
    plot_timeline(rec, run_dir / "timeline.png", title=title)
    close_up = units.close_up(rec.horizon())
    what = f"the first {units.amount(close_up)}"
    plot_timeline(head(rec, close_up), run_dir / "timeline_start.png", title=f"{o.mode}: {what}")
    reward_curve_plot(
        {"reward": rewards, "solved (exact answer)": solved},
        run_dir / "reward.png",
        xlabel="train step",
    )
    oh = exp.backend.overheads
    write_summary(
        run_dir,
        summary=result.summary,
        records=rec,
        rewards=rewards,
        wall_s=wall_s,
        overheads={
            "weight_transfer_s": oh.weight_transfer_s,
            "migration_s": oh.migration_s,
            "warm_start_s": warm_start_s,
            "eval_s": evals.seconds,
        },
        held_out=[  # (the per-problem scores and texts are in eval_samples.jsonl)
            {k: v for k, v in dataclasses.asdict(r).items() if k not in ("scores", "samples")}
            for r in evals.results
        ],
        extra={
            "trainer": trainer,
            "reward_errors": exp.reward.errors,
            "reward_errors_by_kind": exp.reward.error_counts(),
            # trajectories whose reward or environment call failed, and what data.on_failure
            # left out of the advantages (sums over the steps of metrics.jsonl)
            "on_failure": cfg.data.on_failure,
            **failure_totals(rows),
            "config": "config.yaml",
            "stopped_early": exp.stopped,
            "request_states": result.states or dict(Counter(result.ledger.values())),
            "consumed_request_ids": [c.request_id for c in rec.consumed],
            # the measured workload (benchmarks/calibrate_cpu.py feeds it to the simulator)
            "consumed_response_lens": [c.response_len for c in rec.consumed],
            "consumed_prompt_lens": [c.prompt_len for c in rec.consumed],
            "skipped_steps": health.skipped_steps if health is not None else [],
            "policy_warnings": health.warnings if health is not None else [],
            "long_prompts_skipped": len(exp.long_prompt_lines)
            + (exp.prompts.skipped if exp.prompts is not None else 0),
            "long_prompt_lines": exp.long_prompt_lines[:1000],
            # multi-turn runs: conversations, turns, environment seconds, end reasons and
            # failed calls by kind (cumulative, env/...)
            "environment": exp.env.figures() if exp.env is not None else None,
        },
    )
    if exp.stopped and (health is None or health.tripped is None):
        print(
            f"stopped at step {exp.runtime.steps_done} with a checkpoint in "
            f"{run_dir / 'checkpoints'}; continue with: {resume_hint(cfg.run_dir)}"
        )
    s = result.summary
    print(
        f"done in {wall_s:.0f} s: {s.steps} steps, {s.trajectories} trajectories, "
        f"bubble {s.bubble:.1%}, trainer busy with rollout decoding {s.overlap:.0%}, "
        f"staleness mean {s.staleness_mean:.2f} max "
        f"{s.staleness_max}, {s.migrated} migrated, {s.reprefill_tokens} re-prefill tokens"
    )
    if s.k_chosen:
        k = s.k_chosen
        why = ", ".join(f"{n} {r}" for r, n in sorted(k["reasons"].items()) if r != "hold")
        print(
            f"staleness_k auto: K {k['min']}-{k['max']} (mean {k['mean']:.2f}, last "
            f"{k['last']}); changes and their reasons: {why or 'none'}"
        )
    if s.group_failures or s.groups_left:
        parts = ", ".join(f"{n} from {src}" for src, n in sorted(s.recovered.items()))
        lost = sum(1 for h in rec.health if h[2] == "dead" and HOST_GONE in h[3])  # (process died)
        said = []
        if s.group_failures:
            how = "each rebuilt" if not lost else f"{lost} of them with their process"
            said.append(f"rollout groups failed {s.group_failures} time(s), {how}")
        if s.groups_left:
            said.append(
                f"rollout groups left {s.groups_left} time(s) with their process, asked to stop "
                "(their requests handed over)"
            )
        print(
            f"{'; '.join(said)}; the requests they held went on elsewhere: {parts or 'none held'}"
        )
    if rewards:
        r, x = reward_stats(rewards), reward_stats(solved)  # summary.json's "reward" too
        k = r["n_avg"]
        print(
            f"mean reward: first {k} steps {r['start']:.3f} -> last {k} steps {r['end']:.3f}; "
            f"solved (exact answer): {x['start']:.3f} -> {x['end']:.3f}"
        )
    if "real_token_share_mean" in trainer:
        print(
            f"trainer: {trainer['real_token_share_mean']:.0%} of its positions real tokens, "
            f"{trainer.get('train_step_s_mean', math.nan):.3f} s a step, "
            f"{trainer.get('real_tokens_per_s_mean', math.nan):.0f} real tokens/s (means)"
        )
    if len(evals.results) >= 2:
        e0, e1 = evals.results[0], evals.results[-1]
        n = len(exp.evaluator.prompts)
        k = exp.evaluator.k
        each = "one sample each" if k == 1 else f"{k} samples each"
        print(
            f"held-out eval ({n} problems, {each}): solved {e0.solved:.3f} at step "
            f"{e0.step} -> {e1.solved:.3f} at step {e1.step} (+-{binomial_se(e1.solved, n):.3f}); "
            f"mean response {e0.response_len:.1f} -> {e1.response_len:.1f} tokens"
        )
        if e1.at_k:
            moves = [f"{n} {e0.at_k.get(n, math.nan):.3f} -> {v:.3f}" for n, v in e1.at_k.items()]
            print(f"held-out at steps {e0.step} -> {e1.step}: " + ", ".join(moves))
    if exp.reward.errors:
        kinds = ", ".join(f"{n} {k}" for k, n in exp.reward.error_counts().items() if n)
        print(f"reward function failures (reward 0): {kinds}")
    if exp.env is not None:
        f = exp.env.figures()
        n = f["env/conversations"]
        failed = (
            ", ".join(
                f"{int(v)} {k.rsplit('/', 1)[1]}"
                for k, v in f.items()
                if k.startswith("env/failures/") and v
            )
            or "none"
        )
        print(
            f"environment: {n:.0f} conversations ended; {f['env/turns']:.0f} model turns and "
            f"{f['env/env_seconds']:.1f} s of environment calls in all; failed calls: {failed}"
        )
    print(
        f"wrote {run_dir / 'summary.md'}, {run_dir / 'timeline.png'}, {run_dir / 'metrics.jsonl'}"
    )


def step_rows(exp: Experiment, run_dir: Path) -> list[dict]:
    """Every step of the run (resumes too) with its ``step``, ``reward``, ``solved`` and trainer
    figures: the lines of ``metrics.jsonl`` (a run with history files keeps no step logs in
    memory), else the trainer's step logs."""
    path = run_dir / METRICS_FILE
    if path.is_file():
        return [m for m in read_metrics(path) if "reward" in m]
    return [
        {**sl.metrics, **sl.timing, "step": sl.version}
        | {"reward": step_reward(sl), "solved": step_solved(sl)}
        for sl in exp.grpo.step_logs(exp.grpo.log_start)
    ]


TRAINER_FIGURES = ("real_token_share", "train_step_s", "real_tokens_per_s")


def trainer_figures(rows: list[dict]) -> dict[str, float]:
    """The means over the run's steps (:func:`step_rows`) of the trainer's real-token share (real
    tokens over the batch's positions), its step seconds and its real tokens per second
    (``*_mean``)."""
    out = {}
    for key in TRAINER_FIGURES:
        values = [float(m[key]) for m in rows if key in m]
        if values:
            out[f"{key}_mean"] = sum(values) / len(values)
    return out


def failure_totals(rows: list[dict]) -> dict[str, int]:
    """The run's ``failed_samples``, ``failed_samples_dropped`` and ``failed_groups_dropped``:
    the sums of the steps' figures (:func:`step_rows`; a step logged without them counts 0)."""
    return {k: int(sum(m.get(k, 0) for m in rows)) for k in FAILURE_FIGURES}


def resume_hint(run_dir: str | Path, flags: str | None = None) -> str:
    """The command that continues the run in ``run_dir`` (its config comes from the checkpoint),
    with the ``--local-processes`` flags the run was started with (``flags``: the launcher's
    own, which it does not find in its environment as the processes it started do)."""
    from dora_jax.distributed.launcher import launch_flags

    flags = launch_flags() if flags is None else flags
    return (
        f"python launch/train.py {flags + ' ' if flags else ''}--resume "
        f"run_dir={shlex.quote(str(run_dir))}"
    )
