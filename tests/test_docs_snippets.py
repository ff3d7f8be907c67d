"""Every code block of README.md and docs/*.md runs as a reader would run it.

The convention, for whoever writes documentation:

- Blocks fenced as ``python``, ``bash``, ``sh``, ``shell`` or ``console`` are run. Blocks
  of another language (``json``) or of none (a command synopsis, printed output) are text.
- A block that cannot run here (a bucket, a cluster, an install, a benchmark of minutes)
  starts with the line ``# not run by the tests: REASON``, which the reader sees. It is
  skipped, but its syntax is still checked, and a block that calls itself "an excerpt of
  PATH" must consist of lines of PATH. A block that names a URL, an install or the
  benchmark data must carry the mark.
- Each page runs in a fresh directory, its blocks in order (a block may use what an
  earlier block of the page wrote). The directory holds the files that the example-data
  block of docs/quickstart.md writes (``data.h5ad``, ``plate1.h5ad``, ``plate2.h5ad``) and,
  unless a runnable block of the page converts a store itself, ``data.zarr``: a shuffled
  layout store of ``data.h5ad`` ("a store such as the README's commands write").
- A python block runs as a script (``python FILE``) in a subprocess of its own, so a
  ``__main__`` guard and spawned DataLoader workers are real; a shell block runs in
  ``bash -e -o pipefail`` with this interpreter's ``python`` and ``sclayout`` first on
  PATH; a console block runs its ``$ `` lines the same way.

Markdown is parsed with sybil's fenced-code-block lexer (fences in lists and quotes
included); the runner is ours, so that pages run in parallel, a few at a time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from sybil import Document, Region
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell"}
KINDS |= {"shell": "shell", "console": "console"}
MARK = re.compile(r"# not run by the tests:(.*)")
EXCERPT = re.compile(r"an excerpt of (\S+)")
# what no block can do here: reach a host, install, or read the benchmarks' data
NEEDS_MARK = re.compile(
    r"\b(?:s3|gs|https?|tcp)://|\bpip (?:install|wheel)\b|\bgit clone\b|^\s*make\b"
    r"|\.cuda\b|DIR_DATA|--harness",
    re.MULTILINE,
)
EXAMPLE_DATA = ("docs/quickstart.md", 'write_h5ad("data.h5ad")')
"""The page and a line of the block that writes the example data every page starts with."""
WRITES_STORE = re.compile(r"\bsclayout convert\b|\bconvert\(")
TIMEOUT = 300.0
"""Seconds one block may take (a loaded 2-core machine; blocks take a few seconds)."""
PAGES_AT_ONCE = 4
"""Pages run at once: most of a block's time is starting Python and importing; on two
cores, four pages at once finish in about half the time of one after the other."""

_LEXER = FencedCodeBlockLexer(language=r"[^\n]*")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, how it runs, and its text."""

    page: str
    line: int
    kind: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def reason(self) -> str | None:
        """The reason after the not-run mark on the first line, or None when unmarked."""
        first = next((ln.strip() for ln in self.source.splitlines() if ln.strip()), "")
        m = MARK.fullmatch(first)
        return m.group(1).strip() if m else None

    @property
    def commands(self) -> str:
        """The source a shell runs: a console block's ``$`` lines, else the whole block."""
        if self.kind != "console":
            return self.source
        lines = self.source.splitlines()
        return "\n".join(ln[2:] for ln in lines if ln.startswith("$ "))


def _parser(document: Document) -> Iterator[Region]:
    for region in _LEXER(document):
        words = region.lexemes["language"].split()
        kind = KINDS.get(words[0].lower() if words else "")
        if kind is not None:
            region.parsed = kind
            yield region


def _collect() -> list[Block]:
    blocks = []
    for path in PAGES:
        document = Document.parse(str(path), _parser)
        page = path.relative_to(ROOT).as_posix()
        for example in document:
            source = str(example.region.lexemes["source"])
            blocks.append(Block(page, example.line, example.parsed, source))
    return blocks


BLOCKS = _collect()


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str | None:
    """Run ``cmd`` in a session of its own; None if it exits 0, else what went wrong.

    Whatever the command leaves running (workers, decode processes) is killed with it.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"did not finish in {TIMEOUT:.0f} s; output:\n{out[-3000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        return f"exit code {proc.returncode}; output:\n{out[-3000:]}"
    return None


def _environment() -> dict[str, str]:
    """This interpreter's ``python`` and ``sclayout`` first; this checkout's packages."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_block(block: Block, cwd: Path, scripts: Path, env: dict[str, str]) -> str | None:
    if block.kind == "python":
        script = scripts / f"{Path(block.page).stem}_line{block.line}.py"
        script.write_text(block.source, encoding="utf-8")
        return _run([sys.executable, str(script)], cwd, env)
    return _run(["bash", "-e", "-o", "pipefail", "-c", block.commands], cwd, env)


def _writes_store(page: str) -> bool:
    return any(
        b.page == page and b.reason is None and WRITES_STORE.search(b.source) for b in BLOCKS
    )


def _example_data_block() -> Block:
    page, marker = EXAMPLE_DATA
    (block,) = [b for b in BLOCKS if b.page == page and marker in b.source]
    return block


def _run_page(page: str, seeds: Path, work: Path, env: dict[str, str]) -> dict[str, str | None]:
    """Run the page's unmarked blocks in order in a fresh directory; outcome by block id.

    The example-data block is not run again: its files are the seeds (the fixture ran it).
    After a failure the rest are not run (they would fail for the same reason).
    """
    cwd = work / page.replace("/", "_")
    scripts = work / (cwd.name + "-scripts")
    cwd.mkdir()
    scripts.mkdir()
    for seed in seeds.iterdir():
        if seed.suffix == ".h5ad":
            shutil.copy(seed, cwd / seed.name)
        elif not _writes_store(page):
            shutil.copytree(seed, cwd / seed.name)
    outcome: dict[str, str | None] = {}
    failed = None
    for block in (b for b in BLOCKS if b.page == page and b.reason is None):
        if failed is not None:
            outcome[block.id] = f"not reached: {failed} failed first"
            continue
        if block == _example_data_block():
            outcome[block.id] = None
            continue
        outcome[block.id] = _run_block(block, cwd, scripts, env)
        if outcome[block.id] is not None:
            failed = block.id
    return outcome


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> Path:
    """What the quickstart's example-data block writes, and data.zarr converted from it."""
    from sclayout.convert import convert

    block = _example_data_block()
    seeds = tmp_path_factory.mktemp("example-data")
    failure = _run_block(block, seeds, seeds, _environment())
    assert failure is None, f"the example data block {block.id} failed: {failure}"
    (seeds / f"{Path(block.page).stem}_line{block.line}.py").unlink()
    convert(str(seeds / "data.h5ad"), str(seeds / "data.zarr"), order="shuffled")
    return seeds


@pytest.fixture(scope="module")
def outcomes(request, example_data, tmp_path_factory) -> dict[str, str | None]:
    """Every page the session's selected blocks are on, run a few pages at a time."""
    chosen = {
        item.callspec.params["block"].page
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_block"
    }
    runnable = [b.page for b in BLOCKS if b.reason is None and b.page in chosen]
    # the pages with the most blocks first: the longest runs start at once
    pages = sorted(set(runnable), key=runnable.count, reverse=True)
    work = tmp_path_factory.mktemp("pages")
    env = _environment()
    with ThreadPoolExecutor(PAGES_AT_ONCE) as pool:
        runs = [pool.submit(_run_page, page, example_data, work, env) for page in pages]
        return {k: v for run in runs for k, v in run.result().items()}


@pytest.mark.slow  # the pages run once for the module (``outcomes``)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, outcomes):
    if block.reason is not None:
        pytest.skip(f"marked: {block.reason}")
    failure = outcomes[block.id]
    if failure is not None and failure.startswith("not reached"):
        pytest.skip(failure)
    assert failure is None, f"{block.id} ({block.kind}) failed: {failure}"


def test_marked_blocks_say_why_and_still_parse():
    marked = [b for b in BLOCKS if b.reason is not None]
    assert marked, "no block is marked: the marks were lost or their form changed"
    for block in marked:
        assert block.reason, f"{block.id}: the mark gives no reason"
        if block.kind == "python":
            compile(block.source, block.id, "exec")
        else:
            res = subprocess.run(["bash", "-n", "-c", block.commands], capture_output=True)
            assert res.returncode == 0, f"{block.id}: {res.stderr.decode()}"
        excerpt = EXCERPT.search(block.reason)
        if excerpt:
            origin = ROOT / excerpt.group(1)
            lines = {ln.strip() for ln in origin.read_text(encoding="utf-8").splitlines()}
            body = block.source.splitlines()[1:]
            missing = [ln for ln in body if ln.strip() and ln.strip() not in lines]
            assert missing == [], f"{block.id}: not in {excerpt.group(1)}: {missing}"


def test_blocks_that_cannot_run_here_are_marked():
    unmarked = [b.id for b in BLOCKS if b.reason is None and NEEDS_MARK.search(b.source)]
    assert unmarked == [], f"these blocks need a host, an install or big data: {unmarked}"


def test_every_fenced_block_a_reader_sees_is_collected():
    """The lexer misses no block: fences opened with a run language, counted by hand."""
    fence = re.compile(r"^[ \t]*(?:[-*+] |\d+[.)] )?[ \t]*```[ \t]*(\w+)[^\n]*$", re.MULTILINE)
    for path in PAGES:
        page = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        opened = [m for m in fence.finditer(text) if m.group(1).lower() in KINDS]
        assert len(opened) == sum(b.page == page for b in BLOCKS), page
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert any(b.kind == "python" and "__main__" in b.source for b in readme)
