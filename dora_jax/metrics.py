"""Run metrics: one JSON object per line in ``metrics.jsonl``, optional TensorBoard, progress bar.

:class:`MetricsWriter` appends ``{"step": step, **metrics}`` to ``run_dir/metrics.jsonl`` (one
line per :meth:`~MetricsWriter.write`, flushed at once so a crashed run keeps what it logged)
and, when ``tensorboard=True``, mirrors the numbers to an event file under ``run_dir/tb/``
(tensorboardX's summaries and record format, written in the caller's thread: a write that fails,
a full disk say, is a warning and TensorBoard is off from then on, the JSONL going on; a writer
thread that died would leave the run blocked on its queue).

JSON encoding (:func:`json_safe`): numpy scalars and arrays become Python numbers and lists;
``NaN`` is written as ``null``, ``+inf`` / ``-inf`` as the strings ``"inf"`` / ``"-inf"``.
:func:`read_metrics` turns ``null`` back into ``nan`` and those strings back into infinities,
so a float metric round-trips (a ``None`` written on purpose also reads back as ``nan``).

TensorBoard: a number (bool, int, float, numpy scalar) is an ``add_scalar`` under its key; a
nested dict is flattened with ``/`` (``{"loss": {"pg": x}}`` is the scalar ``loss/pg``); a
non-empty list / tuple / array of finite numbers is an ``add_histogram``; strings, empty lists
and lists holding anything but numbers are skipped (they are in the JSONL only);
:meth:`MetricsWriter.write_text` adds a text (the sampled completions). tensorboardX
is imported only when ``tensorboard=True``; if it is missing the writer warns and goes on with
the JSONL alone. A ``mirror`` (Weights & Biases, :mod:`dora_jax.wandb_log`) is given every
record too, under the same names.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"

_INF_STR = {"inf": math.inf, "-inf": -math.inf}


def json_safe(x: Any) -> Any:
    """``x`` with numpy values turned into Python ones and non-finite floats into JSON values:
    ``nan`` -> ``None``, ``inf`` -> ``"inf"``, ``-inf`` -> ``"-inf"``. Dict keys become strings."""
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, bool | int | str) or x is None:
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write a {type(x).__name__} as a metric: {x!r}")


def _restore(x: Any) -> Any:
    if x is None:
        return math.nan
    if isinstance(x, str) and x in _INF_STR:
        return _INF_STR[x]
    if isinstance(x, list):
        return [_restore(v) for v in x]
    if isinstance(x, dict):
        return {k: _restore(v) for k, v in x.items()}
    return x


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a ``metrics.jsonl`` (``path`` is the file or the run directory), in order.

    ``null`` reads back as ``nan`` and ``"inf"`` / ``"-inf"`` as infinities (at any depth). A
    torn last line (a run killed mid-write) is skipped; a malformed line elsewhere raises.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    lines = p.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
        out.append({k: (v if k == "step" else _restore(v)) for k, v in rec.items()})
    return out


def is_number(x: Any) -> bool:
    return isinstance(x, bool | int | float | np.bool_ | np.integer | np.floating)


def binomial_se(p: float, n: int) -> float:
    """Standard error of a share ``p`` measured on ``n`` independent problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(flatten_metrics(v, key + "/"))
        else:
            flat[key] = v
    return flat


class MetricsWriter:
    """Appends metric records to ``run_dir/metrics.jsonl`` and, optionally, TensorBoard events."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        *,
        filename: str = METRICS_FILE,
        tb_dir: str = TB_DIR,
        mirror=None,
    ):
        self.mirror = mirror  # also given every record, e.g. dora_jax.wandb_log.WandbLog
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                import tensorboardX  # noqa: F401  (its summaries and record format, below)
            except ImportError:
                warnings.warn(
                    "tensorboardX is not installed: metrics go to metrics.jsonl only",
                    stacklevel=2,
                )
            else:
                self._tb = _EventFile(self.run_dir / tb_dir)

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log ``metrics`` at ``step``: one JSONL line ``{"step": step, **metrics}`` and the
        numbers (scalars) and numeric lists (histograms) to TensorBoard; see the module doc."""
        if self._file.closed:
            raise ValueError("MetricsWriter is closed")
        if "step" in metrics:
            raise ValueError("'step' is the writer's own key; pass it as the step argument")
        step = int(step)
        record = json_safe({"step": step, **metrics})
        self._file.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._write_tb(step, metrics)
        if self.mirror is not None:
            self.mirror.log(step, metrics)

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A text (markdown) under ``tag`` at ``step`` in TensorBoard (nothing without it; the
        JSONL holds numbers only)."""
        if self._tb is not None:
            from tensorboardX.summary import text as summary

            self._guarded(lambda: self._tb.write([summary(tag, text)], int(step)))

    def _write_tb(self, step: int, metrics: Mapping[str, Any]) -> None:
        from tensorboardX.summary import histogram, scalar

        summaries = []
        for key, v in flatten_metrics(metrics).items():
            if is_number(v):
                summaries.append(scalar(key, float(v)))
            elif isinstance(v, list | tuple | np.ndarray) and len(v):
                if not all(is_number(e) for e in np.asarray(v, dtype=object).ravel()):
                    continue
                arr = np.asarray(v, dtype=np.float64).ravel()
                arr = arr[np.isfinite(arr)]
                if arr.size:
                    summaries.append(histogram(key, arr, "auto"))
        self._guarded(lambda: self._tb.write(summaries, step))

    def _guarded(self, write) -> None:
        """Run a TensorBoard write; one that fails turns TensorBoard off with a warning."""
        try:
            write()
        except OSError as e:
            tb, self._tb = self._tb, None
            print(
                f"warning: TensorBoard events cannot be written to {tb.path} "
                f"({e.strerror or e}): from now on the metrics go to {self.path} only",
                file=sys.stderr,
                flush=True,
            )
            tb.abandon()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._guarded(self._tb.close)
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EventFile:
    """One TensorBoard event file written in the caller's thread (tensorboardX's record format):
    a failed write raises ``OSError`` here rather than in a writer thread."""

    def __init__(self, logdir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(logdir / "events"))
        self.path = Path(self._writer._file_name)

    def write(self, summaries: list, step: int) -> None:
        from tensorboardX.proto import event_pb2

        now = time.time()
        for summary in summaries:
            self._writer.write_event(event_pb2.Event(summary=summary, step=step, wall_time=now))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def abandon(self) -> None:
        """Close without raising (after a failed write)."""
        with contextlib.suppress(OSError):
            self._writer.close()


def progress(total: int | None, desc: str = "", *, enabled: bool = True, **kw: Any):
    """A ``tqdm`` bar over ``total`` items; silent when ``enabled`` is False or stderr is not a
    terminal (logs and CI stay clean). Extra keywords go to ``tqdm``."""
    from tqdm import tqdm

    disable = not enabled or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, **kw)
