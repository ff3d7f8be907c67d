"""The ``sclayout`` command line: a click group with one module per command group.

:mod:`sclayout.cli.convert` (``convert``), :mod:`sclayout.cli.checks` (``verify``,
``inspect``) and :mod:`sclayout.cli.cost` (``calibrate``, ``recommend``, ``bench``) each
parse, call the library and print. The group turns every :class:`SclayoutError` into one
line on stderr and exit 2, and Ctrl-C into one line and exit 130; anything else is a bug
and keeps its traceback. Importing this package loads neither numpy nor the storage
libraries, so ``sclayout --help`` is quick: each command imports what it needs.
"""

from __future__ import annotations

import sys

import click

from sclayout.cli._common import EXIT_INTERRUPTED, epilog

__all__ = ["main"]


class _Group(click.Group):
    def invoke(self, ctx: click.Context):  # one place turns library errors into exits
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("error: interrupted; nothing written", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as e:
            # loader imports numpy: an error from it means loader.errors is loaded already
            # (--help and click's usage errors come here too, and must not wait for numpy)
            errors = sys.modules.get("loader.errors")
            if errors is None or not isinstance(e, errors.SclayoutError):
                raise
            click.echo(f"error: {e}", err=True)
            _quiet_abandoned_reads()
            sys.exit(e.exit_code)


def _quiet_abandoned_reads() -> None:
    """Keep the reads a failed command leaves in flight from printing at exit.

    zarr-python gathers a read's chunks on its event-loop thread: when one chunk fails,
    the others may still be pending as the process exits, and asyncio then logs each as
    "Task was destroyed but it is pending!" (or warns that its coroutine was never
    awaited) after the one line that already says what failed.
    """
    import logging
    import warnings

    logging.getLogger("asyncio").disabled = True
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=epilog(
        "sclayout recommend data.h5ad --label cell_type --spec-out spec.json",
        "sclayout convert data.h5ad store.zarr --spec spec.json",
        "sclayout verify data.h5ad store.zarr",
        "sclayout bench store.zarr --fetch-factor 16",
        check=True,
    ),
)
@click.version_option(package_name="sclayout")
def main() -> None:
    """Convert AnnData to chunk-aligned layout stores, and predict how to read them.

    Run `sclayout COMMAND --help` for a command's options; all of them are described at
    https://github.com/sclayout/sclayout/blob/main/docs/cli.md
    """


def _register() -> None:
    from sclayout.cli.checks import inspect_cmd, verify_cmd
    from sclayout.cli.convert import convert_command
    from sclayout.cli.cost import bench_command, calibrate_command, recommend_command

    for command in (
        convert_command,
        verify_cmd,
        inspect_cmd,
        calibrate_command,
        recommend_command,
        bench_command,
    ):
        main.add_command(command)


_register()
