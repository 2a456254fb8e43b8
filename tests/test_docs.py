"""The docs hold together: every relative link in README.md, CHANGELOG.md and docs/*.md
points at a file that exists (and, for `page.md#anchor`, at a heading of that page),
every docs/ page is in the README's index, every repository path a page quotes
in backticks exists, and the pages that describe the code as it is (design.md,
benchmarks.md) stay under 20 KB: their history belongs in CHANGELOG.md. Reads files
only; no processes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(    |\t)")           # indented code blocks: not prose
# A quoted path of the repository: starts with one of its top-level folders.
TOP = ("cs_runtime/", "chief/", "worker/", "wse/", "cs_torch/", "scripts/", "examples/", "tests/", "docs/")
# Pages that hold the current state only; past rounds go to CHANGELOG.md.
CURRENT_STATE_PAGES = ("docs/design.md", "docs/benchmarks.md")
MAX_PAGE_BYTES = 20_000
QUOTED_PATH = re.compile(r"`((?:%s)[A-Za-z0-9_./-]*)`" % "|".join(re.escape(t) for t in TOP))


def prose(page: Path) -> str:
    return "\n".join(line for line in page.read_text().splitlines() if not FENCE.match(line))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no heading #{frag} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_repository_path_exists(page: Path) -> None:
    text = page.read_text()
    missing = sorted({p for p in QUOTED_PATH.findall(text)
                      if "<" not in p and "*" not in p and not (REPO / p.rstrip(".")).exists()})
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {', '.join(missing)}"


def test_readme_indexes_every_docs_page() -> None:
    readme = REPO / "README.md"
    linked = {(REPO / t.partition("#")[0]).resolve() for t in relative_links(readme)}
    unlisted = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlisted, f"README.md's index of docs/ lacks {', '.join(unlisted)}"


def test_anchor_rule() -> None:
    assert anchor("run.py's flags (`cs_runtime/runner.py`)") == "runpys-flags-cs_runtimerunnerpy"
    assert anchor("One step, message by message") == "one-step-message-by-message"


@pytest.mark.parametrize("name", CURRENT_STATE_PAGES)
def test_current_state_pages_stay_small(name: str) -> None:
    size = len((REPO / name).read_bytes())
    assert size < MAX_PAGE_BYTES, (
        f"{name} is {size:,} bytes, over the {MAX_PAGE_BYTES:,}-byte limit: it keeps the current state only; "
        "move past rounds (what was tried, by how much) to CHANGELOG.md")
