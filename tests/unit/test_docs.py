"""The documentation stays short where it must and points at things that exist: README.md within
MAX_README_LINES, every relative link of README.md, docs/*.md and benchmarks/*.md resolving to a
file or folder, and every module path the code maps name (README's "Where things are" and
docs/architecture.md) present in the tree. A failure lists every offender."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_README_LINES = 300
MODULE_MAP_HEADING = "## Where things are"

# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A path of the project's source folders written in backticks: `specdec/...`, `deployments/...`.
MODULE_PATH = re.compile(r"`((?:specdec|deployments|cluster)/[^`\s]*)`")


def _pages() -> list[Path]:
    return [
        README,
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks").glob("*.md")),
    ]


def _relative_links(page: Path) -> list[str]:
    """The links of ``page`` to files of the repository (no URL scheme, no bare anchor)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    return [
        target
        for target in LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")
    ]


def _module_map(text: str) -> str:
    """The README's module map: its "Where things are" section."""
    start = text.index(MODULE_MAP_HEADING)
    end = text.find("\n## ", start + len(MODULE_MAP_HEADING))
    return text[start : end if end >= 0 else len(text)]


def _missing_module_paths(text: str) -> list[str]:
    paths = {p.rstrip(".,;:") for p in MODULE_PATH.findall(text) if "*" not in p}
    return sorted(p for p in paths if not (ROOT / p).exists())


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, at most {MAX_README_LINES}: move detail to docs/"
    )


def test_every_relative_link_resolves():
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in _pages()
        for target in _relative_links(page)
        if not (page.parent / target.split("#", 1)[0]).exists()
    ]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_pages_have_links_to_check():
    """The link check above sees the README's links (a regex gone wrong would pass vacuously)."""
    assert "docs/architecture.md" in _relative_links(README)


def test_every_module_the_readme_map_names_exists():
    section = _module_map(README.read_text())
    assert MODULE_PATH.search(section), f"README.md's {MODULE_MAP_HEADING!r} names no module"
    missing = _missing_module_paths(section)
    assert not missing, "README.md's module map names paths that do not exist:\n" + "\n".join(
        missing
    )


def test_every_module_the_architecture_page_names_exists():
    text = ARCHITECTURE.read_text()
    assert MODULE_PATH.search(text), "docs/architecture.md names no module"
    missing = _missing_module_paths(text)
    assert not missing, "docs/architecture.md names paths that do not exist:\n" + "\n".join(missing)


def test_the_missing_paths_are_listed():
    """The check reports a path that is not in the tree, and only that one."""
    text = "`specdec/decoding/round_loop.py`, `specdec/decoding/no_such_module.py`, `cluster/`"
    assert _missing_module_paths(text) == ["specdec/decoding/no_such_module.py"]
