"""The ``sclayout`` command line: a thin click group.

Commands live next to the library code they call (``sclayout/convert/cli.py``,
``sclayout/cost/cli.py``) and are registered here. Every :class:`SclayoutError`
becomes one line on stderr and a non-zero exit, Ctrl-C one line and exit 130; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import click

from loader.errors import SclayoutError

__all__ = ["main"]


INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C: 128 + SIGINT, as shells report a process stopped by it."""


class _Group(click.Group):
    def invoke(self, ctx: click.Context):  # one place turns library errors into exits
        try:
            return super().invoke(ctx)
        except SclayoutError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:  # every command writes its output last, or not at all
            click.echo("error: interrupted; nothing written", err=True)
            sys.exit(INTERRUPTED_EXIT)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sclayout")
def main() -> None:
    """Convert AnnData to chunk-aligned layout stores, and predict how to read them."""


def _register() -> None:
    from sclayout.convert.cli import COMMANDS as convert_commands
    from sclayout.cost.cli import COMMANDS as cost_commands

    for command in (*convert_commands, *cost_commands):
        main.add_command(command)


_register()
