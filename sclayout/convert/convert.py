"""``convert``: AnnData source -> layout store (the orchestrator).

Steps: validate everything cheap first (source, options, destination); build the row
permutation; write every small element with anndata into a zarr v3 store in a
temporary sibling of DST; write each row-aligned matrix (X, layers, raw/X) with
shard-aligned dask tasks (a direct copy in the source order, the bucketed two-pass
reorder otherwise); write ``uns/sclayout``; write the manifest last; rename into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from loader.argtypes import typechecked
from loader.errors import InputError, SpecError
from loader.layout import (
    MANIFEST_KEY,
    SCLAYOUT_UNS,
    ArrayLayout,
    Manifest,
    MatrixLayout,
    RowOrder,
    block_pointer_path,
    parse_block_size,
    row_chunk_rows,
)
from loader.location import is_object_store, split_bucket
from loader.spec import LayoutSpec
from sclayout.convert import external as ext
from sclayout.convert._buffers import release_scratch
from sclayout.convert.checks import (
    check_destination,
    check_obs_columns,
    explain_read_errors,
)
from sclayout.convert.codecs import get_codec
from sclayout.convert.inputs import Input, check_by, quiet_write, single_input, sources_input
from sclayout.convert.narrow import ValueStats, run_stats, stats_jobs, stored_dtypes
from sclayout.convert.order import get_order, inverse_permutation
from sclayout.convert.parts import Part
from sclayout.convert.plan import (
    DEFAULT_BLOCK_SIZE,
    MatrixPlan,
    parse_memory_budget,
    plan_csr,
    plan_dense,
    shard_bytes_for_budget,
)
from sclayout.convert.remote import delete_store, remote_store_state, upload_tree
from sclayout.convert.source import (
    DIRECT_PIECE,
    IO_THREADS,
    MatrixInfo,
    Source,
    close_handles,
    open_group,
    prefer_direct_io,
    read_slice,
)
from sclayout.convert.sources import (
    check_destination_apart,
    check_sources,
    read_var_names,
)
from sclayout.convert.space import (
    check_free_space,
    estimate_store_bytes,
    is_no_space,
    no_space_error,
    route_bytes,
)
from sclayout.convert.stale import OLD_TAG, TMP_TAG, clean_stale, hold, sibling
from sclayout.convert.write import (
    CopyJob,
    Runner,
    anndata_dataset_kwargs,
    checksum_codecs,
    close_dst,
    copy_dense,
    copy_sparse,
    create_matrix,
    rechunk_obs_codes,
    shard_ranges,
    write_region,
    write_row_table,
)
from sclayout.pagecache import tree_bytes

__all__ = ["ConvertOptions", "convert", "resolve_options"]

ROUTE_COPIES = 4
"""A route task holds its source slice about four times (read, gathered copy, per-row
index arrays, file buffers): its slice is ``budget / (jobs × 4)``."""
ASSEMBLE_INDEX_BYTES = 16
"""Pass 2 keeps an int64 gather index plus sort keys per element on top of the bucket
and its sorted copy."""
DRIVER_BYTES_PER_ROW = 64
"""Driver-side arrays per row: permutation, its inverse, source and output indptr,
block pointer, stratum keys (int64 each), and with several sources the per-row
source number and row (provenance). The obs table is counted as it is read: the
working memory is what the budget leaves beside the process's resident size."""
WORK_MARGIN = 64 * 2**20
"""Head-room kept for the interpreter's transient allocations and library buffers."""
MIN_WORK = 64 * 2**20
"""Least working memory a budget above the process's size must leave for the tasks
(a few shards' worth: less would only make the conversion crawl)."""
NAME_MAX = 255
"""Longest file name (bytes) on Linux file systems: DST's temporary siblings must fit."""
WORK_DIR = "_sclayout_work"


@dataclass(frozen=True)
class ConvertOptions:
    """The resolved options of one conversion (explicit arguments over the spec)."""

    block_size: int | None
    order: RowOrder
    codec: str
    memory_budget: int
    chunk_blocks: int = 1
    csr_chunk_nnz: int | None = None
    shard_chunks: int | None = None
    checksums: bool = True
    keep_dtypes: bool = False


def resolve_options(
    *,
    spec: LayoutSpec | str | os.PathLike | None,
    block_size: int | None,
    order: str,
    by: Sequence[str],
    seed: int,
    codec: str,
    memory_budget: str | int,
) -> ConvertOptions:
    """Merge a spec with explicit arguments; arguments at their defaults take the spec's."""
    by = (by,) if isinstance(by, str) else tuple(by)
    if spec is not None and not isinstance(spec, LayoutSpec):
        spec = LayoutSpec.load(spec)
    store = spec.store if spec is not None else None
    if block_size is not None:
        block_size = parse_block_size(block_size)
    elif store is not None:
        block_size = store.block_size
    if store is not None:
        order = order if order != "original" else store.order.kind
        if not by and order in ("stratified", "grouped"):
            by = store.order.columns
        if seed == 0 and store.order.seed is not None:
            seed = store.order.seed
        codec = codec if codec != "blosc-lz4" else store.codec
    if by and order not in ("stratified", "grouped"):
        raise InputError(
            f"--by {by[0]!r}: columns are only used with --order stratified or grouped "
            f"(order is {order!r}); drop --by or pass --order stratified"
        )
    get_order(order)
    get_codec(codec)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise SpecError(f"seed={seed!r}: must be an integer >= 0")
    row_order = RowOrder(
        kind=order, seed=None if order == "original" else int(seed), columns=tuple(by)
    )
    return ConvertOptions(
        block_size=block_size,
        order=row_order,
        codec=codec,
        memory_budget=parse_memory_budget(memory_budget),
        chunk_blocks=store.chunk_blocks if store else 1,
        csr_chunk_nnz=store.csr_chunk_nnz if store else None,
        shard_chunks=store.shard_chunks if store else None,
    )


@typechecked(own_checks=("block_size",))
def convert(
    src: str | os.PathLike | Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    *,
    join: str | None = None,
    var_names: Sequence[str] | str | os.PathLike | None = None,
    source_key: str = "source",
    strict: bool = False,
    spec: LayoutSpec | str | os.PathLike | None = None,
    block_size: int | None = None,
    order: str = "original",
    by: Sequence[str] = (),
    seed: int = 0,
    codec: str = "blosc-lz4",
    memory_budget: str | int = "2GB",
    overwrite: bool = False,
    jobs: int | None = None,
    scheduler: str | None = None,
    progress: bool = False,
    checksums: bool = True,
    keep_dtypes: bool = False,
) -> Manifest:
    """Convert one or several AnnData sources (.h5ad or zarr v2/v3) into a layout store.

    Parameters
    ----------
    src
        The source dataset, or a list of them: the store holds their rows in this
        order (before ``order`` reorders them), see docs/convert.md.
    dst
        The layout store to create: a directory, or an ``s3://`` / ``gs://`` URL
        (docs/object-stores.md: shards are written straight to the bucket, the
        manifest last; ``overwrite`` then deletes the old store first).
    join
        Sources whose genes differ: ``"inner"`` (genes in every source) or
        ``"outer"`` (their union; a gene a source lacks is a structural zero).
    var_names
        The store's genes, exactly (a list, or a file with one gene a line): genes a
        source lacks are zeros, genes not listed are dropped.
    source_key
        obs column naming each row's source when there are several (``""``: none).
    strict
        Refuse, instead of dropping with a note, a layer or obsm not in every source.
    spec
        A :class:`~loader.spec.LayoutSpec` or the path of its JSON; arguments left at
        their defaults take the spec's values, explicit ones override it.
    block_size
        Rows per block; default: the spec's, else :data:`~sclayout.convert.plan.DEFAULT_BLOCK_SIZE`.
    order
        ``original``, ``shuffled``, ``stratified`` or ``grouped`` (see
        :mod:`sclayout.convert.order`).
    by
        obs columns to stratify by (``order="stratified"``); with ``order="grouped"``
        the first is the column to group by (e.g. a train/validation split), the rest
        stratify within each group.
    seed
        Seed of the shuffled/stratified permutation.
    codec
        Codec name (:data:`~sclayout.convert.codecs.CODECS`).
    memory_budget
        Peak memory to aim for (``"2GB"``, ``"512MiB"`` or bytes); sizes read slices,
        buckets and shards, independent of the number of rows.
    overwrite
        Replace an existing DST.
    jobs
        Worker threads (default: CPUs).
    scheduler
        Address of a dask.distributed scheduler to run the tasks on.
    progress
        Show progress bars.
    checksums
        End every inner chunk with its crc32c (format version 2's ``chunk_checksum``),
        which every reader verifies. ``False`` only to measure what the check costs.
    keep_dtypes
        Store values and column ids in the source's dtypes. By default they are
        narrowed where every value fits (:mod:`sclayout.convert.narrow`): column ids
        ``uint16`` below 65,536 genes, integer counts the smallest integer type.

    Returns
    -------
    Manifest
        The manifest written as the store's root attribute ``sclayout``.

    Raises
    ------
    InputError
        Bad source, bad option, DST exists without ``overwrite``, DST not writable.
    """
    srcs = [src] if isinstance(src, str | os.PathLike) else list(src)
    infos = check_sources(srcs)  # the metadata checks of check_source, per source
    if isinstance(var_names, str | os.PathLike):
        var_names = read_var_names(var_names)
    opts = resolve_options(
        spec=spec,
        block_size=block_size,
        order=order,
        by=by,
        seed=seed,
        codec=codec,
        memory_budget=memory_budget,
    )
    if not isinstance(checksums, bool):
        raise InputError(f"checksums={checksums!r}: pass True or False")
    opts = dataclasses.replace(opts, checksums=checksums, keep_dtypes=keep_dtypes)
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise InputError(f"jobs={jobs!r}: must be a positive integer")
    src_p = Path(srcs[0])
    remote = os.fspath(dst).rstrip("/") if is_object_store(os.fspath(dst)) else None
    several = len(srcs) > 1 or infos[0].legacy or var_names is not None
    if several:
        check_by(srcs, infos, opts.order.columns, source_key if len(srcs) > 1 else "")
    else:
        check_obs_columns(src_p, opts.order.columns, info=infos[0])
    if remote is not None:
        _check_remote_destination(remote, overwrite=overwrite)
        # no rename in an object store: small elements and the reorder's scratch are
        # staged locally, the shards go straight to the bucket (sclayout.convert.remote)
        tmp = Path(tempfile.mkdtemp(prefix="sclayout-convert-")) / "store"
        dst_p = tmp
    else:
        dst_p = Path(os.path.abspath(dst))
        tmp = sibling(dst_p, TMP_TAG)
        longest = max(len(tmp.name.encode()), len(sibling(dst_p, OLD_TAG).name.encode()))
        if longest > NAME_MAX:
            raise InputError(
                f"DST {dst_p.name}: name too long for its temporary sibling ({longest} bytes, "
                f"the file system allows {NAME_MAX}); choose a shorter name"
            )
        clean_stale(dst_p)  # first: it may put back a DST a killed --overwrite moved aside
        check_destination_apart(dst_p, srcs)
        check_destination(dst_p, overwrite=overwrite, src=src_p)
    runner = Runner(jobs=jobs, scheduler=scheduler, progress=progress)
    need = 0
    lock = None
    try:
        if remote is None:  # locked while it lives: clean_stale leaves it alone
            tmp.mkdir()
            with contextlib.suppress(OSError):  # no locks on this file system: the pid guards
                lock = hold(tmp)
        reorder = several or opts.order.kind != "original"
        need = _store_bytes(srcs, infos, opts.codec, reorder=reorder)
        if remote is None:
            check_free_space(dst_p, need)  # the old DST stays until the rename: not free
        if several:
            inp = sources_input(
                srcs, infos, join=join, var_names=var_names, source_key=source_key, strict=strict
            )
            manifest = _convert_into(inp, tmp, opts, runner, remote)
        else:
            with open_group(src_p) as root:
                manifest = _convert_into(
                    single_input(Source(root, src_p)), tmp, opts, runner, remote
                )
        if remote is None:
            _install(tmp, dst_p, overwrite=overwrite)
        else:
            upload_tree(tmp, remote)  # the root zarr.json (the manifest) last
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(e):
            raise no_space_error(dst_p, need) from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise InputError(
                f"DST {dst_p}: cannot write ({e.strerror}); choose a writable location"
            ) from None
        if _names_destination(e, tmp, dst_p):
            raise InputError(
                f"DST {dst_p}: writing failed ({e.strerror or e}); check the destination "
                "(free space, quota, permissions) or choose another DST"
            ) from None
        with explain_read_errors(src_p):  # anything else: the source failed to read
            raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_no_space(e):  # tensorstore's RESOURCE_EXHAUSTED
            raise no_space_error(dst_p, need) from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
        runner.close()
        close_handles()
        close_dst()
        release_scratch()
        if remote is not None:
            shutil.rmtree(tmp.parent, ignore_errors=True)
    return manifest


def _check_remote_destination(url: str, *, overwrite: bool) -> None:
    """Refuse an object-store DST that holds objects, unless ``overwrite`` (then delete them).

    An object store cannot swap a new store in by renaming: ``--overwrite`` deletes the
    old store before the new one is written (docs/object-stores.md).
    """
    try:
        split_bucket(url)
    except ValueError as e:
        raise InputError(f"DST {e}") from None
    state = remote_store_state(url)
    if state == "empty":
        return
    if not overwrite:
        what = "a layout store" if state == "store" else "objects but no layout store"
        raise InputError(f"DST {url} holds {what}: pass --overwrite to replace it")
    delete_store(url)


def _rss() -> int:
    """Resident memory of this process now (Linux /proc; else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def working_memory(budget: int, *, n_obs: int) -> int:
    """Bytes the conversion tasks may use.

    The budget minus the process's current resident memory (the obs table included),
    the per-cell tables (:data:`DRIVER_BYTES_PER_ROW` a cell), the I/O threads' staging
    buffers and a margin. A budget below the process's own size (tiny budgets in tests)
    gets a quarter of itself: tasks as small as they go.

    Raises
    ------
    InputError
        When a budget above the process's size leaves less than :data:`MIN_WORK` and
        the per-cell tables take at least that much (about 10^6 cells and more): the
        tables of this many cells do not fit in it.
    """
    staging = IO_THREADS * DIRECT_PIECE  # the I/O threads' O_DIRECT staging buffers
    rss = _rss()
    tables = DRIVER_BYTES_PER_ROW * n_obs
    held = rss + tables + WORK_MARGIN + staging
    spare = budget - held
    if budget >= rss and spare < MIN_WORK <= tables:
        need = -(-(held + MIN_WORK) // 10**8) / 10  # GB, rounded up to 0.1
        raise InputError(
            f"--memory-budget {_gb(budget)} is too small for {n_obs:,} cells: the process "
            f"({_gb(rss)}) and its per-cell tables ({DRIVER_BYTES_PER_ROW} bytes a cell, "
            f"{_gb(tables)}) leave too little to convert with; "
            f"pass --memory-budget {need:g}GB or more"
        )
    return max(spare, budget // 4)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


# -- destination safety ------------------------------------------------------------------


def _names_destination(e: OSError, tmp: Path, dst: Path) -> bool:
    """Whether the failed call was on the store being written (or its final place)."""
    names = [n for n in (e.filename, e.filename2) if n is not None]
    roots = (str(tmp), str(dst))
    return any(os.fspath(n).startswith(roots) for n in names)


def _install(tmp: Path, dst: Path, *, overwrite: bool) -> None:
    """Move the finished store into place.

    DST is never half-written, and the old DST is put back if the new one cannot take
    its place.
    """
    if dst.exists():
        if not overwrite:  # appeared while we converted
            raise InputError(f"DST {dst} exists: pass --overwrite to replace it")
        old = sibling(dst, OLD_TAG)
        lock = None
        with contextlib.suppress(OSError):  # held while aside: clean_stale leaves it alone
            lock = hold(dst)
        try:
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except OSError:
                os.rename(old, dst)  # the user's store back where it was
                raise
            shutil.rmtree(old, ignore_errors=True)
        finally:
            if lock is not None:
                os.close(lock)
    else:
        os.rename(tmp, dst)


# -- the conversion ----------------------------------------------------------------------


def _convert_into(
    inp: Input, tmp: Path, opts: ConvertOptions, runner: Runner, remote: str | None = None
) -> Manifest:
    """Write the store into local folder ``tmp``; the big arrays into ``remote`` if given."""
    n_obs, n_vars = inp.n_obs, inp.n_vars
    obs = inp.obs
    missing = [c for c in opts.order.columns if c not in obs.columns]
    if missing:
        raise InputError(
            f"--by {missing[0]!r}: no such obs column; available: "
            f"{', '.join(map(str, obs.columns)) or '(none)'}"
        )
    block_size = opts.block_size or DEFAULT_BLOCK_SIZE
    perm = get_order(opts.order.kind)(
        n_obs, obs=obs, by=opts.order.columns, seed=opts.order.seed or 0
    )
    identity = opts.order.kind == "original"
    inv = inverse_permutation(perm)
    tmp.mkdir(exist_ok=True)  # convert() made and locked a local one: keep that folder
    root = zarr.open_group(tmp, mode="w-", zarr_format=3)  # "w" would recreate it
    root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    small = anndata_dataset_kwargs(opts.checksums)
    inp.write_small(root, perm, small)
    rechunk_obs_codes(  # obs labels in row chunks, read per fetch like the row tables
        tmp,
        block_size=block_size,
        compressors=get_codec(opts.codec) + checksum_codecs(opts.checksums),
        shard_bytes=shard_bytes_for_budget(opts.memory_budget),
    )
    matrices: dict[str, MatrixLayout] = {}
    pointers: dict[str, np.ndarray] = {}
    work = working_memory(opts.memory_budget, n_obs=n_obs)
    ctx = _Ctx(remote or str(tmp), str(tmp), opts, block_size, runner, perm, inv, identity, work)
    for target, parts in inp.matrices:
        layout, pointer = _convert_matrix(ctx, target, parts)
        matrices[target.path] = layout
        if pointer is not None:
            pointers[target.path] = pointer
    shutil.rmtree(tmp / WORK_DIR, ignore_errors=True)
    provenance = _write_uns_sclayout(root, perm, pointers, inp, small, ctx)
    manifest = Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        block_size=block_size,
        order=opts.order,
        matrices=matrices,
        source=inp.sources[0]["fingerprint"] if len(inp.sources) == 1 else {},
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        chunk_checksum="crc32c" if opts.checksums else None,
        all_chunks_stored=True,
        sources=tuple(inp.sources),
        genes=inp.genes,
        provenance=provenance,
        notes=tuple(inp.notes),
        generation=uuid.uuid4().hex,  # a new one each time: readers tell a replaced store
        row_chunks=row_chunk_rows(block_size),
    )
    root.attrs[MANIFEST_KEY] = manifest.to_dict()  # last: marks the store complete
    return manifest


@dataclass(frozen=True)
class _Ctx:
    dst: str
    """Where the big arrays' shards go: ``local``, or an ``s3://`` / ``gs://`` URL."""
    local: str
    """The local folder holding the store's small elements and the reorder's scratch."""
    opts: ConvertOptions
    block_size: int
    runner: Runner
    perm: np.ndarray
    inv: np.ndarray
    identity: bool
    work: int
    """Bytes the tasks may use together: the budget minus what the process already holds."""

    @property
    def jobs(self) -> int:
        return self.runner.jobs


def _write_uns_sclayout(
    root: zarr.Group, perm: np.ndarray, pointers: dict, inp: Input, kw: dict[str, Any], ctx: _Ctx
) -> dict[str, str]:
    """Write source_index, block pointers and the per-row provenance.

    Provenance (source number, row in that source) only with several sources; returns
    the provenance paths. The per-row tables are sharded like X (:func:`write_row_table`).
    """
    uns = root["uns"]
    payload: dict[str, Any] = {
        "block_indptr": {block_pointer_path(m).rsplit("/", 1)[-1]: p for m, p in pointers.items()},
    }
    tables: dict[str, Any] = {"source_index": perm.astype(np.int64)}
    provenance: dict[str, str] = {}
    if inp.row_source is not None:
        number = inp.row_source[perm]
        row0 = np.array([e["row0"] for e in inp.sources], dtype=np.int64)
        n_src = len(inp.sources)
        tables["source_number"] = number.astype(np.uint16 if n_src < 2**16 else np.int32)
        tables["source_row"] = perm.astype(np.int64) - row0[number]
        provenance = {k: f"{SCLAYOUT_UNS}/{k}" for k in ("source_number", "source_row")}
        provenance["obs_key"] = inp.source_key
    quiet_write(uns, SCLAYOUT_UNS.split("/", 1)[1], payload, kw)
    compressors = get_codec(ctx.opts.codec) + checksum_codecs(ctx.opts.checksums)
    shard_bytes = shard_bytes_for_budget(ctx.opts.memory_budget)
    for name, values in tables.items():
        write_row_table(
            ctx.local,
            f"{SCLAYOUT_UNS}/{name}",
            values,
            block_size=ctx.block_size,
            compressors=compressors,
            shard_bytes=shard_bytes,
        )
    return provenance


def _store_bytes(srcs: list[Path], infos: list[Any], codec: str, *, reorder: bool) -> int:
    """Free bytes a conversion of ``srcs`` needs.

    The store (a legacy file: its own size), plus the route files of a reordering
    conversion.
    """
    total = 0
    ratios: dict[tuple, list[float]] = {}  # codec ratios sampled on the first sources
    for src, info in zip(srcs, infos, strict=True):
        if info.legacy:
            total += tree_bytes(src)[0] * (2 if reorder else 1)
            continue
        with open_group(Path(src)) as root:
            source = Source(root, Path(src))
            total += estimate_store_bytes(source, codec, ratios=ratios)
            total += route_bytes(source) if reorder else 0
    return total


def _array_layout(path: str, arr: zarr.Array, codec: str) -> ArrayLayout:
    return ArrayLayout(
        path=path,
        shape=tuple(arr.shape),
        dtype=str(arr.dtype),
        chunks=tuple(arr.chunks),
        shards=None if arr.shards is None else tuple(arr.shards),
        codec=codec,
    )


def _publish(ctx: _Ctx, path: str) -> None:
    """Upload the metadata of the arrays at ``path`` when their shards go to a bucket.

    The tasks open the arrays there before writing their shards.
    """
    if ctx.dst != ctx.local:
        upload_tree(ctx.local, ctx.dst, under=path)


def _convert_matrix(
    ctx: _Ctx, info: MatrixInfo, parts: list[Part]
) -> tuple[MatrixLayout, np.ndarray | None]:
    """Write output matrix ``info`` (path, shape, dtype) from its per-source parts."""
    opts = ctx.opts
    compressors = get_codec(opts.codec) + checksum_codecs(opts.checksums)
    n_obs, n_vars = info.shape
    shard_bytes = shard_bytes_for_budget(opts.memory_budget)
    root = zarr.open_group(ctx.local, mode="r+", zarr_format=3)
    if info.encoding == "dense":
        plan = plan_dense(
            n_obs=n_obs,
            n_vars=n_vars,
            block_size=ctx.block_size,
            itemsize=info.itemsize,
            shard_bytes=shard_bytes,
            chunk_blocks=opts.chunk_blocks,
            shard_chunks=opts.shard_chunks,
        )
        dtypes = _stored_dtypes(ctx, info, parts)
        arrays = create_matrix(root, info, plan, nnz=0, compressors=compressors, dtypes=dtypes)
        _publish(ctx, info.path)
        _fill_dense(ctx, info, plan, parts)
        layout = MatrixLayout(
            encoding="dense",
            shape=(n_obs, n_vars),
            dtype=str(info.dtype),
            nnz=n_obs * n_vars,
            arrays={"values": _array_layout(info.path, arrays["values"], opts.codec)},
        )
        return layout, None
    # row pointer (csr) or column pointer (csc) of every sparse part
    ptrs = [
        None
        if p.encoding == "dense"
        else read_slice(p.src, f"{p.path}/indptr", 0, p.shape[p.encoding == "csc"] + 1).astype(
            np.int64
        )
        for p in parts
    ]
    step = max(1, ctx.work // (4 * 8))
    row_nnz = np.concatenate(
        [p.row_nnz(ptr, step=step) for p, ptr in zip(parts, ptrs, strict=True)]
    )
    out_ptr = np.zeros(n_obs + 1, dtype=np.int64)
    np.cumsum(row_nnz[ctx.perm], out=out_ptr[1:])
    nnz = int(out_ptr[-1])
    plan = plan_csr(
        n_obs=n_obs,
        nnz=nnz,
        block_size=ctx.block_size,
        itemsize=info.itemsize,
        shard_bytes=shard_bytes,
        csr_chunk_nnz=opts.csr_chunk_nnz,
        shard_chunks=opts.shard_chunks,
    )
    dtypes = _stored_dtypes(ctx, info, parts)
    arrays = create_matrix(root, info, plan, nnz=nnz, compressors=compressors, dtypes=dtypes)
    _publish(ctx, info.path)
    one = parts[0]
    if len(parts) == 1 and one.plain and one.encoding == "csr" and ctx.identity:
        _copy_csr(ctx, info, plan, one, ptrs[0], out_ptr, nnz)
    else:
        _reorder_sparse(ctx, info, plan, parts, ptrs, out_ptr, nnz)
    ptr_shard = plan.arrays["indptr"].shards[0]
    for a, b in shard_ranges(n_obs + 1, ptr_shard):
        write_region(ctx.dst, f"{info.path}/indptr", a, out_ptr[a:b])
    pointer = out_ptr[np.r_[np.arange(0, n_obs, ctx.block_size), n_obs]]
    layout = MatrixLayout(
        encoding="csr",
        shape=(n_obs, n_vars),
        dtype=str(info.dtype),
        nnz=nnz,
        arrays={
            role: _array_layout(f"{info.path}/{role}", arr, opts.codec)
            for role, arr in arrays.items()
        },
        block_pointer=block_pointer_path(info.path),
    )
    return layout, pointer


def _stored_dtypes(
    ctx: _Ctx, info: MatrixInfo, parts: list[Part]
) -> tuple[np.dtype, np.dtype | None]:
    """Return the stored (value, column id) dtypes of ``info``: one pass over its values."""
    if ctx.opts.keep_dtypes:
        return stored_dtypes(info, None)
    elements = max(1, ctx.work // (ctx.jobs * 4 * info.itemsize))
    jobs = stats_jobs(parts, elements=elements)
    found = ctx.runner.run(run_stats, jobs, desc=f"scan {info.path}")
    return stored_dtypes(info, functools.reduce(ValueStats.merge, found, ValueStats()))


def _copy_csr(ctx: _Ctx, info: MatrixInfo, plan: MatrixPlan, part: Part, src_ptr, out_ptr, nnz):
    if int(src_ptr[0]) != 0:  # an indptr that does not start at 0: the general path
        _reorder_sparse(ctx, info, plan, [part], [src_ptr], out_ptr, nnz)
        return
    jobs = [
        CopyJob(part.src, part.path, ctx.dst, info.path, a, b)
        for a, b in shard_ranges(nnz, plan.elements_per_shard)
    ]
    ctx.runner.run(copy_sparse, jobs, desc=f"copy {info.path}")


def _row_cuts(part: Part, ptr: np.ndarray | None, elems: int) -> list[int]:
    """Row (CSR, dense) or column (CSC) boundaries of slices of about ``elems`` values."""
    if ptr is not None:
        return _cuts(ptr, elems)
    n = part.shape[0]
    rows = max(1, elems // max(1, part.shape[1]))
    return sorted({0, n, *range(rows, n, rows)})


def _reorder_sparse(ctx, info, plan, parts, ptrs, out_ptr, nnz) -> None:
    """Bucketed two-pass reorder of CSR, CSC and dense parts into CSR output.

    All-CSR/dense parts route rows (the fast path); any CSC part routes entries.
    """
    coo = any(p.encoding == "csc" for p in parts)
    elem_bytes = info.itemsize + (info.index_dtype.itemsize if info.index_dtype else 8)
    shard = plan.elements_per_shard
    per_elem = 3 * elem_bytes + ASSEMBLE_INDEX_BYTES + (8 if coo else 0)
    bucket = ctx.work // (ctx.jobs * per_elem)
    bounds = ext.bucket_bounds(nnz, shard=shard, bucket=bucket)
    workdir = os.path.join(ctx.local, WORK_DIR, info.path.replace("/", "__"))
    read_elems = max(1, ctx.work // (ctx.jobs * ROUTE_COPIES * elem_bytes))
    direct = prefer_direct_io(parts[0].src, nbytes=nnz * elem_bytes)
    jobs: list[Any] = []
    if not coo and len(parts) > 1:
        for task in task_slices(parts, ptrs, read_elems):
            (k, a, b), more = task[0], tuple((parts[j], c, d, ptrs[j]) for j, c, d in task[1:])
            p = parts[k]
            jobs.append(
                ext.RouteRowsJob(
                    p.src, p.path, a, b, ptrs[k], ctx.inv, out_ptr, bounds, workdir,
                    len(jobs), direct, p, more,
                )
            )  # fmt: skip
    else:
        for p, ptr in zip(parts, ptrs, strict=True):
            native = "csc" if coo else "csr"
            part = None if p.plain and p.encoding == native else p
            for a, b in itertools.pairwise(_row_cuts(p, ptr, read_elems)):
                if coo:
                    jobs.append(
                        ext.RouteCscJob(
                            p.src, p.path, a, b, ptr, ctx.inv, out_ptr, bounds, workdir,
                            info.index_dtype, part,
                        )
                    )  # fmt: skip
                else:
                    jobs.append(
                        ext.RouteRowsJob(
                            p.src, p.path, a, b, ptr, ctx.inv, out_ptr, bounds, workdir,
                            len(jobs), direct, part,
                        )
                    )  # fmt: skip
    kind = "csc" if coo else "rows"
    tables = ctx.runner.run(
        ext.route_csc if coo else ext.route_rows, jobs, desc=f"route {info.path}"
    )
    n_buckets = len(bounds) - 1
    segments = ext.segments_by_bucket(tables, n_buckets) if kind == "rows" else [None] * n_buckets
    first_rows = np.searchsorted(out_ptr, bounds[:-1], side="right") - 1
    assemble = [
        ext.AssembleJob(
            kind,
            workdir,
            b,
            int(bounds[b]),
            int(bounds[b + 1]),
            int(out_ptr[first_rows[b]]),
            ctx.dst,
            info.path,
            shard,
            info.dtype,
            info.index_dtype,
            info.shape[1],
            segments[b],
            direct,
        )
        for b in range(n_buckets)
    ]
    width = _parallel(ctx, int(np.diff(bounds).max(initial=0)) * per_elem)
    ctx.runner.run(ext.assemble, assemble, desc=f"write {info.path}", width=width)
    shutil.rmtree(workdir, ignore_errors=True)  # route files of every bucket: free the disk now


def task_slices(
    parts: list[Part], ptrs: list[np.ndarray | None], step: int
) -> list[list[tuple[int, int, int]]]:
    """Cut the rows of several parts into route tasks of about ``step`` elements each.

    A task is a list of (part number, first row, end row): consecutive CSR parts share
    a task, so small sources (or the tails of large ones) add no small tasks; a dense
    part is cut on its own.
    """
    tasks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    size = 0
    for k, (p, ptr) in enumerate(zip(parts, ptrs, strict=True)):
        n = p.shape[0]
        if ptr is None:  # dense: its own tasks
            if cur:
                tasks.append(cur)
                cur, size = [], 0
            tasks += [[(k, a, b)] for a, b in itertools.pairwise(_row_cuts(p, None, step))]
            continue
        cum = ptr - ptr[0]
        a = 0
        while a < n:
            b = min(n, int(np.searchsorted(cum, cum[a] + step - size, side="right")) - 1)
            if b <= a:
                if cur:  # the next row does not fit: close this task first
                    tasks.append(cur)
                    cur, size = [], 0
                    continue
                b = a + 1
            cur.append((k, a, b))
            size += int(cum[b] - cum[a])
            a = b
    if cur:
        tasks.append(cur)
    return tasks


def _parallel(ctx: _Ctx, task_bytes: int) -> int:
    """How many tasks of ``task_bytes`` may run at once within the working memory."""
    return max(1, min(ctx.jobs, ctx.work // max(1, task_bytes)))


def _cuts(ptr: np.ndarray, step: int) -> list[int]:
    """Boundaries (rows or columns) splitting ``ptr`` into slices of about ``step`` elements."""
    n = ptr.size - 1
    if n <= 0:
        return [0, 0] if n == 0 else [0]
    marks = np.arange(int(ptr[0]) + step, int(ptr[-1]), step)
    inner = np.searchsorted(ptr, marks, side="left")
    return sorted({0, n, *(int(i) for i in inner if 0 < i < n)})


def _fill_dense(ctx: _Ctx, info: MatrixInfo, plan: MatrixPlan, parts: list[Part]) -> None:
    n_obs, n_vars = info.shape
    shard_rows = plan.elements_per_shard
    if len(parts) == 1 and parts[0].plain and ctx.identity:
        jobs = [
            CopyJob(parts[0].src, parts[0].path, ctx.dst, info.path, a, b)
            for a, b in shard_ranges(n_obs, shard_rows)
        ]
        ctx.runner.run(copy_dense, jobs, desc=f"copy {info.path}")
        return
    row_bytes = max(1, n_vars * info.itemsize)
    bucket_rows = ctx.work // (ctx.jobs * 3 * row_bytes)
    bounds = ext.bucket_bounds(n_obs, shard=shard_rows, bucket=bucket_rows)
    workdir = os.path.join(ctx.local, WORK_DIR, info.path.replace("/", "__"))
    read_rows = max(1, ctx.work // (ctx.jobs * ROUTE_COPIES * row_bytes))
    jobs = [
        ext.RouteDenseJob(p.src, p.path, a, b, ctx.inv, bounds, workdir, None if p.plain else p)
        for p in parts
        for a, b in shard_ranges(p.shape[0], read_rows)
    ]
    ctx.runner.run(ext.route_dense, jobs, desc=f"route {info.path}")
    assemble = [
        ext.AssembleJob(
            "dense",
            workdir,
            b,
            int(bounds[b]),
            int(bounds[b + 1]),
            int(bounds[b]),
            ctx.dst,
            info.path,
            shard_rows,
            info.dtype,
            None,
            n_vars,
        )
        for b in range(len(bounds) - 1)
    ]
    width = _parallel(ctx, int(np.diff(bounds).max(initial=0)) * 3 * row_bytes)
    ctx.runner.run(ext.assemble, assemble, desc=f"write {info.path}", width=width)
