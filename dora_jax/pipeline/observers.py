"""Observers of the run loop: what happens at every published version besides training.

- :class:`MetricsLog`: one ``metrics.jsonl`` line (and TensorBoard scalars, and Weights & Biases
  with ``logging.wandb``) per train step, and the progress bar (or a printed line every
  ``logging.every_steps`` steps without one). Besides the train step's numbers a line holds the
  mean reward, the solved share, the means of the reward function's extra metrics
  (``reward/<name>``) and the failed reward calls so far, in all and by kind
  (``reward_errors``, ``reward_errors/timeout``, ``/exception``, ``/invalid``, ``/crash``), and,
  since the last line, the rollout groups that failed and the requests recovered from them by
  source (``recovery/group_failures``, ``recovery/redispatched/{kv,tokens,prompt}``).
  Each step's first trajectories as text go to ``samples.jsonl``, TensorBoard and W&B, one of
  them to the terminal every ``logging.samples_every`` steps (:mod:`dora_jax.pipeline.samples`).
- :class:`HeldOutEval`: the held-out evaluation every ``eval.every_steps`` steps, appended to
  ``eval.jsonl``, every problem's prompt, response and reward to ``eval_samples.jsonl`` (a
  resumed run keeps the evaluations up to its checkpoint). On the wall clock it holds the run
  still (:meth:`Runtime.quiesce`) while it evaluates.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from dora_jax.config import ExperimentConfig
from dora_jax.metrics import METRICS_FILE, MetricsWriter, progress, read_metrics
from dora_jax.orchestrator.backend import RECOVERY_SOURCES as SOURCES
from dora_jax.pipeline.evaluation import EvalResult
from dora_jax.pipeline.experiment import Experiment
from dora_jax.pipeline.samples import EVAL_SAMPLES_FILE, SampleLog, append_rows, cut_eval_samples
from dora_jax.run_dir import cut_jsonl


def step_reward(log) -> float:
    return float(np.mean(log.rewards))


def step_solved(log) -> float:
    """Share of full-mark trajectories (exact answers) in a step."""
    return float(np.mean([r >= 1.0 for r in log.rewards]))


LAG_FIGURES = ("tokens", "ess", "clip_frac", "kl")


def lag_figures(m: dict) -> dict:
    """The train step's per-lag arrays (``lag_tokens``, ``lag_ess``, ...: one entry per
    staleness) as one figure per lag that had tokens this step, ``lag/<k>/<name>``."""
    arrays = {name: m.pop(f"lag_{name}", None) for name in LAG_FIGURES}
    for k, n in enumerate(arrays["tokens"] or ()):
        if n > 0:
            m |= {f"lag/{k}/{name}": arrays[name][k] for name in LAG_FIGURES}
    return m


class MetricsLog:
    """Writes every new step log of the trainer at the version's publication."""

    def __init__(self, exp: Experiment, run_dir: Path, resume: bool, mirror=None):
        cfg = exp.cfg
        self.exp, self.cfg = exp, cfg
        done = exp.runtime.steps_done  # published steps; a logical step may have run already
        path = run_dir / METRICS_FILE
        if resume:  # metrics.jsonl continues; drop lines past the checkpoint (each step once)
            cut_jsonl(path, done)
        elif path.is_file():
            path.unlink()
        self.writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, mirror=mirror)
        self.bar = progress(
            cfg.train.total_steps, f"GRPO ({cfg.orchestrator.mode})", enabled=cfg.logging.progress
        )
        self.bar.update(done)
        self.seen = done
        self._recovery: Counter = Counter()  # the backend's recovery counts at the last line
        lg = cfg.logging
        self.samples = SampleLog(
            run_dir,
            lg.samples_per_step,
            lg.samples_every,
            resume=resume,
            done=done,
            writer=self.writer,
            mirror=mirror,
            echo=self.echo,
        )
        self.t0 = time.perf_counter()
        self.tokens = 0

    def echo(self, text: str) -> None:
        (print if self.bar.disable else self.bar.write)(text)

    def on_publish(self, runtime, version: int) -> None:
        for log in self.exp.grpo.step_logs(self.seen):
            if log.version > version:
                break
            self.write(log)
            self.seen += 1

    def recovery_figures(self) -> dict[str, int]:
        """Since the last line: rollout groups that failed (their engine or their process) and
        the requests recovered from them by source (``recovery/redispatched/<source>``)."""
        b = getattr(self.exp.backend, "recovery", None)
        if b is None:
            return {}
        now = Counter(b.recoveries)
        now["group_failures"] = sum(b.restarts) + sum(b.host_losses)
        now["groups_left"] = sum(b.host_leaves)
        out = {f"recovery/redispatched/{src}": now[src] - self._recovery[src] for src in SOURCES}
        for k in ("group_failures", "groups_left"):
            out[f"recovery/{k}"] = now[k] - self._recovery[k]
        self._recovery = now
        return out

    def write(self, log) -> None:
        m = lag_figures({k: np.asarray(v).tolist() for k, v in log.metrics.items()})
        reward, solved = step_reward(log), step_solved(log)
        self.tokens += int(m["num_tokens"])
        elapsed = time.perf_counter() - self.t0
        scorer = self.exp.reward
        errors = {f"reward_errors/{k}": v for k, v in scorer.error_counts().items()}
        # the reward function's extra metrics; a multi-turn run's per-trajectory means (env/...)
        extra = {
            (k if k.startswith("env/") else f"reward/{k}"): v for k, v in log.reward_metrics.items()
        }
        extra |= self.recovery_figures()
        if self.exp.env is not None:  # cumulative: failures by kind, conversations, turns
            extra |= self.exp.env.figures()  # and the conversations waiting on it now
            extra["env/waiting_requests"] = float(self.exp.backend.waiting_requests())
        self.writer.write(
            log.version,
            {
                **m,
                "reward": reward,
                "solved": solved,
                "elapsed_s": elapsed,
                "reward_errors": scorer.errors,
                **errors,
                **extra,
                **log.timing,
            },
        )
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{reward:.2f}",
            solved=f"{solved:.2f}",
            stale=f"{m['staleness_mean']:.1f}",
            tok_s=f"{self.tokens / max(elapsed, 1e-9):.0f}",
        )
        if self.bar.disable and log.version % self.cfg.logging.every_steps == 0:
            print(
                f"step {log.version}: reward {reward:.3f} solved {solved:.2f} "
                f"loss {m['loss']:.4f} staleness {m['staleness_mean']:.2f} "
                f"len {m['response_len_mean']:.1f}",
                flush=True,
            )
        self.samples.write(log.version, log.samples)  # (after the step's line)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


class HeldOutEval:
    """Evaluates the trainer's params when due and appends the result to ``eval.jsonl``."""

    FILE = "eval.jsonl"

    def __init__(
        self,
        exp: Experiment,
        run_dir: Path,
        cfg: ExperimentConfig,
        resume: bool,
        echo=print,
        mirror=None,
    ):
        self.exp, self.every, self.echo = exp, cfg.eval.every_steps, echo
        self.samples_path = run_dir / EVAL_SAMPLES_FILE
        self.results: list[EvalResult] = []
        self.seconds = 0.0
        self.writer = None
        if exp.evaluator is None:
            return
        path, done = run_dir / self.FILE, exp.runtime.steps_done
        if resume and path.is_file():
            cut_jsonl(path, done)
            kept = read_metrics(path)
            self.results = [EvalResult.from_metrics(r["step"], r) for r in kept]
        elif path.is_file():
            path.unlink()
        cut_eval_samples(run_dir, resume, {r.step for r in self.results}, done)
        self.writer = MetricsWriter(
            run_dir, cfg.logging.tensorboard, filename=self.FILE, tb_dir="tb/eval", mirror=mirror
        )

    def on_publish(self, runtime, version: int) -> None:
        if version % self.every == 0:
            with runtime.quiesce():
                self.at(version)

    def at(self, step: int) -> None:
        """Evaluate the trainer's current params at ``step`` unless that step has a result."""
        if self.writer is None or any(r.step == step for r in self.results):
            return
        r = self.exp.evaluate(step)
        self.results.append(r)
        self.seconds += r.seconds
        append_rows(self.samples_path, step, r.samples)  # before eval.jsonl's line: see resume
        self.writer.write(step, r.metrics())
        at_k = "".join(f" {k} {v:.3f}" for k, v in r.at_k.items())
        self.echo(
            f"held-out eval at step {step}: solved {r.solved:.3f} reward {r.reward:.3f}{at_k} "
            f"response {r.response_len:.1f} tokens ({r.seconds:.1f} s)"
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
