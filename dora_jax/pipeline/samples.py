"""Sampled completions in the run's record: what the model wrote, as text.

Training (``samples.jsonl``): each train step keeps the first ``logging.samples_per_step``
trajectories it consumed, taken in batch order (the step's first prompt groups first, a group's
members in order), a deterministic choice with no device work; only those are decoded. One JSON
object a line:

- ``step`` (the version the step published), ``request_id``, ``prompt_group``, ``member`` (index
  in the group), ``version`` (the policy that sampled it), ``staleness`` (trainer version minus
  ``version``);
- ``prompt`` (the prompt ids decoded with special tokens kept: what the model saw, chat template
  included) and ``response`` (the response as the reward function read it: EOS ids dropped,
  special tokens skipped). A multi-turn conversation also has ``turns``, a list of
  ``{"role": "model" | "environment", "text": ...}`` (environment turns with their special
  tokens), and its ``response`` is those turns as one text, each opened by ``[role]``;
- ``reward``, ``reward_metrics`` (the reward function's extra metrics, ``{}`` without any),
  ``reward_error`` (the kind of a failed scoring: ``timeout``, ``exception``, ``invalid``,
  ``crash``; else null); a conversation's ``conversation`` (its figures: turns, end reason,
  error kind, environment seconds, ``info/<name>``);
- ``response_len`` (tokens sampled, EOS included, environment turns too), ``finish`` (``eos``,
  ``length``, a stop string's ``stop``, or a conversation's end reason), ``answer`` (the example's
  reference answer, null without one).

The same rows go to TensorBoard as text (tag ``samples``) and to a Weights & Biases table
(``samples``); every ``logging.samples_every`` steps the terminal gets the first of them, clipped
to a few lines (:func:`terminal_text`).

Evaluation (``eval_samples.jsonl``): every held-out evaluation appends one row per problem and
sample: ``step``, ``problem``, ``sample``, ``prompt``, ``response`` (and ``turns``), ``answer``,
``reward``, ``correct`` (full reward, the ``solved`` of ``eval.jsonl``), ``reward_metrics``,
``reward_error``, ``response_len``, ``finish``.

A resumed run cuts both files back to its checkpoint (each step's rows once); a fresh run into
the same directory starts them over.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dora_jax.data.reward_pool import Outcome
from dora_jax.execution.payloads import Completion
from dora_jax.metrics import json_safe
from dora_jax.model.tokenizer import Tokenizer, response_ids
from dora_jax.orchestrator.backend import FinishedRequest
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.run_dir import cut_jsonl

SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
# the W&B table's columns (dicts and lists as JSON text)
TABLE_COLUMNS = (
    *("step", "request_id", "prompt_group", "member", "version", "staleness"),
    *("reward", "reward_error", "finish", "response_len", "answer"),
    *("prompt", "response", "reward_metrics"),
)
TERMINAL_LINES = 4  # per text in the terminal's sample
TERMINAL_WIDTH = 160


def chosen(batch: Sequence[ReadyGroup], n: int) -> dict[int, int]:
    """The first ``n`` trajectories of a step: request id -> member index (in its group), in
    batch order, a group's members by request id."""
    out: dict[int, int] = {}
    for rg in batch:
        members = sorted(t.request_id for t in rg.trajectories)
        for member, rid in enumerate(members):
            if len(out) >= n:
                return out
            out[rid] = member
    return out


def conversation_turns(
    tokenizer: Tokenizer, tokens: Sequence[int], loss_mask: Sequence[bool]
) -> list[dict[str, str]]:
    """A conversation's tokens after its prompt as its turns: runs of model tokens (the text
    the environment read, EOS ids dropped) and of environment tokens (special tokens kept)."""
    turns = []
    for is_model, run in itertools.groupby(zip(tokens, loss_mask, strict=True), lambda x: x[1]):
        ids = [int(t) for t, _ in run]
        if is_model:
            turns.append({"role": "model", "text": tokenizer.decode(response_ids(tokenizer, ids))})
        else:
            turns.append({"role": "environment", "text": tokenizer.decode(ids, skip_special=False)})
    return turns


def prompt_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """A prompt as the model saw it: special tokens (and the chat template's markers) kept."""
    return tokenizer.decode([int(t) for t in ids], skip_special=False)


def response_text(
    tokenizer: Tokenizer, tokens: Sequence[int], loss_mask: Sequence[bool] | None = None
) -> dict[str, Any]:
    """``response`` (and a conversation's ``turns``: ``loss_mask`` marks its model tokens) of a
    sampled sequence."""
    if loss_mask is None:
        return {"response": tokenizer.decode(response_ids(tokenizer, tokens))}
    turns = conversation_turns(tokenizer, tokens, loss_mask)
    return {"response": "\n".join(f"[{t['role']}] {t['text']}" for t in turns), "turns": turns}


def scoring(reward: float, outcome: Outcome | None) -> dict[str, Any]:
    """``reward`` and its parts (``outcome``: the reward function's, None for an environment's
    reward)."""
    return {
        "reward": float(reward),
        "reward_metrics": dict(outcome.metrics) if outcome is not None else {},
        "reward_error": outcome.error if outcome is not None else None,
    }


def trajectory_sample(
    tokenizer: Tokenizer,
    t: FinishedRequest,
    rg: ReadyGroup,
    member: int,
    reward: float,
    outcome: Outcome | None,
) -> dict[str, Any]:
    """One row of ``samples.jsonl`` for a consumed trajectory, without its ``step`` (and with
    ``staleness`` None: the trainer's version is read once the batch is scored)."""
    comp: Completion = t.payload
    row: dict[str, Any] = {
        "request_id": t.request_id,
        "prompt_group": rg.prompt_group,
        "member": member,
        "version": rg.version,
        "staleness": None,
        "prompt": prompt_text(tokenizer, comp.prompt.tokens),
        **response_text(tokenizer, comp.tokens, comp.loss_mask),
        **scoring(reward, outcome),
        "response_len": len(comp.tokens),
        "finish": comp.finish_reason,
        "answer": comp.prompt.answer if comp.prompt.answer not in (None, "") else None,
    }
    if comp.conversation is not None:
        row["conversation"] = dict(comp.conversation)
    return row


def append_rows(path: Path, step: int, rows: Sequence[dict]) -> None:
    """Append ``{"step": step, **row}`` per row to ``path``, one JSON line each, flushed."""
    lines = [
        json.dumps(json_safe({"step": int(step), **row}), allow_nan=False, ensure_ascii=False)
        for row in rows
    ]
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def clip(text: str, lines: int = TERMINAL_LINES, width: int = TERMINAL_WIDTH) -> list[str]:
    """``text`` in at most ``lines`` (>= 2) lines of at most ``width`` characters (long lines
    cut into pieces): a longer text keeps its first and last pieces around a line saying how
    many were left out (the end of a response, where its answer is, gets the larger share)."""
    pieces = [
        line[i : i + width] for line in text.splitlines() for i in range(0, len(line) or 1, width)
    ] or [""]
    if len(pieces) <= lines:
        return pieces
    head = (lines - 1) // 2
    tail = lines - 1 - head
    left = len(pieces) - head - tail
    return [*pieces[:head], f"... ({left} more lines) ...", *pieces[-tail:]]


def terminal_text(step: int, row: dict) -> str:
    """A sample for the terminal: where it comes from, its reward, then its texts, clipped."""
    error = f" ({row['reward_error']})" if row.get("reward_error") else ""
    head = (
        f"sample at step {step} (prompt group {row['prompt_group']}, member {row['member']}, "
        f"version {row['version']}): reward {row['reward']:.3f}{error}, {row['finish']}, "
        f"{row['response_len']} tokens"
    )
    out = [head]
    fields = [("prompt", row["prompt"]), ("response", row["response"])]
    if row.get("answer") is not None:
        fields.append(("answer", str(row["answer"])))
    for name, text in fields:
        for i, line in enumerate(clip(text)):
            out.append(f"  {name if i == 0 else '':>8} | {line}")
    return "\n".join(out)


def markdown(step: int, rows: Sequence[dict]) -> str:
    """The step's samples as one TensorBoard text (markdown; texts in code blocks)."""
    parts = []
    for row in rows:
        error = f" ({row['reward_error']})" if row.get("reward_error") else ""
        parts.append(
            f"**prompt group {row['prompt_group']}, member {row['member']}**: reward "
            f"{row['reward']:.3f}{error}, {row['finish']}, {row['response_len']} tokens, "
            f"version {row['version']} (staleness {row['staleness']}), answer "
            f"`{row.get('answer')}`\n\n```\n{row['prompt']}\n```\n\n```\n{row['response']}\n```"
        )
    return f"step {step}\n\n" + "\n\n---\n\n".join(parts)


def table_row(step: int, row: dict) -> list[Any]:
    """A row of the W&B table (:data:`TABLE_COLUMNS`)."""
    values = {"step": step, **row}
    cells = []
    for name in TABLE_COLUMNS:
        v = values.get(name)
        cells.append(json.dumps(json_safe(v)) if isinstance(v, dict | list) else v)
    return cells


class SampleLog:
    """Writes each step's samples: ``samples.jsonl``, TensorBoard text (through ``writer``, a
    :class:`~dora_jax.metrics.MetricsWriter`), a W&B table (``mirror``), and one to ``echo``
    every ``samples_every`` steps."""

    def __init__(
        self,
        run_dir: Path,
        samples_per_step: int,
        samples_every: int,
        *,
        resume: bool,
        done: int,
        writer=None,
        mirror=None,
        echo=print,
    ):
        self.path = Path(run_dir) / SAMPLES_FILE
        if resume:  # samples.jsonl continues: drop rows past the checkpoint (each step once)
            cut_jsonl(self.path, done, several=True)
        elif self.path.is_file():
            self.path.unlink()
        self.per_step, self.every = samples_per_step, samples_every
        self.writer, self.mirror, self.echo = writer, mirror, echo

    def write(self, step: int, samples: Sequence[dict]) -> None:
        rows = list(samples[: self.per_step])
        if rows:
            append_rows(self.path, step, rows)
            if self.writer is not None:
                self.writer.write_text(step, "samples", markdown(step, rows))
            if self.mirror is not None:
                table = [table_row(step, r) for r in rows]
                self.mirror.log_table(step, "samples", TABLE_COLUMNS, table)
        if self.every and samples and step % self.every == 0:
            self.echo(terminal_text(step, samples[0]))


def cut_eval_samples(run_dir: Path, resume: bool, steps: set[int], last_step: int) -> None:
    """``eval_samples.jsonl`` of a resumed run keeps the evaluations ``eval.jsonl`` kept
    (``steps``, each once; a kill between its rows and the ``eval.jsonl`` line leaves rows of an
    evaluation that is run again); a fresh run starts it over."""
    path = Path(run_dir) / EVAL_SAMPLES_FILE
    if resume:
        cut_jsonl(path, last_step, several=True, steps=steps)
    elif path.is_file():
        path.unlink()
