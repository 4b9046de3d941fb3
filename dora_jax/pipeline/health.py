"""The run's health at every published step: skipped steps and a dead policy.

- A step whose loss or gradient is not finite is skipped by the train step's guard (params and
  optimizer state unchanged); :class:`RunHealth` says so, counts it (``summary.json``), and after
  ``train.max_consecutive_skips`` skips in a row stops the run before another step starts (it
  saves a checkpoint and the command exits 1 with a message): the policy will not recover by
  itself.
- A failure budget: after ``data.max_failed_steps`` train steps in a row with at least
  ``data.max_failed_share`` of their samples failed (the reward function's call or the
  environment's: ``failed_samples``), the run stops the same way, naming the reward function or
  environment and its last error: it trains on nothing until that is fixed.
- A collapse detector warns when, for :data:`DEAD_STEPS` steps in a row, the policy's entropy is
  within 2% of ``ln(vocab_size)`` (it outputs near-uniform noise) or the gradient norm is zero
  while the advantages are not (a saturated policy that no longer learns). It warns once per
  episode and does not stop the run; when the step's samples failed their calls, it says so
  rather than blame the learning rate.

Everything it counts is derived from the step metrics, so a resumed run continues the counts
from the ``metrics.jsonl`` lines of the steps before its checkpoint (``history``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dora_jax.pipeline.experiment import Experiment

DEAD_STEPS = 3
UNIFORM_FRACTION = 0.98
_READ = ("skipped", "loss", "grad_norm", "entropy", "advantage_abs_mean", "failed_samples")


class RunHealth:
    def __init__(self, exp: Experiment, echo=print, history: list[dict] = ()):
        self.exp, self.echo = exp, echo
        self.max_skips = exp.cfg.train.max_consecutive_skips
        self.ln_vocab = math.log(exp.cfg.model.vocab_size)
        self.skipped_steps: list[int] = []
        self.warnings: list[str] = []
        self.tripped: str | None = None  # why the run must stop
        self._streak = 0
        d, o = exp.cfg.data, exp.cfg.orchestrator
        self.max_failed, self.failed_share = d.max_failed_steps, d.max_failed_share
        self.samples = o.train_batch_prompts * exp.cfg.train.group_size  # a step's
        self._failed_streak = 0
        self._dead: list[str] = []  # signs of a dead policy, one per step in a row
        self._warned = False
        done = exp.runtime.steps_done
        self.seen = done
        for line in history:  # the run so far (a resume: metrics.jsonl lines), silently
            if line["step"] <= done:
                self._check(line, line["step"], quiet=True)

    def on_publish(self, runtime, version: int) -> None:
        for log in self.exp.grpo.step_logs(self.seen):
            if log.version > version:
                break
            self._check(log.metrics, log.version)
            self.seen += 1
        if self.tripped is not None:
            # Stop now: the round that published the tripping step would start the next one
            # (which would be skipped too), and the run's stop check comes between rounds.
            runtime.stopping = runtime.stopped = True

    def _check(self, metrics: dict, step: int, quiet: bool = False) -> None:
        m = {k: np.asarray(v) for k, v in metrics.items() if k in _READ}
        failed = int(m.get("failed_samples", 0))
        if self._check_failures(failed, step, quiet):
            return
        if int(m["skipped"]):
            self._streak += 1
            self.skipped_steps.append(step)
            if not quiet:
                self.echo(
                    f"warning: step {step} skipped: loss {float(m['loss']):.4g}, grad norm "
                    f"{float(m['grad_norm']):.4g} (not finite); params unchanged "
                    f"({self._streak} in a row, {len(self.skipped_steps)} in all)"
                )
            if self.max_skips and self._streak >= self.max_skips:
                first = self.skipped_steps[-self._streak]
                self.tripped = (
                    f"{self._streak} train steps in a row were skipped (steps {first}-{step}: the "
                    f"loss or gradient was not finite), so the policy will not recover; the run "
                    f"stopped with a checkpoint. Lower train.lr (now "
                    f"{self.exp.cfg.train.lr:g}) or train.max_grad_norm and start again, or "
                    "resume from an earlier checkpoint with --resume and a smaller train.lr"
                )
            return
        self._streak = 0
        sign = self._dead_sign(m)
        self._dead = [*self._dead, sign][-DEAD_STEPS:] if sign else []
        if sign is None:
            self._warned = False
        elif len(self._dead) >= DEAD_STEPS and not self._warned:
            self._warned = True
            cause = (
                f"{failed} of the step's {self.samples} samples failed their reward or "
                "environment call (reward_errors, env/failures in metrics.jsonl): check those "
                "first"
                if failed
                else f"check train.lr (now {self.exp.cfg.train.lr:g})"
            )
            text = (
                f"warning: the policy looks dead at step {step}: {sign} for {DEAD_STEPS} steps "
                f"in a row; {cause}"
            )
            self.warnings.append(text)
            if not quiet:
                self.echo(text)

    def _check_failures(self, failed: int, step: int, quiet: bool) -> bool:
        """Count a step whose failed share is over the budget's; True once the run must stop
        (never while replaying a resumed run's history: its next step decides)."""
        if failed < self.failed_share * self.samples:
            self._failed_streak = 0
            return False
        self._failed_streak += 1
        if quiet or not self.max_failed or self._failed_streak < self.max_failed:
            return False
        first = step - self._failed_streak + 1
        share = "every sample" if failed == self.samples else f"{failed} of {self.samples} samples"
        self.tripped = (
            f"{self._failed_streak} train steps in a row (steps {first}-{step}) had {share} "
            f"fail: {self._culprits()}; they score 0 and the run trains on nothing, so it "
            "stopped with a checkpoint: fix that (or raise data.max_failed_steps) before you "
            "continue"
        )
        return True

    def _culprits(self) -> str:
        """The reward function and environment that failed, each with its last error."""
        out = []
        reward = self.exp.reward
        if reward.errors:
            out.append(f"the reward function {self.exp.cfg.data.reward} ({reward.last_error})")
        env = self.exp.env
        if env is not None and env.driver.last_error is not None:
            out.append(f"the environment {self.exp.cfg.env.spec} ({env.driver.last_error})")
        return " and ".join(out) or "their reward or environment calls"

    def _dead_sign(self, m: dict) -> str | None:
        entropy, grad = float(m["entropy"]), float(m["grad_norm"])
        if entropy >= UNIFORM_FRACTION * self.ln_vocab:
            return (
                f"entropy {entropy:.3f} nats = {entropy / self.ln_vocab:.0%} of ln(vocab_size) "
                f"= {self.ln_vocab:.3f} (near-uniform output), grad norm {grad:.3g}"
            )
        if grad <= 1e-10 and float(m["advantage_abs_mean"]) > 1e-6:
            return (
                f"grad norm {grad:.3g} with non-zero advantages (saturated), entropy {entropy:.3f}"
            )
        return None


class NoRolloutGroups:
    """A run with no rollout group in it: every group's process died (a two-process layout
    whose rollout host is lost) or every engine failed for good. Nothing can be generated, so
    instead of stepping empty groups forever it waits ``orchestrator.no_groups_wait_s`` seconds
    for a group to come back (a process started again with its own command), saying so with a
    countdown, then stops the run (:attr:`tripped`; the run saves a checkpoint). A group coming
    back (building its engine, loading a version) holds the countdown; one in the run resets it.
    Call it between rounds (``should_stop``)."""

    EVERY_S = 30.0  # seconds between the countdown's lines

    def __init__(
        self,
        exp: Experiment,
        run_dir: Path,
        echo=print,
        now: Callable[[], float] = time.monotonic,
    ):
        self.exp, self.run_dir, self.echo, self.now = exp, Path(run_dir), echo, now
        self.wait_s = exp.cfg.orchestrator.no_groups_wait_s
        self.tripped: str | None = None
        self._since: float | None = None  # when the run last had no group and none coming back
        self._said = 0.0

    def __call__(self) -> bool:
        backend = self.exp.backend
        if not hasattr(backend, "recovery") or backend.groups():
            self._since = None
            return False
        out = backend.recovery.out_of_run()
        if any(state != "dead" for state in out.values()):  # coming back: wait for it
            self._since = None
            return False
        t = self.now()
        if self._since is None:
            self._since, self._said = t, t
            self.echo(
                f"warning: {self._why()}: waiting up to {self.wait_s:.0f} s {self._how()}, then "
                "the run stops with a checkpoint"
            )
            return False
        left = self.wait_s - (t - self._since)
        if left <= 0:
            self.tripped = (
                f"{self._why()}, and none came back in {self.wait_s:.0f} s "
                "(orchestrator.no_groups_wait_s): the run stopped with a checkpoint"
            )
            return True
        if t - self._said >= self.EVERY_S:
            self._said = t
            self.echo(f"waiting {left:.0f} s more {self._how()}")
        return False

    def _why(self) -> str:
        hosts = self.exp.backend.recovery.lost_hosts()
        if hosts:
            names = ", ".join(str(h) for h in hosts)
            return f"no rollout group is left in the run (process {names} is gone)"
        return "no rollout group is left in the run (every engine failed)"

    def _how(self) -> str:
        hosts = self.exp.backend.recovery.lost_hosts()
        if not hosts:
            return "(a failed engine does not come back by itself)"
        logs = self.run_dir / "logs"
        cmds = [logs / f"process_{h}.cmd" for h in hosts if (logs / f"process_{h}.cmd").is_file()]
        where = f" ({', '.join(map(str, cmds))})" if cmds else ""
        names = ", ".join(str(h) for h in hosts)
        return f"for process {names} to be started again with its own command{where}"
