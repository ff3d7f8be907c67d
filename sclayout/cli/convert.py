"""``sclayout convert``: parse the options, call :func:`sclayout.convert.convert`, print.

Options given with ``--spec`` override the spec's values.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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
)

__all__ = ["convert_command"]


def _dir_bytes(path: Path) -> tuple[int, int]:
    files = total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            files += 1
            total += os.path.getsize(os.path.join(dirpath, n))
    return total, files


@click.command(
    "convert",
    short_help="Write a layout store from an .h5ad or AnnData zarr.",
    epilog=epilog(
        "sclayout convert data.h5ad store.zarr",
        "sclayout convert data.h5ad store.zarr --order stratified --by plate --block-size 32",
        "sclayout convert data.h5ad store.zarr --spec spec.json --overwrite",
        "sclayout convert data.zarr store.zarr --scheduler tcp://10.0.0.5:8786 --json",
    ),
)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--block-size", type=str, default=None, help="Rows per block [spec, else 64].")
@click.option(
    "--order",
    type=LazyChoice(order_names),
    default=None,
    help="Row order [original].",
)
@click.option("--by", multiple=True, help="obs column to stratify by (repeatable).")
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
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
@click.option("--jobs", type=int, default=None, metavar="N", help="Worker threads [CPUs].")
@click.option(
    "--scheduler", default=None, metavar="ADDRESS", help="dask.distributed scheduler address."
)
@quiet_option
@json_option
def convert_command(
    src: Path,
    dst: Path,
    block_size: str | None,
    order: str | None,
    by: tuple[str, ...],
    seed: int | None,
    codec: str | None,
    spec: Path | None,
    memory_budget: str,
    overwrite: bool,
    jobs: int | None,
    scheduler: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert SRC (.h5ad or AnnData zarr) into the layout store DST.

    DST appears only when the conversion is complete: it is written into a temporary
    sibling and renamed at the end.
    """
    from loader.errors import InputError
    from loader.layout import RowOrder, parse_block_size
    from loader.spec import LayoutSpec
    from sclayout.convert import convert

    size = parse_block_size(block_size, name="--block-size") if block_size is not None else None
    kwargs = {"block_size": size, "order": order, "by": by, "seed": seed, "codec": codec}
    layout_spec = None
    if spec is not None:  # explicit options override the spec: fold them into it
        layout_spec = LayoutSpec.load(spec)
        st = layout_spec.store
        kind = order or st.order.kind
        if by and kind != "stratified":
            raise InputError(
                f"--by {by[0]!r}: columns are only used with --order stratified "
                f"(order is {kind!r}); drop --by or pass --order stratified"
            )
        merged_order = RowOrder(
            kind=kind,
            seed=seed if seed is not None else st.order.seed,
            columns=by or (st.order.columns if kind == "stratified" else ()),
        )
        layout_spec = layout_spec.with_store(
            block_size=size or st.block_size, order=merged_order, codec=codec or st.codec
        )
        kwargs = {}
    kwargs = {k: v for k, v in kwargs.items() if v is not None and v != ()}
    if scheduler is not None:
        require("distributed", "distributed", "--scheduler")
    t0 = time.perf_counter()
    manifest = convert(
        src,
        dst,
        spec=layout_spec,
        memory_budget=memory_budget,
        overwrite=overwrite,
        jobs=jobs,
        scheduler=scheduler,
        progress=show_progress(quiet),
        **kwargs,
    )
    seconds = time.perf_counter() - t0
    if quiet and not as_json:
        return
    written, files = _dir_bytes(dst)
    src_bytes = manifest.source.get("size", 0)
    arrays = sum(len(m.arrays) for m in manifest.matrices.values())
    if as_json:
        summary = {
            "source": str(src),
            "store": str(dst),
            "n_obs": manifest.n_obs,
            "n_vars": manifest.n_vars,
            "n_blocks": manifest.n_blocks,
            "block_size": manifest.block_size,
            "order": manifest.order.kind,
            "matrices": len(manifest.matrices),
            "arrays": arrays,
            "bytes_written": written,
            "files": files,
            "seconds": round(seconds, 3),
        }
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(
        f"converted {src} -> {dst}: {manifest.n_obs} rows x {manifest.n_vars} vars, "
        f"{manifest.n_blocks} blocks of {manifest.block_size}, order {manifest.order.kind}, "
        f"{len(manifest.matrices)} matrices ({arrays} arrays), "
        f"{written / 1e6:.1f} MB in {files} files, {seconds:.1f} s, "
        f"{src_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s of source"
    )
