"""``sclayout verify`` and ``sclayout inspect``: thin click wrappers.

Exit codes: 0 equal or sound / inspected, 1 verify found differences or damage
(inspect: missing chunks), 2 could not run (bad SRC, DST not a layout store, with a
source: a DST chunk that cannot be read; one line on stderr, printed by
:mod:`sclayout.cli`).
"""

from __future__ import annotations

import json
import sys

import click

__all__ = ["COMMANDS", "inspect_cmd", "verify_cmd"]


@click.command("verify")
@click.argument(
    "paths", nargs=-1, required=True, metavar="[SRC] DST", type=click.Path(path_type=str)
)
@click.option(
    "--memory-budget",
    default="2GB",
    show_default=True,
    help="Memory for streaming X and layers (e.g. 2GB, 512MiB).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bars (default: on when stderr is a terminal).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--quick", is_flag=True, help="DST alone: check structure and shard indexes only (fast)."
)
def verify_cmd(
    paths: tuple[str, ...],
    memory_budget: str,
    progress: bool | None,
    quiet: bool,
    quick: bool,
) -> None:
    """Check layout store DST: alone, or against its source SRC value for value.

    \b
    sclayout verify DST           structure, every checksum, indices, indptr,
                                  block pointer, source_index a permutation
    sclayout verify --quick DST   structure and shard indexes only
    sclayout verify SRC DST       also every value equal to SRC

    Exits 0 when sound (and equal), 1 listing what is damaged or differs, 2 when
    it could not run (not a layout store; with SRC: a DST chunk unreadable).
    """
    from loader.errors import InputError

    if len(paths) > 2:
        raise InputError(f"verify takes DST or SRC DST, got {len(paths)} paths")
    if progress is None:
        progress = sys.stderr.isatty()
    progress = progress and not quiet
    if len(paths) == 1:
        from sclayout.convert.verify_store import check_store

        store = check_store(paths[0], quick=quick, progress=progress)
        _finish(store.findings, [f"note: {n}" for n in store.notes], store.summary(), store.sound)
    if quick:
        raise InputError("--quick checks DST alone: drop SRC, or drop --quick")
    from sclayout.convert.verify import verify

    src, dst = paths
    report = verify(src, dst, progress=progress, memory_budget=memory_budget)
    skipped = [f"skipped: {line}" for line in report.skipped]
    _finish(report.differences, skipped, report.summary(), report.equal)


def _finish(findings: list[str], remarks: list[str], summary: str, ok: bool) -> None:
    """Print one line per finding (stdout), the remarks (stderr), the summary; exit
    0 when ``ok``, else 1."""
    for line in findings:
        click.echo(line)
    for line in remarks:
        click.echo(line, err=True)
    click.echo(summary)
    sys.exit(0 if ok else 1)


@click.command("inspect")
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def inspect_cmd(dst: str, as_json: bool) -> None:
    """Describe layout store DST: blocks, order, per-array chunks/shards/codec, sizes.

    Warns when chunks are missing (exit 1) or the store carries no chunk checksums.
    """
    from sclayout.convert.inspect import inspect_store, render_inspect

    info = inspect_store(dst)
    click.echo(json.dumps(info, indent=1) if as_json else render_inspect(info))
    if info["missing_chunks"]:
        sys.exit(1)


COMMANDS = [verify_cmd, inspect_cmd]
