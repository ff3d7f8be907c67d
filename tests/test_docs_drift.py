"""The README repeats figures whose source is a page of docs/: they must stay equal.

- the peer comparison: every loader's cells/s, diversity and speed-up range against
  the table of docs/benchmarks.md ("sclayout and five peers in one run"), its command,
  its rounds and window length, and the layout it names against the spec it was run
  with (benchmarks/specs/tahoe_like_200k.json);
- the converter's memory per cell against the table of docs/convert.md.

A README figure that no longer comes out of its doc fails here, naming both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
CONVERT = (ROOT / "docs" / "convert.md").read_text()
PEERS_SPEC = ROOT / "benchmarks" / "specs" / "tahoe_like_200k.json"


def _section(text: str, title_start: str) -> str:
    """The ``## `` section whose title starts with ``title_start`` (up to the next one)."""
    parts = re.split(r"^## ", text, flags=re.M)
    found = [p for p in parts if p.startswith(title_start)]
    assert found, f"no section '## {title_start}...'"
    return found[0]


def _table(text: str, header_has: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table whose header has ``header_has``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and header_has in line:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"no table with {header_has!r} in its header")


def _number(cell: str) -> float:
    return float(re.sub(r"[*,ˢ ]", "", cell))


def _peer_rows() -> dict[tuple[str, str, int], dict]:
    """docs/benchmarks.md's peer table: (loader, output, workers) -> median, rounds, diversity."""
    rows = _table(_section(BENCHMARKS, "sclayout and five peers"), "cells/s (median)")
    return {
        (r[0], r[1], int(r[2])): {
            "median": _number(r[3]),
            "rounds": [_number(x) for x in r[4].split("/")],
            "diversity": r[6].rstrip("ˢ"),
        }
        for r in rows
    }


def _readme_key(label: str) -> tuple[str, str, int]:
    """A README row's loader name -> the key of its row in docs/benchmarks.md."""
    name = re.sub(r"\*\*|\s*\(.*\)$|,.*$", "", label).strip()
    output = "dense" if "dense out" in label else "CSR"
    workers = re.search(r"(\d+) workers?", label)
    return name, output, int(workers.group(1)) if workers else 0


def _readme_peer_table(readme: str) -> list[list[str]]:
    return _table(_section(readme, "Compared with"), "sclayout (CSR) is")


def _check_peer_figures(readme: str) -> None:
    peers = _peer_rows()
    reference = peers[("sclayout", "CSR", 0)]["rounds"]
    rows = _readme_peer_table(readme)
    assert len(rows) >= 4
    for label, cells, diversity, ratio in rows:
        key = _readme_key(label)
        assert key in peers, f"README row {label!r}: no row {key} in docs/benchmarks.md"
        doc = peers[key]
        assert cells.strip("*") == f"{doc['median'] / 1000:.1f}k", (label, cells, doc["median"])
        assert diversity == doc["diversity"], (label, diversity, doc["diversity"])
        if not ratio:
            continue
        # the range of the round-by-round ratios (rounds interleave: round i with round i)
        m = re.fullmatch(r"([\d.]+)–([\d.]+)× faster", ratio)
        assert m, f"README row {label!r}: ratio {ratio!r} is not 'a–b× faster'"
        decimals = len(m.group(1).partition(".")[2])
        pairs = [a / b for a, b in zip(reference, doc["rounds"], strict=True)]
        expected = (f"{min(pairs):.{decimals}f}", f"{max(pairs):.{decimals}f}")
        assert m.groups() == expected, f"README row {label!r}: {ratio!r}, docs give {expected}"


def test_every_readme_peer_figure_is_the_docs_figure():
    _check_peer_figures(README)


def _command(text: str) -> str:
    """The ``benchmarks/peers.py`` command of a page's bash blocks, one line, spaces collapsed."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = [ln for ln in block.splitlines() if not ln.lstrip().startswith("#")]
        joined = " ".join(ln.rstrip("\\").strip() for ln in lines)
        if "benchmarks/peers.py" in joined:
            return " ".join(joined.split())
    raise AssertionError("no bash block runs benchmarks/peers.py")


def test_the_readme_peer_run_is_the_docs_run():
    command = _command(_section(README, "Compared with"))
    assert command == _command(_section(BENCHMARKS, "sclayout and five peers"))
    rounds, seconds = re.search(
        r"medians of (\d+) interleaved rounds of (\d+) s windows", " ".join(README.split())
    ).groups()
    assert f"--repeat {rounds}" in command and f"--seconds {seconds}" in command, command


def test_the_layout_the_readme_names_is_the_spec_the_peers_ran():
    spec = json.loads(PEERS_SPEC.read_text())
    text = " ".join(_section(README, "Compared with").split())
    m = re.search(r"\((\w+) by (\w+), blocks of (\d+) rows, fetch factor (\d+), ([\w-]+)\)", text)
    assert m, "the README no longer names the peers' layout as '(ORDER by COL, blocks ...)'"
    store, loader = spec["store"], spec["loader"]
    assert m.groups() == (
        store["order"]["kind"],
        *store["order"]["columns"],
        str(store["block_size"]),
        str(loader["fetch_factor"]),
        store["codec"],
    )


SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")


def _check_memory_per_cell(readme: str) -> None:
    """The README's "10ⁿ cells ... convert within the default --memory-budget 2GB" is a
    row of benchmarks.md's Tahoe-shaped scale table where every order stayed within it."""
    text = " ".join(readme.split())
    m = re.search(r"so 10([⁰-⁹]+) cells in (\d+) plate files convert within the default", text)
    assert m, "the README no longer says how many cells convert within the default budget"
    cells, files = 10 ** int(m.group(1).translate(SUPERSCRIPTS)), int(m.group(2))
    section = BENCHMARKS.split("### Scale in Tahoe-100M's shape", 1)[1].split("\n## ", 1)[0]
    assert f"{files} plate files" in section, "benchmarks.md's scale runs have other files"
    # the scale table and the runs after it (each ### part its own table)
    parts = [part for part in section.split("\n### ") if "peak PSS" in part]
    rows = [r for part in parts for r in _table(part, "peak PSS") if r[0] == f"{cells:,}"]
    assert rows, f"benchmarks.md has no scale row of {cells:,} cells"
    assert all(r[5].endswith("✓") for r in rows), rows


def test_the_readme_memory_claim_is_a_measured_row():
    _check_memory_per_cell(README)


def test_a_changed_figure_is_caught():
    """The checks read the figures: a README figure off by one digit fails them."""
    import pytest

    _, cells, _, ratio = _readme_peer_table(README)[-1]
    bumped = f"{float(cells.strip('*k')) + 0.1:.1f}k"
    changed = [README.replace(f"| {cells} |", f"| {bumped} |")]
    lo, hi = re.fullmatch(r"([\d.]+)–([\d.]+)× faster", ratio).groups()
    changed.append(README.replace(ratio, f"{lo}–{float(hi) + 1}× faster"))
    for readme in changed:
        assert readme != README
        with pytest.raises(AssertionError):
            _check_peer_figures(readme)
    with pytest.raises(AssertionError):
        _check_memory_per_cell(README.replace("so 10⁸ cells in 14", "so 10⁹ cells in 14"))


def test_every_module_of_the_code_map_exists():
    rows = _table(_section((ROOT / "docs" / "design.md").read_text(), "Code map"), "Module")
    named = []
    for _, modules in rows:
        folder = ""
        for token in re.findall(r"`([^`]+)`", modules):
            if "/" in token:
                folder = token.rpartition("/")[0]
                named.append(token)
            elif token.endswith(".py"):
                named.append(f"{folder}/{token}")
    assert len(named) >= 30
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], "docs/design.md's code map names modules that do not exist"
