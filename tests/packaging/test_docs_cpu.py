"""Issue #50: a README a newcomer reads in one sitting (at most 12 KB), every docs page linked from it,
and no relative link in the README, CONTRIBUTING.md, BENCHMARKS.md or docs/ that leads nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: A markdown link or image: [text](target) / ![alt](target).
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes, expected at most {12 * 1024}: move a section to docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {target.split("#")[0] for target in LINK.findall(README.read_text())}
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"
    assert "CONTRIBUTING.md" in linked and "BENCHMARKS.md" in linked


def test_relative_links_lead_somewhere() -> None:
    pages = [README, ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
