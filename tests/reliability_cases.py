"""The table of docs/reliability.md as data, so the tests check what it promises.

Each row of the table is ``| `case-id` | what was tried | what the user sees | exit | test |``.
Every backticked fragment of the "what the user sees" column must appear in the command's output
(:func:`expect`), the exit status must be the one in the "exit" column (``-``: not a command of its
own), and the "test" column names the test that checks the row (``test_reliability_doc`` checks
that it exists and calls ``expect`` with the case id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


@dataclass(frozen=True)
class Case:
    case: str
    tried: str
    sees: str
    fragments: tuple[str, ...]
    exit: int | None
    test: str  # file::function


def load() -> dict[str, Case]:
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            continue
        case = cells[0].strip("`")
        exit_cell = cells[3].strip()
        fragments = tuple(f.replace("\\|", "|") for f in re.findall(r"`([^`]+)`", cells[2]))
        out[case] = Case(
            case,
            cells[1],
            cells[2],
            fragments,
            None if exit_cell == "-" else int(exit_cell),
            cells[4].strip("`"),
        )
    return out


CASES = load()


def expect(case: str, output: str, rc: int | None = None) -> None:
    """Assert that ``output`` (stdout and stderr together) and the exit status ``rc`` are what
    the table's row ``case`` says."""
    row = CASES[case]
    if row.exit is not None:
        assert rc == row.exit, f"{case}: exit {rc}, the table says {row.exit}\n{output[-3000:]}"
    for fragment in row.fragments:
        assert fragment in output, f"{case}: {fragment!r} not in the output:\n{output[-3000:]}"
