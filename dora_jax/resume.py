"""What ``--resume`` runs with: the checkpoint's config, changed only where the command line says
so, and only where the change can be carried out.

:func:`resolve` reads the config saved with the newest checkpoint of ``run_dir`` (or its
``config.yaml`` when no checkpoint was finished yet), applies ``--config FILE`` (when given) and
the dotted overrides on top, and compares the result with the saved config field by field. Each
changed field is looked up in :data:`RULES`:

- ``apply``: the resumed run uses the new value for real (the trainer's optimizer and schedule,
  the control plane's mode policy, window bound and batch sizes, the observers' cadences are all
  rebuilt from the config, while the checkpoint brings back their state);
- ``refuse``: the run stops before anything is written, with a :class:`ConfigError` naming the
  field and why the checkpoint cannot take the change.

Some applied changes also depend on the restored state: :func:`check_restored` refuses a
``train.total_steps`` below the steps already done, and a mode, K or TBS under which the prompt
groups in flight could not all be consumed within the staleness bound (naming the field and the
smallest value that works). The table is in ``docs/reliability.md``; ``tests/test_resume.py``
keeps it equal to :data:`RULES`, field by field.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from dora_jax.config import ConfigError, ExperimentConfig, from_dict, to_dict
from dora_jax.config.loading import apply_overrides, load_yaml, parse_override

APPLY, REFUSE = "apply", "refuse"
# reasons shared by several fields
_LAYOUT = "it changes the layout of the saved train state"
_FAILURE_BUDGET = "the stop rule for failing rewards and environments, from the next train step on"
_REWARD_POOL = (
    "the reward worker pool is started afresh from the config; rewards are computed when "
    "trajectories are consumed"
)
_ENV_POOL = (
    "the environment worker pool is started afresh from the config; episodes in flight are "
    "rebuilt on it from their seed, task and actions"
)
_RECOVERY = "how a failed rollout group's requests are recovered from now on (not what they sample)"
_ENV_LIMITS = "the episode limits of conversations from now on, those in flight included"

# (field or section prefix, action, why): the first entry that matches a field decides.
RULES: tuple[tuple[str, str, str], ...] = (
    ("run_dir", APPLY, "the directory being resumed (a moved run dir keeps working)"),
    ("seed", REFUSE, "the prompt order and every request's sampling key derive from it"),
    ("model.remat", APPLY, "rematerialisation changes memory and speed, not results"),
    ("model.", REFUSE, "the checkpoint's params, optimizer state and KV pages have this model"),
    ("mesh.", REFUSE, "the checkpoint's requests and KV pages live on these groups and devices"),
    ("rollout.backup_every_steps", APPLY, _RECOVERY),
    ("rollout.max_group_restarts", APPLY, _RECOVERY),
    ("rollout.", REFUSE, "requests in flight were sampled and their KV pages laid out under it"),
    ("train.group_size", REFUSE, "prompt groups in flight have this many members"),
    ("train.fp32_master_weights", REFUSE, _LAYOUT),
    ("train.adam_moment_dtype", REFUSE, _LAYOUT),
    (
        "train.kl_beta",
        APPLY,
        "applied while it stays > 0 (turning the KL penalty on or off changes the saved train "
        "state: refused)",
    ),
    (
        "train.",
        APPLY,
        "the optimizer, schedule and loss are rebuilt from the config; the optimizer state and "
        "step count come from the checkpoint",
    ),
    ("orchestrator.clock", REFUSE, "a run's records and timeline are on one clock"),
    (
        "orchestrator.",
        APPLY,
        "the mode policy, window and batch sizes are rebuilt; the ledger, queue and window "
        "contents come from the checkpoint",
    ),
    ("data.reward", APPLY, "rewards are computed when trajectories are consumed"),
    ("data.reward_timeout_s", APPLY, _REWARD_POOL),
    ("data.reward_workers", APPLY, _REWARD_POOL),
    (
        "data.on_failure",
        APPLY,
        "what a failed reward or environment call does to its group's advantages, from the next "
        "train step on (neither the model nor the prompt stream depends on it)",
    ),
    ("data.max_failed_steps", APPLY, _FAILURE_BUDGET),
    ("data.max_failed_share", APPLY, _FAILURE_BUDGET),
    ("data.", REFUSE, "the checkpoint's prompt cursor indexes this prompt stream"),
    ("warm_start.", REFUSE, "the warm start is over: the checkpoint holds the policy"),
    ("eval.every_steps", APPLY, "the evaluation cadence from the next step on"),
    ("eval.", REFUSE, "earlier evaluations in eval.jsonl used this held-out set"),
    ("checkpoint.", APPLY, "the checkpoint cadence and retention from now on"),
    ("logging.", APPLY, "logging from now on"),
    ("env.workers", APPLY, _ENV_POOL),
    ("env.timeout_s", APPLY, _ENV_POOL),
    ("env.max_workers", APPLY, _ENV_POOL),
    ("env.max_turns", APPLY, _ENV_LIMITS),
    ("env.max_env_seconds", APPLY, _ENV_LIMITS),
    ("env.reward", APPLY, "rewards are computed when conversations end"),
    (
        "env.",
        REFUSE,
        "the episodes in flight, their token budgets and the prompt cursor belong to this "
        "environment",
    ),
)


@dataclasses.dataclass(frozen=True)
class Change:
    path: str
    old: Any
    new: Any
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


def rule(path: str) -> tuple[str, str]:
    """``(action, why)`` for a dotted field path."""
    for prefix, action, why in RULES:
        if path == prefix or (prefix.endswith(".") and path.startswith(prefix)):
            return action, why
    raise KeyError(f"no resume rule covers {path}")  # a field added without a rule


def leaf_fields(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted field path of the config (sections expanded; optional sub-configs such as
    ``model.rope_scaling`` count as one field)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_fields(hints[f.name], path + ".")
        else:
            out.append(path)
    return out


def _get(tree: dict, path: str) -> Any:
    for part in path.split("."):
        tree = tree[part]
    return tree


def changes(saved: ExperimentConfig, new: ExperimentConfig) -> list[Change]:
    """The fields that differ, in field order; refused ones raise :class:`ConfigError`."""
    a, b = to_dict(saved), to_dict(new)
    out = []
    for path in leaf_fields():
        old, now = _get(a, path), _get(b, path)
        if old == now:
            continue
        action, why = rule(path)
        if path == "train.kl_beta" and (old > 0) != (now > 0):
            action, why = REFUSE, "turning the KL penalty on or off changes the saved train state"
        if action == REFUSE:
            raise ConfigError(
                path,
                f"the checkpoint has {old!r} but the config says {now!r}: cannot change on "
                f"resume ({why})",
            )
        if path != "run_dir":
            out.append(Change(path, old, now, why))
    return out


# -- finding the saved config ----------------------------------------------------------------


def run_dir_of(config_path: Path | None, overrides: list[str]) -> Path:
    """The run directory a command names: a ``run_dir=`` override, else the config file's."""
    for text in reversed(overrides):
        parts, _ = parse_override(text)
        if parts == ["run_dir"]:
            return Path(text.split("=", 1)[1].strip())
    if config_path is not None:
        data = load_yaml(config_path)
        if isinstance(data.get("run_dir"), str):
            return Path(data["run_dir"])
    return Path(ExperimentConfig().run_dir)


def saved_config(run_dir: Path) -> tuple[dict[str, Any], str, bool]:
    """``(config as a dict, where it came from, whether a checkpoint holds it)``: the newest
    finished checkpoint's config, else ``run_dir/config.yaml``. Reads only."""
    from dora_jax.checkpoint import peek_configs

    nothing = "nothing to resume (run without --resume to start a run there)"
    if not run_dir.is_dir():
        raise ConfigError("run_dir", f"{run_dir} does not exist: {nothing}")
    for step, cfg in peek_configs(run_dir / "checkpoints"):
        if cfg is not None:
            return cfg, f"checkpoint {run_dir / 'checkpoints' / str(step)}", True
    path = run_dir / "config.yaml"
    if path.is_file():
        return load_yaml(path), str(path), False
    raise ConfigError("run_dir", f"{run_dir} holds no checkpoint and no config.yaml: {nothing}")


def resolve(
    config_path: Path | None, overrides: list[str], default_config: Path | None = None
) -> tuple[ExperimentConfig, list[Change], str, bool]:
    """The resumed run's config: ``(config, changes applied, where the saved config came from,
    whether a checkpoint holds it)``; a refused change raises :class:`ConfigError`. The run dir
    is a ``run_dir=`` override's, else ``config_path``'s, else ``default_config``'s."""
    run_dir = run_dir_of(config_path or default_config, overrides)
    data, source, from_checkpoint = saved_config(run_dir)
    try:
        saved = from_dict(ExperimentConfig, data)
    except ConfigError as e:
        raise ConfigError(e.path, f"{e.reason} (in the saved config of {source})") from None
    layered = to_dict(saved)
    if config_path is not None:
        layered = _merge(layered, load_yaml(config_path))
    layered = apply_overrides(layered, overrides, ExperimentConfig)
    layered["run_dir"] = str(run_dir)
    try:
        cfg = from_dict(ExperimentConfig, layered)
    except ConfigError as e:
        given = " ".join(overrides) or "none"
        where = f"{config_path} and " if config_path is not None else ""
        raise ConfigError(
            e.path, f"{e.reason} (the saved config with {where}the overrides: {given})"
        ) from None
    return cfg, changes(saved, cfg), source, from_checkpoint


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# -- checks that need the restored state -----------------------------------------------------


def check_restored(cfg: ExperimentConfig, runtime, changed: list[Change]) -> None:
    """After the checkpoint is restored: refuse what the restored state cannot run under."""
    done = runtime.steps_done
    if cfg.train.total_steps < done:
        raise ConfigError(
            "train.total_steps",
            f"the checkpoint has done {done} steps; resume with "
            f"train.total_steps >= {done}, not {cfg.train.total_steps}",
        )
    w = runtime.window
    bad = w.bound_violation()
    if bad is None:
        return
    names = {c.path for c in changed}
    field = next(
        (
            f
            for f in (
                "orchestrator.staleness_k",
                "orchestrator.train_batch_prompts",
                "orchestrator.rollout_batch_prompts",
                "orchestrator.mode",
            )
            if f in names
        ),
        "orchestrator.staleness_k",
    )
    raise ConfigError(
        field,
        f"under mode {runtime.mode.name} (K={w.k}, {w.per_step} prompt groups per step) the "
        f"prompt groups in flight cannot all be consumed within the staleness bound (versions "
        f"{w.live_versions()} open, the next step at v{w.consume_version}, v{bad} over the bound);"
        f" this checkpoint needs K >= {w.smallest_k()} with these batch sizes",
    )
