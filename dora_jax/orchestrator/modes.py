"""The five rollout paradigms as policies of one runtime loop.

| mode | K used | in flight | barrier | at a weight update, in-flight requests ... | planner |
|---|---|---|---|---|---|
| ``sync`` | 0 | TBS | yes | (none: rollout idles during training) | no |
| ``one_step`` | 1 | TBS | yes | finish under their version (one version per batch) | no |
| ``partial`` | K | RBS | no | are interrupted, re-prefilled, continue under the new one | no |
| ``oversample`` | 0 | RBS | yes | (none: once TBS are ready the rest are aborted, discarded) | no |
| ``dora`` | K | RBS | no | finish under their version; groups re-partitioned | yes |

*Barrier*: a rollout batch is dispatched whole, and only once the previous batch has finished.
The window's room (``versions.py``) does the rest: with K = 0 nothing is dispatched while the
trainer runs, which is what makes ``sync`` synchronous; with K = 1 one batch is generated under
the previous version while the trainer runs, which is ``one_step``.

In every mode but ``dora`` a group switches to the newest version as soon as it is empty and no
request of its version waits (``partial`` switches all groups at each update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dora_jax.config.schema import OrchestratorConfig

MODES = ("sync", "one_step", "partial", "oversample", "dora")


@dataclass(frozen=True)
class ModePolicy:
    name: str
    k: int  # staleness bound the window enforces
    rollout_batch: int  # prompt groups per batch (barrier) or kept in flight (continuous)
    per_step: int  # prompt groups a train step takes, as the window counts them
    barrier: bool
    on_update: Literal["keep", "reprefill"]
    abort_surplus: bool  # once TBS prompt groups are ready, abort and discard the rest
    planner: bool  # re-partition groups across versions, migrate requests
    legacy_fill: bool  # supplement older versions to fill their idle slots
    plan_on_idle: bool  # also plan when a ready group idles while other versions' requests wait


def policy_for(cfg: OrchestratorConfig) -> ModePolicy:
    """The policy of ``cfg.mode``; ``one_step`` needs ``staleness_k >= 1``."""
    tbs, rbs, k = cfg.train_batch_prompts, cfg.rollout_batch_prompts, cfg.staleness_k
    common = dict(abort_surplus=False, planner=False, legacy_fill=False, plan_on_idle=False)
    if cfg.mode == "sync":
        return ModePolicy("sync", 0, tbs, tbs, True, "keep", **common)
    if cfg.mode == "one_step":
        if k < 1:
            raise ValueError("one_step mode trains on the previous version: needs staleness_k >= 1")
        return ModePolicy("one_step", 1, tbs, tbs, True, "keep", **common)
    if cfg.mode == "partial":
        return ModePolicy("partial", k, rbs, tbs, False, "reprefill", **common)
    if cfg.mode == "oversample":
        common["abort_surplus"] = True
        return ModePolicy("oversample", 0, rbs, rbs, True, "keep", **common)
    if cfg.mode == "dora":
        return ModePolicy(
            "dora", k, rbs, tbs, False, "keep",
            abort_surplus=False, planner=True, legacy_fill=cfg.legacy_fill,
            plan_on_idle=cfg.plan_on_idle,
        )  # fmt: skip
    raise ValueError(f"unknown mode {cfg.mode!r}; expected one of {MODES}")
