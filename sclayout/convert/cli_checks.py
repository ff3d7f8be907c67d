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
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
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
def verify_cmd(src: str, dst: str, memory_budget: str, progress: bool | None) -> None:
    """Check that layout store DST holds exactly the data of SRC, value for value.

    Exits 0 when equal, 1 (listing what differs) otherwise.
    """
    from sclayout.convert.verify import verify

    if progress is None:
        progress = sys.stderr.isatty()
    report = verify(src, dst, progress=progress, memory_budget=memory_budget)
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
