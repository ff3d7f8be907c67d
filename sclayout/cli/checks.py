"""``sclayout verify`` and ``sclayout inspect``: parse, call the library, print.

Exit codes: 0 sound or equal / inspected, 1 verify found damage or differences
(inspect: missing chunks), 2 could not run (bad SRC, STORE not a layout store, with a
source: a STORE chunk that cannot be read; one line on stderr, printed by
:mod:`sclayout.cli`).
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
    tidy_stale,
)

__all__ = ["inspect_cmd", "verify_cmd"]


def _refuse_http(dst: str) -> None:
    """Raise the one line for an ``http(s)://`` DST, which the checks cannot read.

    An ``s3://`` or ``gs://`` store is read in place (:mod:`sclayout.checks.place`);
    an HTTP server cannot list the store's objects, which the checks walk (or it
    ignores Range requests, and then the loader cannot read it either).
    """
    from loader.errors import InputError
    from loader.location import http_range_error, is_http

    if is_http(dst):
        refused = http_range_error(dst)
        if refused is not None:
            raise refused
        raise InputError(
            f"{dst}: an http(s) server cannot list the store's files, which the checks "
            "walk; copy the store to a folder (or a bucket) and check the copy"
        )


@click.command(
    "verify",
    short_help="Check a store: alone, or against its sources value for value.",
    epilog=epilog(
        "sclayout verify store.zarr",
        "sclayout verify --quick store.zarr",
        "sclayout verify data.h5ad store.zarr",
        "sclayout verify plate*.h5ad atlas.zarr --memory-budget 512MiB --json",
        check=True,
    ),
)
@click.argument(
    "paths", nargs=-1, required=True, metavar="[SRC ...] DST", type=click.Path(path_type=str)
)
@click.option(
    "--memory-budget",
    default="2GB",
    show_default=True,
    metavar="SIZE",
    help="Memory for streaming X and layers (e.g. 2GB, 512MiB).",
)
@click.option(
    "--quick", is_flag=True, help="DST alone: check structure and shard indexes only (fast)."
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
    paths: tuple[str, ...],
    memory_budget: str,
    quick: bool,
    progress: bool | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Check layout store DST: alone, or against its sources SRC value for value.

    \b
    sclayout verify DST            structure, every checksum, column ids, indptr,
                                   block pointer, source_index a permutation
    sclayout verify --quick DST    structure and shard indexes only
    sclayout verify SRC... DST     also every value equal to its source (several
                                   sources: through the store's provenance)
    """  # noqa: D301  (\b, a backspace, is click's mark for a block it must not rewrap)
    if progress is None or quiet:
        progress = show_progress(quiet)
    tidy_stale(paths[-1])
    _refuse_http(paths[-1])
    _verify(paths, memory_budget, quick, progress, as_json)


def _verify(
    paths: tuple[str, ...], memory_budget: str, quick: bool, progress: bool, as_json: bool
) -> None:
    from loader.errors import InputError

    if len(paths) == 1:
        from sclayout.checks.verify_store import check_store

        store = check_store(paths[0], quick=quick, progress=progress)
        result = {**asdict(store), "summary": store.summary()}
        notes = [f"note: {n}" for n in store.notes]
        _finish(store.findings, notes, store.summary(), store.sound, result if as_json else None)
    if quick:
        raise InputError("--quick checks DST alone: drop SRC, or drop --quick")
    from sclayout.checks.verify import verify
    from sclayout.checks.verify_sources import needs_sources_verify, verify_sources

    srcs, dst = list(paths[:-1]), paths[-1]
    if len(srcs) > 1 or needs_sources_verify(srcs[0], dst):
        report = verify_sources(srcs, dst, progress=progress, memory_budget=memory_budget)
    else:
        report = verify(srcs[0], dst, progress=progress, memory_budget=memory_budget)
    skipped = [f"skipped: {line}" for line in report.skipped]
    result = {**asdict(report), "summary": report.summary()}
    _finish(
        report.differences, skipped, report.summary(), report.equal, result if as_json else None
    )


def _finish(
    findings: list[str], remarks: list[str], summary: str, ok: bool, as_json: dict | None
) -> None:
    """Print one line per finding, the remarks and the summary, or the JSON result.

    Findings go to stdout, remarks to stderr; exit 0 when ``ok``, else 1.
    """
    if as_json is not None:
        click.echo(json.dumps(as_json, indent=1, default=str))
    else:
        for line in findings:
            click.echo(line)
        for line in remarks:
            click.echo(line, err=True)
        click.echo(summary)
    sys.exit(EXIT_OK if ok else EXIT_DIFFERS)


@click.command(
    "inspect",
    short_help="Describe a store: blocks, order, chunks, codecs, sizes.",
    epilog=epilog("sclayout inspect store.zarr", "sclayout inspect store.zarr --json", check=True),
)
@click.argument("store", type=click.Path(path_type=str))
@quiet_option
@json_option
def inspect_cmd(store: str, quiet: bool, as_json: bool) -> None:
    """Describe layout STORE: blocks, order, per-array chunks/shards/codec, sizes.

    It reads metadata and shard indexes only (of a bucket's store: in place, by
    ranged reads, with a progress bar on a terminal). Warns when chunks are missing
    (exit 1) or the store carries no chunk checksums.
    """
    from sclayout.checks.inspect import inspect_store, render_inspect

    tidy_stale(store)
    _refuse_http(store)
    info = inspect_store(store, progress=show_progress(quiet))
    click.echo(json.dumps(info, indent=1) if as_json else render_inspect(info))
    if info["missing_chunks"]:
        sys.exit(EXIT_DIFFERS)
