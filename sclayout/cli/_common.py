"""What every ``sclayout`` command shares.

The flags that mean the same thing everywhere, choices taken from the library's own
lists, the help epilog (examples and exit codes), and the one-line message for a missing
optional dependency. Nothing here imports numpy, zarr or loader at module level, so
``sclayout --help`` stays quick.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click

__all__ = [
    "CODEC_NAMES",
    "EXIT_DIFFERS",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "ORDER_NAMES",
    "ChoiceList",
    "LazyChoice",
    "batch_size_option",
    "codec_names",
    "epilog",
    "json_option",
    "order_names",
    "quiet_option",
    "require",
    "show_progress",
    "tidy_stale",
]

EXIT_OK = 0
EXIT_DIFFERS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

_EXIT_TEXT = {
    EXIT_OK: "done",
    EXIT_DIFFERS: "the check failed: the store is damaged or differs from its source (listed)",
    EXIT_USAGE: "bad input or usage (one line on stderr naming the problem and the fix)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); nothing written",
}


def epilog(*examples: str, check: bool = False) -> str:
    r"""Build the help epilog of a command: its examples, then what each exit code means.

    ``check``: the command can find a difference (exit 1). ``\b`` keeps click from
    rewrapping the lines.
    """
    exit_codes = (EXIT_OK, *([EXIT_DIFFERS] if check else []), EXIT_USAGE, EXIT_INTERRUPTED)
    ex = "\n".join(f"  {e}" for e in examples)
    codes = "\n".join(f"  {c:<3d} {_EXIT_TEXT[c]}" for c in exit_codes)
    return f"\b\nExamples:\n{ex}\n\n\b\nExit codes:\n{codes}"


quiet_option = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="No progress bars, and no summary after writing a store or profile; results, "
    "--json output and errors still print.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
batch_size_option = click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Rows per minibatch.",
)


def show_progress(quiet: bool) -> bool:
    """Whether to draw progress bars: not with --quiet, and only when stderr is a terminal.

    A redirected stderr (a log file, a CI job) would fill with bar redraws.
    """
    return not quiet and sys.stderr.isatty()


def require(module: str, extra: str, feature: str) -> Any:
    """Import an optional dependency for ``feature``, or fail with one line (exit 2).

    The line says how to install it, instead of a traceback deep inside the command.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        from loader.errors import InputError

        raise InputError(
            f"{feature} needs {module}, which is not installed: pip install 'sclayout[{extra}]'"
        ) from None


class LazyChoice(click.Choice):
    """A :class:`click.Choice` whose choices come from a library list, read on first use.

    The lists live in modules that import numpy or zarr; reading them only when a
    command parses or shows its help keeps ``sclayout --help`` free of those imports.
    """

    def __init__(self, load: Callable[[], Iterable[str]]) -> None:
        self._load = load
        self._choices: tuple[str, ...] | None = None
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        if self._choices is None:
            self._choices = tuple(self._load())
        return self._choices


class ChoiceList(LazyChoice):
    """A comma-separated list of choices (``--orders original,shuffled``).

    Each item is checked like :class:`LazyChoice`; the value is a tuple.
    """

    name = "choice list"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        # click >= 8.2 passes ctx; 8.1 does not
        base = super().get_metavar(param, ctx) if ctx is not None else super().get_metavar(param)
        return f"{base},..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        if isinstance(value, tuple):
            return value
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        if not items:
            self.fail(f"{value!r}: give at least one of {', '.join(self.choices)}", param, ctx)
        return tuple(super(ChoiceList, self).convert(v, param, ctx) for v in items)


ORDER_NAMES = ("original", "shuffled", "stratified", "grouped")
"""The row orders a layout store can have: :data:`loader.layout.ORDER_KINDS`, spelled
out here because importing loader loads numpy, which ``COMMAND --help`` must not wait
for (tests/cli/test_cli_style.py checks the two lists are equal)."""

CODEC_NAMES = (
    *(f"blosc-{c}" for c in ("lz4", "lz4hc", "zstd")),
    *(f"blosc-{c}-bitshuffle" for c in ("lz4", "lz4hc", "zstd")),
    "zstd",
    "gzip",
    "none",
)
"""The codecs the converter writes: the keys of :data:`sclayout.convert.codecs.CODECS`,
in order, spelled out for the same reason (importing the converter loads zarr)."""


def order_names() -> tuple[str, ...]:
    """List the row orders a layout store can have (the store format's list)."""
    return ORDER_NAMES


def codec_names() -> tuple[str, ...]:
    """List the codecs the converter can write."""
    return CODEC_NAMES


def tidy_stale(*paths: Any) -> None:
    """Tidy what killed conversions left next to each local store path, one line each.

    Every command given a store runs it first (:func:`sclayout.convert.stale.clean_stale`:
    hidden temporary siblings removed, an old store moved aside put back), so SIGKILL
    during ``convert`` leaves nothing past the next command on that path.
    """
    from sclayout.convert.stale import clean_stale

    for path in paths:
        for line in clean_stale(path):
            click.echo(line, err=True)
