"""The GPU check's record: one row per case, written after every case, and the markdown tables
(``launch/gpu_check.py``)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

UNITS = dict(
    max_abs_err="max |kernel - reference| after casting to float32",
    smem_bytes="modeled shared memory per program of the compiled kernel (tuning_used), bytes",
    time_us="microseconds, median of repeats of `inner` back-to-back calls",
    bytes="bytes of K/V read (attention) or read + written (pack/unpack)",
    bandwidth_gbs="1e9 bytes per second",
    copy_bandwidth_gbs="1e9 bytes per second of x * 2 over an equal-sized array, read + write",
    ratio_to_copy="bandwidth_gbs / copy_bandwidth_gbs",
    decode_tokens_per_s="tokens sampled by decode steps / wall seconds of the decode calls",
    tokens_per_s="all sampled tokens / wall seconds of the whole round (prefill included)",
    rollout_tokens_per_s="grpo: response tokens the rollout groups sampled / seconds some group "
    "was prefilling or decoding (the union over groups; compilation included)",
    rollout_tokens_per_s_warm="grpo: the same without each group's first prefill and first "
    "decode call (they compile, unless the held-out evaluation before the first step compiled "
    "the same programs)",
    train_real_tokens_per_s="grpo: real (prompt + response) tokens of a train step / its "
    "seconds (metrics.jsonl real_tokens_per_s), median over the steps after the first",
    e2e_tokens_per_s="grpo: response tokens the train steps consumed / wall seconds of the run "
    "loop (rollout, training, weight transfers, compilation; held-out evaluations excluded)",
    held_out_solved_before="grpo: share of the held-out problems solved, one sample each, "
    "before the first step (held_out_solved_after: after the last)",
)


class SkipCase(Exception):
    """Raised by a case that cannot run here (an input is missing): recorded as ``skipped`` with
    the message as its ``reason``, never as an error."""


# ----------------------------------------------------------------------------------------------
# Recording: one row per case, written after every case
# ----------------------------------------------------------------------------------------------


def error_text(exc: BaseException, limit: int = 2000) -> str:
    """`Type: message`, the middle cut out past `limit` characters (compiler errors are long)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > limit:
        cut = len(text) - limit
        text = f"{text[: limit // 2]} [... {cut} characters cut ...] {text[-limit // 2 :]}"
    return text


class WarningLog:
    """A `warnings.showwarning` that prints the first warning of each kind and place once and
    counts the rest (the Triton lowering warns at every kernel it lowers, perhaps with the
    kernel's name in the text, so the place, not the text, identifies a warning)."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.seen: dict[tuple[str, str, int], dict] = {}

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        key = (category.__name__, str(filename), int(lineno))
        if key in self.seen:
            self.seen[key]["count"] += 1
            return
        text = " ".join(str(message).split())[:300]
        self.seen[key] = dict(category=category.__name__, message=text, count=1)
        self.say(f"warning (shown once): {category.__name__}: {text} [{filename}:{lineno}]")

    def rows(self) -> list[dict]:
        return [dict(row) for row in self.seen.values()]


class Recorder:
    """Runs cases in isolation and keeps DIR/gpu_check.{json,md,log} up to date."""

    def __init__(self, out_dir: Path, meta: dict, *, only, fail_case, deadline: float):
        self.out_dir = out_dir  # (a section may write files of its own there)
        self.only, self.fail_case, self.deadline = only, fail_case, deadline
        self.result = dict(meta, units=UNITS, sections={}, warnings=[], finished=False)
        self.log = (out_dir / "gpu_check.log").open("w")
        self.warning_log = WarningLog(self.say)

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def section(self, name: str) -> dict:
        return self.result["sections"].setdefault(name, dict(status="running", cases=[]))

    def run_case(self, section: str, table: str, name: str, fn: Callable[[], dict], **labels):
        """Runs fn() (a dict of figures; ok=False marks a failed check) as one case. Returns the
        recorded row, or None when --only leaves the case out."""
        if self.only and not any(s in name for s in self.only):
            return None
        row = dict(case=name, table=table, **labels)
        t0 = time.perf_counter()
        if time.monotonic() > self.deadline:
            row.update(status="skipped", reason="time budget (--max-seconds) spent")
        else:
            try:
                if any(s in name for s in self.fail_case):
                    raise RuntimeError(f"forced failure of {name} (--fail-case)")
                figures = fn()
                row.update(figures)
                row["status"] = "ok" if figures.get("ok", True) else "failed"
            except SkipCase as exc:  # an input this machine lacks: why, not a traceback
                row.update(status="skipped", reason=str(exc))
            except Exception as exc:  # every failure is a figure to keep
                row.update(status="error", error=error_text(exc))
                row["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
        row["seconds"] = round(time.perf_counter() - t0, 3)
        self.section(section)["cases"].append(row)
        shown = {k: row[k] for k in SHOWN.get(table, ()) if k in row}
        extra = (
            row.get("error")
            or row.get("reason")
            or " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
        )
        self.say(f"[{row['status']}] {name} ({row['seconds']:.1f}s) {extra}")
        self.write()
        return row

    def end_section(self, name: str, exc: BaseException | None = None) -> None:
        sec = self.section(name)
        sec["status"] = "done" if exc is None else "error"
        if exc is not None:
            sec["error"] = error_text(exc)
            sec["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
            self.say(f"[section error] {name}: {sec['error']}")
        for table, cols in TABLES.items():
            rows = [r for r in sec["cases"] if r["table"] == table]
            if rows:
                self.say(f"\n== {name}: {table}")
                for line in text_table(rows, cols):
                    self.say(line)
        self.say()
        self.write()

    def summary(self) -> dict:
        rows = [r for s in self.result["sections"].values() for r in s["cases"]]
        counts = {k: sum(r["status"] == k for r in rows) for k in STATUSES}
        section_errors = [n for n, s in self.result["sections"].items() if s["status"] == "error"]
        all_ok = bool(rows) and counts["ok"] == len(rows) and not section_errors
        return dict(cases=len(rows), **counts, section_errors=section_errors, all_ok=all_ok)

    def write(self, finished: bool = False) -> None:
        self.result.update(
            warnings=self.warning_log.rows(), summary=self.summary(), finished=finished
        )
        (self.out_dir / "gpu_check.json").write_text(
            json.dumps(self.result, indent=1, default=str) + "\n"
        )
        (self.out_dir / "gpu_check.md").write_text(markdown(self.result))


STATUSES = ("ok", "failed", "error", "skipped")
TABLES = {
    "correctness": ["op", "impl", "dtype", "shape", "tuning", "tuning_used", "smem_bytes"]
    + ["max_abs_err", "tol", "status"],
    "timing": ["op", "shape", "impl", "tuning", "tuning_used", "time_us", "bandwidth_gbs"]
    + ["copy_bandwidth_gbs", "ratio_to_copy", "status"],
    "engine": ["impl", "model", "slots", "decode_tokens", "decode_tokens_per_s", "tokens_per_s"]
    + ["status"],
    "moe": ["impl", "experts", "shape", "max_abs_err", "tol", "tokens_per_s", "status"],
    "grpo": ["model", "dtype", "impl", "steps", "trajectories", "rollout_tokens_per_s"]
    + ["rollout_tokens_per_s_warm", "train_real_tokens_per_s", "train_step_s"]
    + ["e2e_tokens_per_s", "held_out_solved_before", "held_out_solved_after", "status"],
}
SHOWN = dict(
    correctness=("max_abs_err", "tuning_used"),
    timing=("time_us", "bandwidth_gbs", "ratio_to_copy", "tuning_used"),
    engine=("decode_tokens_per_s", "tokens_per_s"),
    train=("tokens_per_s", "mfu", "step_s"),
    moe=("max_abs_err", "tokens_per_s"),
    grpo=("rollout_tokens_per_s", "train_real_tokens_per_s", "e2e_tokens_per_s")
    + ("held_out_solved_before", "held_out_solved_after"),
)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def text_table(rows: list[dict], cols: list[str]) -> list[str]:
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    return [
        " | ".join(f"{x:>{w}}" for x, w in zip(row, widths, strict=True)) for row in [cols, *cells]
    ]


def markdown(result: dict) -> str:
    s = result.get("summary", {})
    lines = [
        "# GPU check",
        "",
        f"- command: `{result['command']}`",
        f"- jax {result['jax_version']}, backend {result['backend']}, device "
        f"{result['device_kind']}, interpret {result['interpret']}",
        f"- created {result['created_utc']}; finished: {result['finished']}",
        f"- cases: {s.get('cases', 0)}, ok {s.get('ok', 0)}, failed {s.get('failed', 0)}, "
        f"error {s.get('error', 0)}, skipped {s.get('skipped', 0)}",
    ]
    for name, sec in result["sections"].items():
        lines += ["", f"## {name} ({sec['status']})"]
        if sec.get("error"):
            lines += ["", f"Section error: `{sec['error'][:500]}`"]
        for table, cols in TABLES.items():
            rows = [r for r in sec["cases"] if r["table"] == table]
            if rows:
                lines += ["", f"### {table}", "", "| " + " | ".join(cols) + " |"]
                lines.append("|" + "---|" * len(cols))
                lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        bad = [r for r in sec["cases"] if r.get("error")]
        if bad:
            lines += ["", "### errors", ""]
            lines += [f"- `{r['case']}`: {r['error'][:500]}" for r in bad]
        skipped = [r for r in sec["cases"] if r["status"] == "skipped"]
        if skipped:
            lines += ["", "### skipped", ""]
            lines += [f"- `{r['case']}`: {r.get('reason', '')[:800]}" for r in skipped]
    if result.get("warnings"):
        lines += ["", "## warnings", ""]
        lines += [f"- {w['category']} x{w['count']}: {w['message']}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"
