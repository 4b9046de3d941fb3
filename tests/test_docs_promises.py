"""Sentences the docs must keep: what a user has to know before relying on a feature."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()

MAIN_JOB = "pip install -e . && python launch/train.py"
TESTS = (
    'pip install -e ".[test]" && ruff format --check . && ruff check . && python -m pytest -q -n 2'
)


def _paragraph_after(text: str, marker: str, paragraphs: int = 4) -> str:
    start = text.index(marker)
    return "\n\n".join(text[start:].split("\n\n")[:paragraphs])


def test_usage_says_a_reward_file_runs_with_the_users_rights():
    """``data.reward=file.py:fn`` runs that code as the user, and a resumed run directory (its
    saved config) names the code it runs (docs/usage.md, "Your own data and model")."""
    near = _paragraph_after(USAGE, "**Your own reward function.**")
    assert "**It runs with your rights.**" in near
    assert "as the user who started the run" in near
    assert "so `--resume` of a run directory runs the reward" in near
    assert "resume and run only run directories and configs you trust" in near


def test_usage_says_reward_error_counts_are_cumulative():
    assert "The `reward_errors` counts in `metrics.jsonl` are cumulative" in USAGE
    assert "(`reward_errors`, `reward_errors/*`: cumulative counts, not per step)" in USAGE


def test_readme_is_short_links_the_docs_and_holds_the_two_commands():
    """The README stays a front page: at most 160 lines, the two commands as they are, and links
    to where the rest moved (docs/usage.md, docs/benchmarks.md)."""
    assert len(README.splitlines()) <= 160
    for doc in ("docs/usage.md", "docs/benchmarks.md"):
        assert f"]({doc})" in README, doc
        assert (ROOT / doc).is_file(), doc
    blocks = README.split("```bash\n")[1:]
    commands = [b.split("```")[0].strip() for b in blocks]
    assert MAIN_JOB in commands
    assert TESTS in commands


def test_the_listeners_are_said_to_authenticate_nothing(capsys):
    """docs/multihost.md (next to the commands, and under Listeners) and ``--help`` say the
    listeners authenticate nothing and how ``DORA_BIND_ADDRESS`` chooses their address."""
    from dora_jax.main import parse_args

    doc = (ROOT / "docs" / "multihost.md").read_text()
    assert "that **authenticate nothing**" in doc
    assert "`DORA_BIND_ADDRESS=ADDR` in each process's environment binds them to `ADDR`" in doc
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "listeners authenticate nothing" in out and "DORA_BIND_ADDRESS=ADDR" in out


IMAGE = re.compile(r"\.(png|jpe?g|svg|gif)$", re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_texts() -> dict[Path, str]:
    return {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def test_every_image_in_docs_is_shown_by_a_doc_and_every_link_to_one_resolves():
    """docs/ holds the pictures the docs show or name and no others (a benchmark's plots of every
    run go to benchmarks/results/plots/); a doc's link to an image names a file that exists."""
    texts = doc_texts()
    shown = set()
    for path, text in texts.items():
        for target in LINK.findall(text):
            if IMAGE.search(target) and "://" not in target:
                file = (path.parent / target).resolve()
                assert file.is_file(), f"{path.name} links {target}: no such file"
                shown.add(file)
    images = [p for p in (ROOT / "docs").rglob("*") if IMAGE.search(p.name)]
    assert images, "no image found in docs/: the walk is wrong"
    named = "\n".join(texts.values())
    unshown = sorted(
        p.relative_to(ROOT).as_posix()
        for p in images
        if p.resolve() not in shown and f"{p.name}`" not in named  # linked, or named in code
    )
    assert unshown == []
