"""The ``train`` command: parse arguments, resolve the config, run the experiment, report.

A run directory gets: ``config.yaml`` (resolved), ``warm_start/`` (cached), ``metrics.jsonl``,
``tb/`` (TensorBoard), ``timeline.png``, ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from dora_jax.config import ConfigError, ExperimentConfig, dump_yaml, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
MODES = ("sync", "one_step", "partial", "oversample", "dora")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python launch/train.py",
        description="GRPO-style RL post-training with DORA multi-version asynchronous rollout.",
    )
    p.add_argument(
        "--config", type=Path, default=None, help="YAML preset (default: configs/default.yaml)"
    )
    p.add_argument("--mode", choices=MODES, help="shortcut for orchestrator.mode=MODE")
    p.add_argument("--steps", type=int, default=None, help="shortcut for train.total_steps=N")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run_dir from its latest checkpoint",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="dotted overrides, e.g. train.lr=1e-6",
    )
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"orchestrator.mode={args.mode}")
    if args.steps is not None:
        overrides.append(f"train.total_steps={args.steps}")
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    return load_config(path, overrides)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_config(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from dora_jax.checkpoint import CheckpointError as RunCheckpointError
    from dora_jax.data.jsonl import DataError
    from dora_jax.model.hf_checkpoint import CheckpointError
    from dora_jax.model.tokenizer import TokenizerError
    from dora_jax.pipeline.experiment import ExperimentError

    try:
        return train(cfg, resume=args.resume)
    except (
        ConfigError,
        DataError,
        CheckpointError,
        TokenizerError,
        ExperimentError,
        RunCheckpointError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _StopFlag:
    """Set by SIGINT/SIGTERM: the run saves a checkpoint at the next tick and exits."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        import signal

        def handler(signum, frame):
            if self.signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.signal = signum
            print(
                f"\nsignal {signum}: saving a checkpoint at the next tick, then stopping",
                file=sys.stderr,
                flush=True,
            )

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def train(cfg: ExperimentConfig, resume: bool = False) -> int:
    from dora_jax.metrics import MetricsWriter, progress
    from dora_jax.model import count_params
    from dora_jax.pipeline.evaluation import binomial_se
    from dora_jax.pipeline.experiment import build, run
    from dora_jax.report import head, plot_timeline, reward_curve_plot, write_summary

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    o = cfg.orchestrator
    print(
        f"dora_jax: mode={o.mode} K={o.staleness_k} TBS={o.train_batch_prompts} "
        f"RBS={o.rollout_batch_prompts} G={cfg.train.group_size}; policy {cfg.model.family} "
        f"({count_params(cfg.model):,} params); run dir {run_dir}"
    )
    t_start = time.perf_counter()
    bar = progress(cfg.warm_start.steps, "warm start", enabled=cfg.logging.progress)

    def on_warm(i: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    exp = build(cfg, run_dir, on_warm)
    bar.close()
    from dora_jax.checkpoint import RunCheckpointer

    ckpt_dir = run_dir / "checkpoints"
    if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        print(
            f"error: {ckpt_dir} already holds checkpoints: pass --resume to continue that run, "
            "or choose another run_dir",
            file=sys.stderr,
        )
        return 2
    checkpointer = RunCheckpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    if resume:
        tick = checkpointer.restore_latest(exp)
        print(
            f"resumed from {ckpt_dir}/{tick}: {exp.runtime.steps_done} steps done, "
            f"{sum(e.num_requests for e in exp.backend.engines)} requests in flight"
        )
    remaining = cfg.train.total_steps - exp.runtime.steps_done
    if exp.warm_start_losses:
        print(
            f"warm start: {len(exp.warm_start_losses)} steps, loss "
            f"{exp.warm_start_losses[0]:.3f} -> {exp.warm_start_losses[-1]:.3f}"
        )
    groups = ", ".join(
        f"g{i}:{[d.id for d in m.devices.flat]}" for i, m in enumerate(exp.meshes.groups)
    )
    print(f"trainer mesh {dict(exp.meshes.trainer.shape)}; rollout groups {groups}")

    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard)
    if resume:  # metrics.jsonl continues; drop lines past the checkpoint
        _truncate_metrics(run_dir / "metrics.jsonl", len(exp.grpo.log))
    evals = _HeldOutEval(exp, run_dir, cfg, resume)
    if exp.runtime.steps_done == 0:
        evals.maybe(0)  # before the first step
    bar = progress(cfg.train.total_steps, f"GRPO ({o.mode})", enabled=cfg.logging.progress)
    t_run = time.perf_counter()
    tokens_seen = 0

    def on_step(log) -> None:
        nonlocal tokens_seen
        m = {k: np.asarray(v).tolist() for k, v in log.metrics.items()}
        reward, solved = _reward(log), _solved(log)
        tokens_seen += int(m["num_tokens"])
        elapsed = time.perf_counter() - t_run
        writer.write(
            log.version,
            {
                **m,
                "reward": reward,
                "solved": solved,
                "elapsed_s": elapsed,
                "reward_errors": exp.reward.errors,
            },
        )
        if log.version % cfg.eval.every_steps == 0:
            evals.maybe(log.version, echo=bar.write if not bar.disable else print)
        bar.update(1)
        bar.set_postfix(
            reward=f"{reward:.2f}",
            solved=f"{solved:.2f}",
            stale=f"{m['staleness_mean']:.1f}",
            tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}",
        )
        if not bar.disable:
            return
        if log.version % cfg.logging.every_steps == 0:
            print(
                f"step {log.version}: reward {reward:.3f} solved {solved:.2f} loss {m['loss']:.4f} "
                f"staleness {m['staleness_mean']:.2f} len {m['response_len_mean']:.1f}",
                flush=True,
            )

    stop = _StopFlag()
    stop.install()
    bar.update(len(exp.grpo.log))
    result = run(
        exp,
        max(remaining, 0),
        on_step,
        checkpointer=checkpointer,
        every_steps=cfg.checkpoint.every_steps,
        should_stop=stop,
    )
    bar.close()
    writer.close()
    if not exp.stopped:
        evals.maybe(exp.runtime.steps_done)
    evals.close()
    rewards = [(sl.version, _reward(sl)) for sl in exp.grpo.log]  # the whole run, resumes too
    solved_curve = [(sl.version, _solved(sl)) for sl in exp.grpo.log]
    wall = time.perf_counter() - t_start
    oh = exp.backend.overheads
    plot_timeline(
        result.records,
        run_dir / "timeline.png",
        title=f"{o.mode}: rollout groups over time, coloured by policy version",
    )
    plot_timeline(
        head(result.records, 300),
        run_dir / "timeline_start.png",
        title=f"{o.mode}: the first 300 ticks",
    )
    reward_curve_plot(
        {"reward": rewards, "solved (exact answer)": solved_curve},
        run_dir / "reward.png",
        xlabel="train step",
    )
    write_summary(
        run_dir,
        summary=result.summary,
        records=result.records,
        rewards=rewards,
        wall_s=wall,
        overheads={
            "weight_transfer_s": oh.weight_transfer_s,
            "migration_s": oh.migration_s,
            "warm_start_s": t_run - t_start,
            "eval_s": evals.seconds,
        },
        held_out=[dataclasses.asdict(r) for r in evals.results],
        extra={
            "reward_errors": exp.reward.errors,
            "config": "config.yaml",
            "stopped_early": exp.stopped,
            "request_states": _counts(result.ledger),
            "consumed_request_ids": [c.request_id for c in result.records.consumed],
        },
    )
    if exp.stopped:
        print(
            f"stopped at step {exp.runtime.steps_done} with a checkpoint in {ckpt_dir}; "
            f"continue with: python launch/train.py --resume run_dir={cfg.run_dir}"
        )
    s = result.summary
    print(
        f"done in {wall:.0f} s: {s.steps} steps, {s.trajectories} trajectories, "
        f"bubble {s.bubble:.1%}, staleness mean {s.staleness_mean:.2f} max {s.staleness_max}, "
        f"{s.migrated} migrated, {s.reprefill_tokens} re-prefill tokens"
    )
    k = max(1, len(rewards) // 5)
    first = float(np.mean([r for _, r in rewards[:k]]))
    last = float(np.mean([r for _, r in rewards[-k:]]))
    s0 = float(np.mean([x for _, x in solved_curve[:k]]))
    s1 = float(np.mean([x for _, x in solved_curve[-k:]]))
    print(
        f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
        f"solved (exact answer): {s0:.3f} -> {s1:.3f}"
    )
    if len(evals.results) >= 2:
        e0, e1 = evals.results[0], evals.results[-1]
        n = len(exp.evaluator.prompts)
        print(
            f"held-out eval ({n} problems, one sample each): solved {e0.solved:.3f} at step "
            f"{e0.step} -> {e1.solved:.3f} at step {e1.step} (+-{binomial_se(e1.solved, n):.3f}); "
            f"mean response {e0.response_len:.1f} -> {e1.response_len:.1f} tokens"
        )
    print(
        f"wrote {run_dir / 'summary.md'}, {run_dir / 'timeline.png'}, {run_dir / 'metrics.jsonl'}"
    )
    return 0


class _HeldOutEval:
    """Runs the experiment's held-out evaluation when due and appends it to ``eval.jsonl``
    (a resumed run keeps the evaluations up to its checkpoint)."""

    FILE = "eval.jsonl"

    def __init__(self, exp, run_dir: Path, cfg: ExperimentConfig, resume: bool):
        from dora_jax.metrics import MetricsWriter, read_metrics
        from dora_jax.pipeline.evaluation import EvalResult

        self.exp, self.results, self.seconds = exp, [], 0.0
        self.writer = None
        if exp.evaluator is None:
            return
        path = run_dir / self.FILE
        if resume and path.is_file():
            kept = [r for r in read_metrics(path) if r["step"] <= exp.runtime.steps_done]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.results = [EvalResult.from_metrics(r["step"], r) for r in kept]
        elif path.is_file():
            path.unlink()
        self.writer = MetricsWriter(
            run_dir, cfg.logging.tensorboard, filename=self.FILE, tb_dir="tb/eval"
        )

    def maybe(self, step: int, *, echo=print) -> None:
        """Evaluate the trainer's current params at ``step`` unless that step has a result."""
        if self.writer is None or any(r.step == step for r in self.results):
            return
        r = self.exp.evaluate(step)
        self.results.append(r)
        self.seconds += r.seconds
        self.writer.write(step, r.metrics())
        echo(
            f"held-out eval at step {step}: solved {r.solved:.3f} reward {r.reward:.3f} "
            f"response {r.response_len:.1f} tokens ({r.seconds:.1f} s)"
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _counts(ledger: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in ledger.values():
        out[state] = out.get(state, 0) + 1
    return out


def _truncate_metrics(path: Path, keep: int) -> None:
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:keep]))


def _reward(log) -> float:
    return float(np.mean(log.rewards))


def _solved(log) -> float:
    """Share of full-mark trajectories (exact answers) in a step."""
    return float(np.mean([r >= 1.0 for r in log.rewards]))
