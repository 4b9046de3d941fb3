"""What every benchmark records beside its figures, and the quiet machine it needs.

A timing taken while other jobs share the cores says little, so a benchmark calls
:func:`wait_for_quiet` first (it waits up to ``--wait`` seconds for the 1-minute load average to
drop below ``--max-load``, then refuses to start) and writes :func:`provenance` into its JSON:
the command, the commit, the load averages before and after, the CPU count and the date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser, max_load: float = 1.5) -> None:
    p.add_argument(
        "--max-load",
        type=float,
        default=max_load,
        help="start only once the 1-minute load average is below this",
    )
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for that")


def wait_for_quiet(max_load: float, wait_s: float) -> tuple[float, float, float]:
    """The load averages at the start, once the 1-minute one is below ``max_load``;
    ``SystemExit`` if it is not within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        load = os.getloadavg()
        if load[0] <= max_load:
            return load
        if time.monotonic() > deadline:
            raise SystemExit(
                f"load average {load[0]:.2f} > {max_load} for {wait_s:.0f} s: run the benchmark "
                "on a quiet machine, alone (or raise --max-load)"
            )
        print(f"waiting for a quiet machine (load {load[0]:.2f} > {max_load})", flush=True)
        time.sleep(15)


def rel(path) -> str:
    """``path`` relative to the checkout when it lies inside it (as a benchmark records it)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def commit() -> str:
    """The checkout's commit, with ``+changes`` when the package differs from it."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dora_jax", "benchmarks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(load_before: tuple[float, float, float]) -> dict:
    """The command, commit, load averages (before: as given; after: now), CPUs and date."""
    return {
        "command": "python "
        + " ".join(
            [
                str(Path(sys.argv[0]).relative_to(ROOT))
                if Path(sys.argv[0]).is_absolute()
                else sys.argv[0],
                *sys.argv[1:],
            ]
        ),
        "commit": commit(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
