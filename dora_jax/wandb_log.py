"""Weights & Biases as an optional logger beside ``metrics.jsonl`` and TensorBoard.

:class:`WandbLog` mirrors what :class:`~dora_jax.metrics.MetricsWriter` writes, under the same
names and steps: numbers as scalars (nested dicts flattened with ``/``), numeric lists as
histograms; each step's sampled completions as a table (:meth:`WandbLog.log_table`).
``logging.wandb_project``, ``wandb_name`` (default: the run directory's name) and
``wandb_tags`` name the run; the resolved config is its config. With ``WANDB_MODE=offline`` the
run is written under ``run_dir/wandb/`` and needs no network (``wandb sync`` uploads it later).
Only process 0 of a multi-process run logs (the others never build a logger).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dora_jax.config import ConfigError, ExperimentConfig, to_dict
from dora_jax.metrics import flatten_metrics, is_number


class WandbLog:
    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb", "needs the wandb package (pip install 'dora-jax[wandb]')"
            ) from None
        self._wandb = wandb
        lg = cfg.logging
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=lg.wandb_project,
            name=lg.wandb_name or run_dir.resolve().name,
            tags=list(lg.wandb_tags),
            dir=str(run_dir),
            config=to_dict(cfg),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        data: dict[str, Any] = {}
        for key, v in flatten_metrics(metrics).items():
            if is_number(v):
                data[key] = float(v)
            elif isinstance(v, list | tuple | np.ndarray) and len(v):
                values = np.asarray(v, dtype=object).ravel()
                if all(is_number(e) for e in values):
                    arr = values.astype(np.float64)
                    arr = arr[np.isfinite(arr)]
                    if arr.size:
                        data[key] = self._wandb.Histogram(arr)
        self._send(data, step)

    def log_table(
        self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """A table (``rows`` of plain values under ``columns``) under ``key`` at ``step``."""
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self._send({key: table}, step)

    def _send(self, data: dict[str, Any], step: int) -> None:
        """``run.log``; one that fails (the service gone, a full disk under its files) is a
        warning and W&B is off from then on: the run and its metrics.jsonl go on."""
        if self.run is None:
            return
        try:
            self.run.log(data, step=int(step))
        except Exception as e:  # noqa: BLE001  (wandb raises its own types, and OSError)
            run, self.run = self.run, None
            print(
                f"warning: W&B logging failed at step {step} ({type(e).__name__}: {e}): the run "
                "goes on, its metrics in metrics.jsonl only",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                print(f"warning: W&B did not finish cleanly ({type(e).__name__}: {e})", flush=True)
