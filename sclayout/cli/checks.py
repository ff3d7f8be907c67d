"""``sclayout verify`` and ``sclayout inspect``: parse, call the library, print.

Exit codes: 0 equal / inspected, 1 verify found differences, 2 an error (bad SRC,
STORE not a layout store: one line on stderr, printed by :mod:`sclayout.cli`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from sclayout.cli._common import (
    EXIT_DIFFERS,
    EXIT_OK,
    epilog,
    json_option,
    quiet_option,
    show_progress,
)

__all__ = ["inspect_cmd", "verify_cmd"]


@click.command(
    "verify",
    short_help="Prove a store holds its source's values, row for row.",
    epilog=epilog(
        "sclayout verify data.h5ad store.zarr",
        "sclayout verify data.h5ad store.zarr --memory-budget 512MiB --json",
        check=True,
    ),
)
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--memory-budget",
    default="2GB",
    show_default=True,
    metavar="SIZE",
    help="Memory for streaming X and layers (e.g. 2GB, 512MiB).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    hidden=True,
    help="Deprecated: bars follow the terminal; --quiet turns them off.",
)
@quiet_option
@json_option
def verify_cmd(
    src: str, dst: str, memory_budget: str, progress: bool | None, quiet: bool, as_json: bool
) -> None:
    """Check that layout store DST holds exactly the data of SRC, value for value.

    Prints what differs and a summary; exits 1 when anything differs.
    """
    from sclayout.convert.verify import verify

    if progress is None or quiet:
        progress = show_progress(quiet)
    report = verify(src, dst, progress=progress, memory_budget=memory_budget)
    if as_json:
        click.echo(json.dumps({**asdict(report), "summary": report.summary()}, indent=1))
        sys.exit(EXIT_OK if report.equal else EXIT_DIFFERS)
    for line in report.differences:
        click.echo(line)
    for line in report.skipped:
        click.echo(f"skipped: {line}", err=True)
    click.echo(report.summary())
    sys.exit(EXIT_OK if report.equal else EXIT_DIFFERS)


@click.command(
    "inspect",
    short_help="Describe a store: blocks, order, chunks, codecs, sizes.",
    epilog=epilog("sclayout inspect store.zarr", "sclayout inspect store.zarr --json"),
)
@click.argument("store", type=click.Path(path_type=str))
@quiet_option
@json_option
def inspect_cmd(store: str, quiet: bool, as_json: bool) -> None:
    """Describe layout STORE: blocks, order, per-array chunks/shards/codec, sizes.

    It reads metadata only, so it shows no progress bar.
    """
    from sclayout.convert.inspect import inspect_store, render_inspect

    info = inspect_store(store)
    click.echo(json.dumps(info, indent=1) if as_json else render_inspect(info))
