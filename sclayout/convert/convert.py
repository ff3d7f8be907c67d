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
from collections.abc import Callable, Sequence
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
from sclayout.convert._buffers import release_scratch, trim_heap
from sclayout.convert.checks import (
    check_destination,
    check_obs_columns,
    explain_read_errors,
)
from sclayout.convert.codecs import get_codec
from sclayout.convert.inputs import Input, check_by, quiet_write, single_input, sources_input
from sclayout.convert.narrow import ValueStats, run_stats, stats_jobs, stored_dtypes
from sclayout.convert.order import get_order, permutation
from sclayout.convert.parts import Part
from sclayout.convert.plan import (
    DEFAULT_BLOCK_SIZE,
    MatrixPlan,
    parse_memory_budget,
    plan_csr,
    plan_dense,
    shard_bytes_for_budget,
)
from sclayout.convert.remote import (
    new_generation_prefix,
    remote_store_state,
    switch_store,
    upload_tree,
)
from sclayout.convert.source import (
    DIRECT_PIECE,
    IO_THREADS,
    MatrixInfo,
    Source,
    close_handles,
    open_group,
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
)
from sclayout.convert.stale import OLD_TAG, TMP_TAG, clean_stale, hold, sibling
from sclayout.convert.tables import WorkTables, cumsum_into, inverse_into, row_dtype, slices
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
DRIVER_BYTES_PER_ROW = 0
"""Bytes a row the driver holds in memory it cannot give back. None: the per-cell
tables (permutation, its inverse, row lengths, source and output indptr, stratum
codes, obs columns) are files in the work folder (:mod:`sclayout.convert.tables`),
whose pages the kernel reclaims; what the process does hold is measured."""
TABLE_BYTES_PER_ROW = 64
"""Disk the per-cell tables take a cell in the work folder at most at once (row numbers
in int32 below 2^31 rows, each table deleted once used: the order's scratch, then obs
names and columns on their way to the store, then the permutation, its inverse and a
matrix's pointers)."""
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

    ``src`` is a source or a list of them (the store holds their rows in that order
    before ``order`` reorders them); ``dst`` the store to create: a directory, or an
    ``s3://`` / ``gs://`` URL (docs/object-stores.md: shards go straight to the bucket,
    the manifest last; ``overwrite`` then deletes the old store first). Sources whose
    genes differ need ``join`` (``"inner"``: genes in every source; ``"outer"``: their
    union) or ``var_names`` (exactly these genes: a list, or a file with one a line);
    ``source_key`` names the obs column of each row's source (``""``: none); ``strict``
    refuses, instead of dropping with a note, a layer or obsm not in every source
    (docs/convert.md). ``spec`` (a :class:`~loader.spec.LayoutSpec` or its JSON's path)
    gives the defaults; explicit arguments override it. ``block_size``: rows per block
    (default :data:`~sclayout.convert.plan.DEFAULT_BLOCK_SIZE`); ``order``: ``original``,
    ``shuffled``, ``stratified`` or ``grouped`` (:mod:`sclayout.convert.order`), ``by``
    its obs columns (grouped: the first groups, the rest stratify), ``seed`` its seed;
    ``codec``: :data:`~sclayout.convert.codecs.CODECS`. ``memory_budget`` (``"2GB"``,
    ``"512MiB"`` or bytes) bounds the memory the process tree cannot give back, at any
    number of cells: the per-cell tables are files (:mod:`sclayout.convert.tables`).
    ``jobs``: worker threads (default: CPUs); ``scheduler``: a dask.distributed address;
    ``progress``: progress bars. ``checksums=False`` leaves out each inner chunk's
    crc32c (only to measure its cost); ``keep_dtypes`` stores the source's dtypes
    instead of the narrowest that hold every value (:mod:`sclayout.convert.narrow`).

    Returns the :class:`~loader.layout.Manifest` written as the root attribute
    ``sclayout``. Raises :class:`~loader.errors.InputError` for a bad source or option,
    a DST that exists without ``overwrite``, or one that cannot be written.
    """
    srcs = [src] if isinstance(src, str | os.PathLike) else list(src)
    infos = check_sources(srcs)  # the metadata checks of check_source, per source
    if isinstance(var_names, str | os.PathLike):
        var_names = read_var_names(var_names)
    opts = resolve_options(
        spec=spec, block_size=block_size, order=order, by=by, seed=seed, codec=codec,
        memory_budget=memory_budget,
    )  # fmt: skip
    opts = _more_options(opts, checksums=checksums, keep_dtypes=keep_dtypes, jobs=jobs)
    several = len(srcs) > 1 or infos[0].legacy or var_names is not None
    if several:
        check_by(srcs, infos, opts.order.columns, source_key if len(srcs) > 1 else "")
    else:
        check_obs_columns(Path(srcs[0]), opts.order.columns, info=infos[0])
    place = _place(dst, srcs, overwrite=overwrite)
    working_memory(opts.memory_budget, n_obs=sum(i.n_obs for i in infos))  # before any work
    merge = {"join": join, "var_names": var_names, "source_key": source_key, "strict": strict}
    runner = Runner(jobs=jobs, scheduler=scheduler, progress=progress)
    try:
        return _stage_and_install(srcs, infos, opts, runner, place, merge if several else None)
    finally:
        runner.close()


def _more_options(
    opts: ConvertOptions, *, checksums: bool, keep_dtypes: bool, jobs: int | None
) -> ConvertOptions:
    """Check the options that only the Python API takes; add them to ``opts``."""
    if not isinstance(checksums, bool):
        raise InputError(f"checksums={checksums!r}: pass True or False")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise InputError(f"jobs={jobs!r}: must be a positive integer")
    return dataclasses.replace(opts, checksums=checksums, keep_dtypes=keep_dtypes)


@dataclass(frozen=True)
class _Place:
    """Where a conversion writes: the folder it stages in, DST, and the bucket URL if any."""

    tmp: Path
    dst: Path
    remote: str | None
    overwrite: bool
    replaced: str | None = None
    """The bucket store that ``remote`` (a new generation prefix) replaces once whole."""


def _place(dst: str | os.PathLike, srcs: list, *, overwrite: bool) -> _Place:
    """Check DST and choose the folder to stage the store in (nothing created yet)."""
    remote = os.fspath(dst).rstrip("/") if is_object_store(os.fspath(dst)) else None
    if remote is not None:
        replaced = None
        if _check_remote_destination(remote, overwrite=overwrite):
            # the old store stays until the new one is whole (sclayout.convert.remote)
            replaced, remote = remote, new_generation_prefix(remote)
        # no rename in an object store: small elements and the reorder's scratch are
        # staged locally, the shards go straight to the bucket (sclayout.convert.remote)
        tmp = Path(tempfile.mkdtemp(prefix="sclayout-convert-")) / "store"
        return _Place(tmp, tmp, remote, overwrite, replaced)
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
    check_destination(dst_p, overwrite=overwrite, src=Path(srcs[0]))
    return _Place(tmp, dst_p, None, overwrite)


def _stage_and_install(
    srcs: list, infos: list, opts: ConvertOptions, runner: Runner, place: _Place, merge
) -> Manifest:
    """Write the store into the staging folder, then move (or upload) it into place.

    ``merge``: the options of :func:`~sclayout.convert.inputs.sources_input` when the
    sources are merged, None for one source kept as it is. Any failure removes the
    staging folder and says what failed: the destination, the disk, or a source.
    """
    tmp, dst_p, remote = place.tmp, place.dst, place.remote
    need = 0
    lock = None
    try:
        if remote is None:  # locked while it lives: clean_stale leaves it alone
            tmp.mkdir()
            with contextlib.suppress(OSError):  # no locks on this file system: the pid guards
                lock = hold(tmp)
        need = _store_bytes(
            srcs, infos, opts.codec, reorder=merge is not None or opts.order.kind != "original"
        )
        if remote is None:
            check_free_space(dst_p, need)  # the old DST stays until the rename: not free
        if merge is not None:
            inp = sources_input(srcs, infos, **merge)
            manifest = _convert_into(inp, tmp, opts, runner, remote)
        else:
            with open_group(srcs[0]) as root:
                inp = single_input(Source(root, srcs[0]))
                manifest = _convert_into(inp, tmp, opts, runner, remote)
        if remote is None:
            _install(tmp, dst_p, overwrite=place.overwrite)
        else:
            upload_tree(tmp, remote)  # the root zarr.json (the manifest) last
            if place.replaced is not None:
                switch_store(place.replaced, remote)
        return manifest
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _explain_os_error(e, Path(srcs[0]), tmp, dst_p, need)
        raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_no_space(e):  # tensorstore's RESOURCE_EXHAUSTED
            raise no_space_error(dst_p, need) from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
        close_handles()
        close_dst()
        release_scratch()
        if remote is not None:
            shutil.rmtree(tmp.parent, ignore_errors=True)


def _explain_os_error(e: OSError, src: Path, tmp: Path, dst: Path, need: int) -> None:
    """Raise the one-line error that says which side of the conversion failed."""
    if is_no_space(e):
        raise no_space_error(dst, need) from None
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise InputError(
            f"DST {dst}: cannot write ({e.strerror}); choose a writable location"
        ) from None
    if _names_destination(e, tmp, dst):
        raise InputError(
            f"DST {dst}: writing failed ({e.strerror or e}); check the destination "
            "(free space, quota, permissions) or choose another DST"
        ) from None
    with explain_read_errors(src):  # anything else: the source failed to read
        raise e


def _check_remote_destination(url: str, *, overwrite: bool) -> bool:
    """Refuse an object-store DST that holds objects, unless ``overwrite``.

    Returns whether it holds any (to be replaced: the new store is written under a new
    prefix and switched to, docs/object-stores.md).
    """
    try:
        split_bucket(url)
    except ValueError as e:
        raise InputError(f"DST {e}") from None
    state = remote_store_state(url)
    if state == "empty":
        return False
    if not overwrite:
        what = "a layout store" if state == "store" else "objects but no layout store"
        raise InputError(f"DST {url} holds {what}: pass --overwrite to replace it")
    return True


def _rss() -> int:
    """Memory this process and its children hold that the kernel cannot reclaim.

    Anonymous and shared (memfd, /dev/shm) pages, as PSS summed over the process tree
    (Linux ``smaps_rollup``); file pages (memory-mapped tables, the page cache) are
    left out. Elsewhere: the peak resident size so far.
    """
    try:
        return _tree_pss(os.getpid())
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tree_pss(pid: int) -> int:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                        int(name)
                    )
            except (OSError, IndexError, ValueError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                        total += int(line.split()[1]) << 10
        except FileNotFoundError:
            if p == pid:
                raise
    return total


def working_memory(budget: int, *, n_obs: int) -> int:
    """Bytes the conversion tasks may use.

    The budget minus what the process tree holds and cannot give back (:func:`_rss`),
    the per-cell bytes held in memory (:data:`DRIVER_BYTES_PER_ROW`), the I/O threads'
    staging buffers and a margin. A budget below the process's own size (tiny budgets in tests)
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
    missing = [c for c in opts.order.columns if c not in inp.obs.columns]
    if missing:
        raise InputError(
            f"--by {missing[0]!r}: no such obs column; available: "
            f"{', '.join(map(str, inp.obs.columns)) or '(none)'}"
        )
    block_size = opts.block_size or DEFAULT_BLOCK_SIZE
    tmp.mkdir(exist_ok=True)  # convert() made and locked a local one: keep that folder
    root = zarr.open_group(tmp, mode="w-", zarr_format=3)  # "w" would recreate it
    root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    tables = WorkTables(tmp / WORK_DIR / "tables")
    working_memory(opts.memory_budget, n_obs=n_obs)  # refused before the permutation
    perm = permutation(
        opts.order.kind,
        n_obs,
        codes=lambda column: inp.obs.codes(column, tables),
        by=opts.order.columns,
        seed=opts.order.seed or 0,
        tables=tables,
    )
    inv = inverse_into(perm, tables.empty("inverse", n_obs, row_dtype(n_obs)))
    small = anndata_dataset_kwargs(opts.checksums)
    inp.obs.write(root, perm, tables, small)
    inp.write_small(root, perm, small)
    rechunk_obs_codes(  # obs labels in row chunks, read per fetch like the row tables
        tmp,
        block_size=block_size,
        compressors=get_codec(opts.codec) + checksum_codecs(opts.checksums),
        shard_bytes=shard_bytes_for_budget(opts.memory_budget),
    )
    matrices: dict[str, MatrixLayout] = {}
    pointers: dict[str, np.ndarray] = {}
    identity = opts.order.kind == "original"
    for target, parts in inp.matrices:  # the working memory as it is before each matrix
        trim_heap()  # the order's and obs's freed slices back to the system first
        work = working_memory(opts.memory_budget, n_obs=n_obs)
        ctx = _Ctx(
            remote or str(tmp), str(tmp), opts, block_size, runner, perm, inv, identity, work,
            tables,
        )  # fmt: skip
        layout, pointer = _convert_matrix(ctx, target, parts)
        matrices[target.path] = layout
        if pointer is not None:
            pointers[target.path] = pointer
    tables.drop(inv)
    provenance = _write_uns_sclayout(root, perm, pointers, inp, small, (opts, block_size, tmp))
    del perm, inv
    tables.close()
    shutil.rmtree(tmp / WORK_DIR, ignore_errors=True)
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
    tables: WorkTables
    """Where the per-cell tables of the matrices go (files in the work folder)."""

    @property
    def jobs(self) -> int:
        return self.runner.jobs


class _RowTable:
    """A per-row table made a slice at a time (``fill(a, b)``), for :func:`write_row_table`."""

    def __init__(self, n: int, dtype: Any, fill: Callable[[int, int], np.ndarray]) -> None:
        self.shape = (n,)
        self.dtype = np.dtype(dtype)
        self.fill = fill

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, _ = rows.indices(self.shape[0])
        return self.fill(a, b)


def _write_uns_sclayout(
    root: zarr.Group,
    perm: np.ndarray,
    pointers: dict,
    inp: Input,
    kw: dict[str, Any],
    where: tuple[ConvertOptions, int, Path],
) -> dict[str, str]:
    """Write source_index, block pointers and the per-row provenance.

    ``where``: the options, the block size and the local folder of the store.

    Provenance (source number, row in that source) only with several sources; returns
    the provenance paths. The per-row tables are sharded like X (:func:`write_row_table`),
    each computed a slice at a time from the permutation (a memory-mapped table).
    """
    opts, block_size, local = where
    pointer_names = {block_pointer_path(m).rsplit("/", 1)[-1]: p for m, p in pointers.items()}
    quiet_write(root["uns"], SCLAYOUT_UNS.split("/", 1)[1], {"block_indptr": pointer_names}, kw)
    n = perm.size
    tables = {"source_index": _RowTable(n, np.int64, lambda a, b: perm[a:b].astype(np.int64))}
    provenance: dict[str, str] = {}
    if inp.row0 is not None:
        row0 = inp.row0
        number_dtype = np.uint16 if row0.size - 1 < 2**16 else np.int32

        def number(a: int, b: int) -> np.ndarray:
            return np.searchsorted(row0, perm[a:b], side="right") - 1

        tables["source_number"] = _RowTable(n, number_dtype, number)
        tables["source_row"] = _RowTable(n, np.int64, lambda a, b: perm[a:b] - row0[number(a, b)])
        provenance = {k: f"{SCLAYOUT_UNS}/{k}" for k in ("source_number", "source_row")}
        provenance["obs_key"] = inp.source_key
    compressors = get_codec(opts.codec) + checksum_codecs(opts.checksums)
    shard_bytes = shard_bytes_for_budget(opts.memory_budget)
    for name, values in tables.items():
        write_row_table(
            local,
            f"{SCLAYOUT_UNS}/{name}",
            values,
            block_size=block_size,
            compressors=compressors,
            shard_bytes=shard_bytes,
        )
    return provenance


def _store_bytes(srcs: list[Path], infos: list[Any], codec: str, *, reorder: bool) -> int:
    """Free bytes a conversion of ``srcs`` needs.

    The store (a legacy file: its own size), plus what the route files of a reordering
    conversion exceed their matrix's share of it by (they are deleted as the store is
    written), plus the per-cell tables (:data:`TABLE_BYTES_PER_ROW`).
    """
    total = TABLE_BYTES_PER_ROW * sum(int(i.n_obs) for i in infos)
    ratios: dict[tuple, list[float]] = {}  # codec ratios sampled on the first sources
    for src, info in zip(srcs, infos, strict=True):
        if info.legacy:
            total += tree_bytes(src)[0] * (2 if reorder else 1)
            continue
        with open_group(Path(src)) as root:
            source = Source(root, Path(src))
            total += estimate_store_bytes(source, codec, ratios=ratios, route=reorder)
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
    ptrs = [_source_pointer(ctx, p) for p in parts]  # row (csr) or column (csc) pointers
    out_ptr = _output_pointer(ctx, parts, ptrs, n_obs)
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
    one = parts[0]
    copy = len(parts) == 1 and one.plain and one.encoding == "csr" and ctx.identity
    if copy and int(ptrs[0][0]) == 0:  # (an indptr not from 0: the general path)
        dtypes = _stored_dtypes(ctx, info, parts)
        arrays = create_matrix(root, info, plan, nnz=nnz, compressors=compressors, dtypes=dtypes)
        _publish(ctx, info.path)
        _copy_csr(ctx, info, plan, one, nnz)
    else:  # the values' range comes from the route pass, which reads them anyway
        routed = _route_sparse(ctx, info, plan, parts, ptrs, out_ptr, nnz)
        dtypes = _stored_dtypes(ctx, info, parts, stats=routed.stats)
        arrays = create_matrix(root, info, plan, nnz=nnz, compressors=compressors, dtypes=dtypes)
        _publish(ctx, info.path)
        _assemble_sparse(ctx, info, plan, routed, out_ptr)
    ptr_shard = plan.arrays["indptr"].shards[0]
    for a, b in shard_ranges(n_obs + 1, ptr_shard):
        write_region(ctx.dst, f"{info.path}/indptr", a, out_ptr[a:b])
    pointer = np.asarray(out_ptr[np.r_[np.arange(0, n_obs, ctx.block_size), n_obs]])
    ctx.tables.drop(out_ptr, *ptrs)  # this matrix's tables: their disk back now
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


def _source_pointer(ctx: _Ctx, part: Part) -> np.ndarray | None:
    """Read a sparse part's indptr into an int64 table, in slices (None for a dense part)."""
    if part.encoding == "dense":
        return None
    n = part.shape[part.encoding == "csc"] + 1
    out = ctx.tables.empty("source-indptr", n, np.int64)
    for a, b in slices(n):
        out[a:b] = read_slice(part.src, f"{part.path}/indptr", a, b)
    return out


def _output_pointer(ctx: _Ctx, parts: list[Part], ptrs: list, n_obs: int) -> np.ndarray:
    """Build the output indptr (a table) from every source row's stored length."""
    step = max(1, ctx.work // (4 * 8))
    row_nnz = ctx.tables.empty("row-nnz", n_obs, np.int64)
    at = 0
    for p, ptr in zip(parts, ptrs, strict=True):
        p.row_nnz(ptr, step=step, out=row_nnz[at : at + p.shape[0]])
        at += p.shape[0]
    out_ptr = ctx.tables.empty("indptr", n_obs + 1, np.int64)
    cumsum_into(row_nnz, out_ptr, order=None if ctx.identity else ctx.perm)
    ctx.tables.drop(row_nnz)
    return out_ptr


def _stored_dtypes(
    ctx: _Ctx, info: MatrixInfo, parts: list[Part], stats: ValueStats | None = None
) -> tuple[np.dtype, np.dtype | None]:
    """Return the stored (value, column id) dtypes of ``info``.

    From ``stats`` when a pass over the values gathered them, else one pass for it.
    """
    if ctx.opts.keep_dtypes:
        return stored_dtypes(info, None)
    if stats is not None:
        return stored_dtypes(info, stats)
    elements = max(1, ctx.work // (ctx.jobs * 4 * info.itemsize))
    jobs = stats_jobs(parts, elements=elements)
    found = ctx.runner.run(run_stats, jobs, desc=f"scan {info.path}")
    return stored_dtypes(info, functools.reduce(ValueStats.merge, found, ValueStats()))


def _copy_csr(ctx: _Ctx, info: MatrixInfo, plan: MatrixPlan, part: Part, nnz: int) -> None:
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


@dataclass(frozen=True)
class _Routed:
    """What the route pass of a sparse matrix leaves for the assemble pass."""

    kind: str
    """``rows`` (CSR and dense parts) or ``csc`` (entries)."""
    bounds: np.ndarray
    workdir: str
    segments: list
    per_elem: int
    stats: ValueStats | None
    """The routed values' range (rows only; None: not gathered)."""


def _route_sparse(ctx, info, plan, parts, ptrs, out_ptr, nnz) -> _Routed:
    """Pass 1 of the bucketed reorder of CSR, CSC and dense parts into CSR output.

    All-CSR/dense parts route rows (the fast path); any CSC part routes entries.
    """
    coo = any(p.encoding == "csc" for p in parts)
    elem_bytes = info.itemsize + (info.index_dtype.itemsize if info.index_dtype else 8)
    per_elem = 3 * elem_bytes + ASSEMBLE_INDEX_BYTES + (8 if coo else 0)
    bounds = ext.bucket_bounds(
        nnz, shard=plan.elements_per_shard, bucket=ctx.work // (ctx.jobs * per_elem)
    )
    workdir = os.path.join(ctx.local, WORK_DIR, info.path.replace("/", "__"))
    read_elems = max(1, ctx.work // (ctx.jobs * ROUTE_COPIES * elem_bytes))
    route = (ctx.inv, out_ptr, bounds, workdir)
    jobs: list[Any] = []
    if not coo and len(parts) > 1:
        for task in task_slices(parts, ptrs, read_elems):
            (k, a, b), more = task[0], tuple((parts[j], c, d, ptrs[j]) for j, c, d in task[1:])
            p = parts[k]
            jobs.append(ext.RouteRowsJob(p.src, p.path, a, b, ptrs[k], *route, len(jobs), p, more))
    else:
        for p, ptr in zip(parts, ptrs, strict=True):
            part = None if p.plain and p.encoding == ("csc" if coo else "csr") else p
            for a, b in itertools.pairwise(_row_cuts(p, ptr, read_elems)):
                jobs.append(
                    ext.RouteCscJob(p.src, p.path, a, b, ptr, *route, info.index_dtype, part)
                    if coo
                    else ext.RouteRowsJob(p.src, p.path, a, b, ptr, *route, len(jobs), part)
                )
    found = ctx.runner.run(
        ext.route_csc if coo else ext.route_rows, jobs, desc=f"route {info.path}"
    )
    n_buckets = len(bounds) - 1
    if coo:
        return _Routed("csc", bounds, workdir, [None] * n_buckets, per_elem, None)
    segments = ext.segments_by_bucket([t for t, _ in found], n_buckets)
    stats = functools.reduce(ValueStats.merge, [v for _, v in found], ValueStats())
    return _Routed("rows", bounds, workdir, segments, per_elem, stats)


def _assemble_sparse(ctx, info, plan, routed: _Routed, out_ptr) -> None:
    """Pass 2 of the bucketed reorder: each bucket sorted into output order, written."""
    bounds = routed.bounds
    first_rows = np.searchsorted(out_ptr, bounds[:-1], side="right") - 1
    assemble = [
        ext.AssembleJob(
            routed.kind,
            routed.workdir,
            b,
            int(bounds[b]),
            int(bounds[b + 1]),
            int(out_ptr[first_rows[b]]),
            ctx.dst,
            info.path,
            plan.elements_per_shard,
            info.dtype,
            info.index_dtype,
            info.shape[1],
            routed.segments[b],
        )
        for b in range(len(bounds) - 1)
    ]
    width = _parallel(ctx, int(np.diff(bounds).max(initial=0)) * routed.per_elem)
    ctx.runner.run(ext.assemble, assemble, desc=f"write {info.path}", width=width)
    shutil.rmtree(routed.workdir, ignore_errors=True)  # route files: free the disk now


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
