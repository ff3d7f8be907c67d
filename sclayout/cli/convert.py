"""``sclayout convert``: parse the options, call :func:`sclayout.convert.convert`, print.

Options given with ``--spec`` override the spec's values.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from sclayout.cli._common import (
    LazyChoice,
    codec_names,
    epilog,
    json_option,
    order_names,
    quiet_option,
    require,
    show_progress,
    tidy_stale,
)

__all__ = ["convert_command"]


def _dir_bytes(path: Path) -> tuple[int, int]:
    files = total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            files += 1
            total += os.path.getsize(os.path.join(dirpath, n))
    return total, files


def read_sources_file(path: Path) -> list[Path]:
    """Read a ``--sources-from`` file: one source path a line.

    Blank lines and ``#`` comments are skipped; relative paths are relative to the
    file's folder.
    """
    from loader.errors import InputError

    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"--sources-from {path}: cannot read it ({e.strerror})") from None
    out = [Path(x.strip()) for x in lines if x.strip() and not x.strip().startswith("#")]
    if not out:
        raise InputError(f"--sources-from {path}: lists no source; write one path a line")
    return [p if p.is_absolute() else path.parent / p for p in out]


def split_paths(
    paths: tuple[str | Path, ...], sources_from: Path | None
) -> tuple[list[Path], Path | str]:
    """``SRC [SRC ...] DST`` (DST last, as with ``cp``) plus ``--sources-from``.

    DST stays a string when it is an ``s3://`` or ``gs://`` URL (a ``Path`` would fold
    its ``//``).
    """
    from loader.errors import InputError
    from loader.location import is_object_store

    if not paths:
        raise InputError("missing DST: sclayout convert SRC [SRC ...] DST")
    srcs = [Path(p) for p in paths[:-1]]
    srcs += read_sources_file(sources_from) if sources_from else []
    if not srcs:
        raise InputError(
            "missing SRC: sclayout convert SRC [SRC ...] DST (or --sources-from FILE DST)"
        )
    dst = str(paths[-1])
    return srcs, dst if is_object_store(dst) else Path(dst)


@click.command(
    "convert",
    short_help="Write a layout store from .h5ad or AnnData zarr sources.",
    epilog=epilog(
        "sclayout convert data.h5ad store.zarr",
        "sclayout convert data.h5ad store.zarr --order stratified --by plate --block-size 32",
        "sclayout convert data.h5ad store.zarr --spec spec.json --overwrite",
        "sclayout convert plate*.h5ad atlas.zarr --order stratified --by source --by cell_type",
        "sclayout convert data.h5ad store.zarr --order grouped --by split --by cell_type",
        "sclayout convert --sources-from files.txt atlas.zarr --join outer",
        "sclayout convert a.h5ad b.zarr panel.zarr --var-names genes.txt",
        "sclayout convert data.zarr store.zarr --scheduler tcp://10.0.0.5:8786 --json",
    ),
)
@click.argument("paths", nargs=-1, type=click.Path(path_type=str), metavar="SRC... DST")
@click.option(
    "--sources-from",
    type=click.Path(path_type=Path),
    default=None,
    help="File listing sources, one path a line (added after any SRC).",
)
@click.option(
    "--join",
    type=click.Choice(["inner", "outer"]),
    default=None,
    help="Sources with different genes: keep the common ones (inner) or the union (outer).",
)
@click.option(
    "--var-names",
    type=click.Path(path_type=Path),
    default=None,
    help="File with the store's genes, one a line: missing genes are zero, others dropped.",
)
@click.option(
    "--source-key",
    default="source",
    show_default=True,
    help="obs column naming each row's source (several sources; '' for none).",
)
@click.option("--strict", is_flag=True, help="Refuse to drop a layer or obsm not in every source.")
@click.option("--block-size", type=str, default=None, help="Rows per block [spec, else 64].")
@click.option(
    "--order",
    type=LazyChoice(order_names),
    default=None,
    help="Row order [original].",
)
@click.option(
    "--by", multiple=True, help="obs column to stratify or group by (repeatable; grouped: first)."
)
@click.option("--seed", type=int, default=None, help="Seed of the permutation [0].")
@click.option("--codec", type=LazyChoice(codec_names), default=None, help="Codec [blosc-lz4].")
@click.option(
    "--spec",
    type=click.Path(path_type=Path),
    default=None,
    help="Layout spec JSON (from `sclayout recommend`); options given here override it.",
)
@click.option(
    "--memory-budget", default="2GB", show_default=True, metavar="SIZE", help="Peak memory target."
)
@click.option(
    "--keep-dtypes",
    is_flag=True,
    help="Store values and column ids in the source's dtypes (default: narrowed where lossless).",
)
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
@click.option("--jobs", type=int, default=None, metavar="N", help="Worker threads [usable cores].")
@click.option(
    "--scheduler", default=None, metavar="ADDRESS", help="dask.distributed scheduler address."
)
@quiet_option
@json_option
def convert_command(
    paths: tuple[Path, ...],
    sources_from: Path | None,
    join: str | None,
    var_names: Path | None,
    source_key: str,
    strict: bool,
    block_size: str | None,
    order: str | None,
    by: tuple[str, ...],
    seed: int | None,
    codec: str | None,
    spec: Path | None,
    memory_budget: str,
    keep_dtypes: bool,
    overwrite: bool,
    jobs: int | None,
    scheduler: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert SRC (.h5ad or AnnData zarr) into the layout store DST.

    With several SRC, their rows go in order.

    DST appears only when the conversion is complete: it is written into a temporary
    sibling and renamed at the end.
    """
    from sclayout.convert import convert

    srcs, dst = split_paths(paths, sources_from)
    tidy_stale(dst)  # convert() tidies too, silently: here the user is told
    layout_spec, kwargs = _layout_options(spec, block_size, order, by, seed, codec)
    if scheduler is not None:
        require("distributed", "distributed", "--scheduler")
    t0 = time.perf_counter()
    manifest = convert(
        srcs[0] if len(srcs) == 1 else srcs,
        dst,
        join=join,
        var_names=var_names,
        source_key=source_key,
        strict=strict,
        spec=layout_spec,
        memory_budget=memory_budget,
        keep_dtypes=keep_dtypes,
        overwrite=overwrite,
        jobs=jobs,
        scheduler=scheduler,
        progress=show_progress(quiet),
        **kwargs,
    )
    seconds = time.perf_counter() - t0
    if not quiet or as_json:
        _report(manifest, srcs, dst, seconds, as_json=as_json)


def _layout_options(
    spec: Path | None,
    block_size: str | None,
    order: str | None,
    by: tuple[str, ...],
    seed: int | None,
    codec: str | None,
) -> tuple[Any, dict[str, Any]]:
    """Return the layout to write as ``(spec, keyword arguments of convert)``.

    Without ``--spec`` the options given become keywords; with it they override the
    spec's values and are folded into it.
    """
    from loader.errors import InputError
    from loader.layout import RowOrder, parse_block_size
    from loader.spec import LayoutSpec

    size = parse_block_size(block_size, name="--block-size") if block_size is not None else None
    if spec is None:
        kwargs = {"block_size": size, "order": order, "by": by, "seed": seed, "codec": codec}
        return None, {k: v for k, v in kwargs.items() if v is not None and v != ()}
    layout_spec = LayoutSpec.load(spec)
    st = layout_spec.store
    kind = order or st.order.kind
    if by and kind not in ("stratified", "grouped"):
        raise InputError(
            f"--by {by[0]!r}: columns are only used with --order stratified or grouped "
            f"(order is {kind!r}); drop --by or pass --order stratified"
        )
    merged_order = RowOrder(
        kind=kind,
        seed=seed if seed is not None else st.order.seed,
        columns=by or (st.order.columns if kind in ("stratified", "grouped") else ()),
    )
    layout_spec = layout_spec.with_store(
        block_size=size or st.block_size, order=merged_order, codec=codec or st.codec
    )
    return layout_spec, {}


def _report(
    manifest: Any, srcs: list[Path], dst: Path | str, seconds: float, *, as_json: bool
) -> None:
    """Print what was written: one JSON document, or notes and a one-line summary."""
    remote = isinstance(dst, str)  # s3:// or gs://: sizes are not listed back
    written, files = (0, 0) if remote else _dir_bytes(dst)
    arrays = sum(len(m.arrays) for m in manifest.matrices.values())
    if as_json:
        summary = {
            "sources": [str(x) for x in srcs],
            "store": str(dst),
            "n_obs": manifest.n_obs,
            "n_vars": manifest.n_vars,
            "n_blocks": manifest.n_blocks,
            "block_size": manifest.block_size,
            "order": manifest.order.kind,
            "matrices": len(manifest.matrices),
            "arrays": arrays,
            "bytes_written": None if remote else written,
            "files": None if remote else files,
            "seconds": round(seconds, 3),
        }
        click.echo(json.dumps(summary, indent=1))
        return
    sources = manifest.sources or ({"fingerprint": manifest.source},)
    src_bytes = sum(e["fingerprint"].get("size", 0) for e in sources)
    what = srcs[0] if len(srcs) == 1 else f"{len(srcs)} sources"
    for note in manifest.notes:
        click.echo(f"note: {note}")
    if len(srcs) > 1 or manifest.genes.get("join") not in (None, "same"):
        click.echo(f"genes: {manifest.n_vars} ({manifest.genes.get('join')})")
    click.echo(
        f"converted {what} -> {dst}: {manifest.n_obs} rows x {manifest.n_vars} vars, "
        f"{manifest.n_blocks} blocks of {manifest.block_size}, order {manifest.order.kind}, "
        f"{len(manifest.matrices)} matrices ({arrays} arrays), "
        + ("" if remote else f"{written / 1e6:.1f} MB in {files} files, ")
        + f"{seconds:.1f} s, "
        f"{src_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s of source"
    )
