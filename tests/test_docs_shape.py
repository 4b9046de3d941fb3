"""The shape of the docs a newcomer reads: every page under 5,000 words, every picture in docs/
named by a page, every relative link to a page resolving, and docs/architecture.md opening with
its data-flow picture and a glossary before the dependency table. Plain text checks, no jax."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_WORDS = 5000
IMAGE = re.compile(r"\.(png|jpe?g|svg|gif)$", re.I)
MD_LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#[^)\s]*)?\)")
OPENING_LINES = 60
PICTURE_WORDS = ("dispatch", "trainer", "publish")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def too_long(texts: dict[str, str]) -> list[str]:
    """Pages of ``MAX_WORDS`` words or more, counted as ``wc -w`` counts them."""
    return [
        f"{name}: {len(t.split())} words"
        for name, t in texts.items()
        if len(t.split()) >= MAX_WORDS
    ]


def unnamed_images(images: list[str], texts: dict[str, str]) -> list[str]:
    """Image file names that no page names."""
    named = "\n".join(texts.values())
    return sorted(name for name in images if name not in named)


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links to ``.md`` files (anchors aside) whose file does not exist, resolved from
    the page's own folder as a Markdown renderer resolves them."""
    return [
        f"{page.relative_to(ROOT).as_posix()} links {target}"
        for target in MD_LINK.findall(text)
        if "://" not in target and not (page.parent / target).resolve().is_file()
    ]


def opening_problems(text: str) -> list[str]:
    """What docs/architecture.md's opening lacks: a fenced block within its first
    ``OPENING_LINES`` lines that holds the picture's words, and a Glossary heading before the
    dependency table's heading."""
    problems = []
    lines = text.splitlines()
    fences = [i for i, line in enumerate(lines) if line.lstrip().startswith("```")]
    blocks = [
        "\n".join(lines[a + 1 : b]).lower()
        for a, b in zip(fences[::2], fences[1::2], strict=False)
        if a < OPENING_LINES
    ]
    if not any(all(word in block for word in PICTURE_WORDS) for block in blocks):
        problems.append(
            f"no fenced block in the first {OPENING_LINES} lines holds {', '.join(PICTURE_WORDS)}"
        )
    headings = [(i, line.lstrip("#").strip().lower()) for i, line in enumerate(lines)]
    headings = [(i, h) for i, h in headings if lines[i].startswith("#")]
    glossary = [i for i, h in headings if h.startswith("glossary")]
    dependency = [i for i, h in headings if h.startswith("dependency")]
    if not glossary:
        problems.append("no Glossary heading")
    if not dependency:
        problems.append("no dependency table heading")
    if glossary and dependency and glossary[0] > dependency[0]:
        problems.append("the Glossary heading comes after the dependency table heading")
    return problems


def test_every_page_is_under_5000_words():
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in pages()}
    assert len(texts) > 5, "no docs found: the walk is wrong"
    assert too_long(texts) == []


def test_every_image_in_docs_is_named_by_a_page():
    images = [p.name for p in DOCS.rglob("*") if p.is_file() and IMAGE.search(p.name)]
    assert images, "no image found in docs/: the walk is wrong"
    texts = {p.name: p.read_text() for p in pages()}
    assert unnamed_images(images, texts) == []


def test_every_relative_link_to_a_page_resolves():
    broken = [b for p in pages() for b in broken_links(p, p.read_text())]
    assert broken == []


def test_architecture_opens_with_the_picture_and_a_glossary():
    assert opening_problems((DOCS / "architecture.md").read_text()) == []


def test_the_checks_catch_what_they_look_for():
    """Each check above fails on a page that breaks its rule."""
    assert too_long({"a.md": "word " * MAX_WORDS}) == ["a.md: 5000 words"]
    assert too_long({"a.md": "word " * (MAX_WORDS - 1)}) == []
    assert unnamed_images(["x.png", "y.svg"], {"a.md": "see ![x](x.png)"}) == ["y.svg"]
    page = DOCS / "architecture.md"
    assert broken_links(page, "[a](usage.md) [b](usage.md#the-tests)") == []
    assert broken_links(page, "[c](no_such_page.md#x) [d](docs/usage.md)") == [
        "docs/architecture.md links no_such_page.md",
        "docs/architecture.md links docs/usage.md",
    ]
    assert broken_links(ROOT / "README.md", "[e](docs/usage.md) [f](usage.md)") == [
        "README.md links usage.md"
    ]
    good = (
        "# t\n\n```text\ndispatch -> trainer -> publish\n```\n\n## Glossary\n\n## Dependency rule\n"
    )
    assert opening_problems(good) == []
    assert len(opening_problems(good.replace("publish", "release"))) == 1
    assert len(opening_problems("\n" * OPENING_LINES + good)) == 1
    swapped = good.replace("## Glossary\n\n## Dependency rule", "## Dependency rule\n\n## Glossary")
    assert opening_problems(swapped) == [
        "the Glossary heading comes after the dependency table heading"
    ]
    assert opening_problems(good.replace("## Glossary", "## Terms")) == ["no Glossary heading"]
