"""The ``train`` command: parse arguments, resolve the config, build meshes and the policy.

The RL loop (control plane, rollout engines, trainer) is wired in by the launch issue; until then
this command validates everything it can, writes the resolved config, and says plainly that
training is not built yet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dora_jax.config import ConfigError, ExperimentConfig, dump_yaml, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
MODES = ("sync", "one_step", "partial", "oversample", "dora")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python launch/train.py",
        description="GRPO-style RL post-training with DORA multi-version asynchronous rollout.",
    )
    p.add_argument("--config", type=Path, default=None,
                   help="YAML preset (default: configs/default.yaml)")  # fmt: skip
    p.add_argument("--mode", choices=MODES, help="shortcut for orchestrator.mode=MODE")
    p.add_argument("--resume", action="store_true", help="continue the run in run_dir")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides, e.g. train.lr=1e-6")  # fmt: skip
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"orchestrator.mode={args.mode}")
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

    from dora_jax.mesh import build_meshes
    from dora_jax.model import count_params

    try:
        meshes = build_meshes(cfg.mesh)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    print(f"dora_jax: mode={cfg.orchestrator.mode} K={cfg.orchestrator.staleness_k} "
          f"policy={cfg.model.family} ({count_params(cfg.model):,} params)")  # fmt: skip
    print(f"  trainer mesh {dict(meshes.trainer.shape)} on devices "
          f"{[d.id for d in meshes.trainer.devices.flat]}")  # fmt: skip
    for g, m in enumerate(meshes.groups):
        print(f"  rollout group {g}: tp={m.shape['model']} on devices "
              f"{[d.id for d in m.devices.flat]}")  # fmt: skip
    print(f"  resolved config written to {run_dir / 'config.yaml'}")
    print(
        "not built yet: the RL training loop (rollout engines, GRPO trainer, DORA control plane) "
        "is still under construction; this run checked the config and the device layout only."
    )
    return 0
