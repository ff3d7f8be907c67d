"""What surrounds the code: a short README, docs whose links resolve, nothing outside.

The repository must stand on its own: no tracked file may point into the folder beside
the checkout that only the development machine has.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_CHARS = 12_000
OUTSIDE = "../" + "shared"  # spelled in two parts so this file does not match itself


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _markdown_files() -> list[Path]:
    return [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short_and_has_the_make_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters"
    assert "make demo" in text and "make test" in text
    assert "pip install" in text


def test_no_tracked_file_points_outside_the_repository():
    offenders = [
        str(p.relative_to(ROOT))
        for p in _tracked_files()
        if p.is_file() and OUTSIDE.encode() in p.read_bytes()
    ]
    assert offenders == [], f"{OUTSIDE} is mentioned in: {offenders}"


def test_docs_hold_the_newcomer_pages():
    names = ("quickstart", "store-format", "loader", "cost-model", "cli", "scaling", "design")
    for name in (*names, "benchmarks"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path):
    broken = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            slugs = {_slug(h) for h in HEADING.findall(dest.read_text(encoding="utf-8"))}
            if anchor not in slugs:
                broken.append(target)
    assert broken == [], f"{md.relative_to(ROOT)}: broken links {broken}"
