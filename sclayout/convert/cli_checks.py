"""``sclayout verify`` and ``sclayout inspect``: thin click wrappers.

Exit codes: 0 equal / inspected, 1 verify found differences, 2 an error (bad SRC,
DST not a layout store: one line on stderr, printed by :mod:`sclayout.cli`).
"""

from __future__ import annotations

import json
import sys

import click

__all__ = ["COMMANDS", "inspect_cmd", "verify_cmd"]


@click.command("verify")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str), metavar="SRC... DST")
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
def verify_cmd(paths: tuple[str, ...], memory_budget: str, progress: bool | None) -> None:
    """Check that layout store DST holds exactly the data of SRC, value for value.

    With several sources (SRC [SRC ...] DST, in the order converted), every source's
    rows are checked through the store's provenance, gene mapping included.
    Exits 0 when equal, 1 (listing what differs) otherwise.

    \b
    Examples:
      sclayout verify pbmc.h5ad pbmc.layout
      sclayout verify plate*.h5ad atlas.layout
    """
    from loader.errors import InputError
    from sclayout.convert.verify import verify
    from sclayout.convert.verify_sources import needs_sources_verify, verify_sources

    if len(paths) < 2:
        raise InputError("usage: sclayout verify SRC [SRC ...] DST")
    srcs, dst = list(paths[:-1]), paths[-1]
    if progress is None:
        progress = sys.stderr.isatty()
    if len(srcs) > 1 or needs_sources_verify(srcs[0], dst):
        report = verify_sources(srcs, dst, progress=progress, memory_budget=memory_budget)
    else:
        report = verify(srcs[0], dst, progress=progress, memory_budget=memory_budget)
    for line in report.differences:
        click.echo(line)
    for line in report.skipped:
        click.echo(f"skipped: {line}", err=True)
    click.echo(report.summary())
    sys.exit(0 if report.equal else 1)


@click.command("inspect")
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def inspect_cmd(dst: str, as_json: bool) -> None:
    """Describe layout store DST: blocks, order, per-array chunks/shards/codec, sizes."""
    from sclayout.convert.inspect import inspect_store, render_inspect

    info = inspect_store(dst)
    click.echo(json.dumps(info, indent=1) if as_json else render_inspect(info))


COMMANDS = [verify_cmd, inspect_cmd]
