"""External (bucketed, two-pass) reordering of a row-aligned matrix.

Used for every order other than the source's own CSR/dense order, and for CSC
sources (whose rows are scattered over all columns). Memory stays bounded whatever
the number of rows:

- **Buckets** are consecutive ranges of *output* shards (elements of CSR
  ``data``/``indices``, rows of dense arrays), so each bucket fills whole shards and
  buckets are written independently, in parallel, without read-modify-write.
- **Pass 1 (route)** reads the source sequentially in large slices (row ranges of
  CSR/dense, column ranges of CSC) and sends every row (or CSC entry) to the
  bucket(s) its output position falls in. A CSR row that straddles a bucket boundary
  goes to both buckets. CSR: each task gathers its rows grouped by bucket and writes
  one *segment* file per bucket it feeds (the rows' output places, values and column
  indices, compressed with a fast codec, :data:`ROUTE_CODEC`), and returns its segment
  table. CSC/dense: each worker thread appends to its own files per bucket.
- **Pass 2 (assemble)** loads one bucket (CSR: its segment from every route task),
  sorts it into output order with vectorised gathers, writes its shards, and deletes
  the bucket's files: the route files shrink while the store grows.

Temp files live in a work directory inside the store's temporary sibling, so a kill
leaves nothing behind that the next run does not remove.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numcodecs import Blosc, blosc

from sclayout.convert._buffers import scratch, trim_heap
from sclayout.convert.narrow import ValueStats, value_stats
from sclayout.convert.parts import Part
from sclayout.convert.source import io_map, pread_full, read_slice
from sclayout.convert.tables import segments as _segments
from sclayout.convert.write import submit_region, write_region

__all__ = [
    "ROUTE_CODEC",
    "AssembleJob",
    "RouteCscJob",
    "RouteDenseJob",
    "RouteRowsJob",
    "assemble",
    "bucket_bounds",
    "pack",
    "route_csc",
    "route_dense",
    "route_rows",
    "unpack",
]


def bucket_bounds(total: int, *, shard: int, bucket: int) -> np.ndarray:
    """Bucket boundaries over ``[0, total)``: multiples of ``shard``, about ``bucket`` apart."""
    step = max(shard, (bucket // shard) * shard)
    return np.unique(np.r_[np.arange(0, total, step, dtype=np.int64), total])


def _writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"


def _append(workdir: str, bucket: int, parts: dict[str, np.ndarray]) -> None:
    d = Path(workdir) / f"b{bucket:06d}"
    d.mkdir(parents=True, exist_ok=True)
    wid = _writer_id()
    for name, arr in parts.items():
        with open(d / f"{wid}.{name}", "ab") as f:
            f.write(np.ascontiguousarray(arr).data)


def _load(workdir: str, bucket: int, dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """Read a bucket's parts, every writer's file in turn into one scratch buffer."""
    d = Path(workdir) / f"b{bucket:06d}"
    writers = sorted({p.name.rsplit(".", 1)[0] for p in d.iterdir()}) if d.exists() else []
    out = {}
    for name, dt in dtypes.items():
        files = [d / f"{w}.{name}" for w in writers]
        sizes = [f.stat().st_size for f in files]
        buf = scratch(f"bucket-{name}", sum(sizes) // dt.itemsize, dt)
        view, pos = memoryview(buf.view(np.uint8)), 0
        for f, size in zip(files, sizes, strict=True):
            end = pos + size
            with open(f, "rb", buffering=0) as fh:
                while pos < end:
                    n = fh.readinto(view[pos:end])
                    if not n:
                        raise OSError(f"short read of {f}")
                    pos += n
        out[name] = buf
    return out


PIECE_ELEMS = 2**20
"""Elements gathered per vectorised step: the int64 index of a piece (8 MiB) stays in
cache-friendly, reusable memory instead of a fresh multi-GB array (fresh pages cost
page faults that cost more than the gather itself)."""


def gather_segments(
    sources: list[np.ndarray], starts: np.ndarray, lengths: np.ndarray, outs: list[np.ndarray]
) -> None:
    """``outs[k] = concat(sources[k][s : s + n] for s, n in zip(starts, lengths))``.

    Vectorised in pieces of about :data:`PIECE_ELEMS` elements.
    """
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    cuts = np.unique(
        np.r_[0, np.searchsorted(ends, np.arange(PIECE_ELEMS, total, PIECE_ELEMS)), lengths.size]
    )
    pos = 0
    for a, b in itertools.pairwise(cuts):
        seg = _segments(starts[a:b], lengths[a:b])
        for src, out in zip(sources, outs, strict=True):
            np.take(src, seg, out=out[pos : pos + seg.size])
        pos += seg.size


try:  # scipy's C++ row gather: no per-element index array (much less CPU than
    # _segments + fancy indexing)
    from scipy.sparse._sparsetools import csr_row_index as _csr_row_index
except ImportError:  # pragma: no cover - private scipy API moved
    _csr_row_index = None


def gather_rows(
    ptr: np.ndarray,
    rows: np.ndarray,
    data: np.ndarray,
    indices: np.ndarray,
    out_data: np.ndarray,
    out_indices: np.ndarray,
) -> None:
    """Concatenate rows ``rows`` of the CSR arrays (``ptr``, ``indices``, ``data``)."""
    idt = indices.dtype
    if (
        _csr_row_index is not None
        and idt in (np.dtype(np.int32), np.dtype(np.int64))
        and int(ptr[-1]) <= np.iinfo(idt).max
    ):
        try:
            _csr_row_index(
                rows.size,
                rows.astype(idt, copy=False),
                ptr.astype(idt, copy=False),
                indices,
                data,
                out_indices,
                out_data,
            )
            return
        except (TypeError, ValueError):  # a dtype sparsetools does not handle
            pass
    starts = ptr[rows]
    gather_segments([data, indices], starts, ptr[rows + 1] - starts, [out_data, out_indices])


# -- pass 1 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteRowsJob:
    """Route source rows ``[r0, r1)`` of a CSR matrix to their buckets.

    ``indptr`` is the source indptr (int64), ``inv`` the inverse permutation,
    ``out_ptr`` the output indptr, ``bounds`` the bucket element bounds; ``task``
    names the job's files in ``workdir``.
    """

    src: str
    path: str
    r0: int
    r1: int
    indptr: np.ndarray
    inv: np.ndarray
    out_ptr: np.ndarray
    bounds: np.ndarray
    workdir: str
    task: int = 0
    part: Part | None = None
    """Several sources or a gene map: where this source's rows go (``indptr`` is then
    the source's own pointer, ``r0``/``r1`` its own rows)."""
    more: tuple[tuple[Part, int, int, np.ndarray], ...] = ()
    """Several sources: further CSR slices (part, its rows ``r0``/``r1``, its pointer)
    routed by the same task, so a task reads as much as with one source whatever the
    sizes of the sources (the task count, and so the segments per bucket, stay those
    of one source)."""


SEGMENT_COLUMNS = ("task", "bucket", "rows", "elems", "meta_bytes", "data_bytes", "idx_bytes")
"""Columns of a route task's segment table (one row per bucket it feeds): the task, the
bucket, its rows and elements, and the compressed bytes of its three arrays (the rows'
output start and length, the values, the column indices) in the segment's file."""

ROUTE_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
"""Codec of the route files: lz4 with byte shuffle encodes and decodes at GB/s a core
and stores a count matrix's values, column indices and row table in a third to a sixth
of their bytes, so the route pass writes and reads back far less than the matrix."""
FRAME_BYTES = 1 << 24
"""Raw bytes per compressed frame (blosc takes at most 2 GiB at once)."""
_HEADER = 16
"""Bytes of a blosc frame's header; bytes 4-16 hold its raw, block and compressed sizes."""


def pack(values: np.ndarray) -> list[bytes]:
    """``values`` (contiguous) as :data:`ROUTE_CODEC` frames of :data:`FRAME_BYTES` or less."""
    flat = values.reshape(-1)
    step = max(1, FRAME_BYTES // max(1, flat.itemsize))
    return [ROUTE_CODEC.encode(flat[a : a + step]) for a in range(0, flat.size, step)]


def unpack(frames: np.ndarray, out: np.ndarray) -> None:
    """Decode the frames in ``frames`` (uint8, as :func:`pack` made them) into ``out``.

    Raises ``OSError`` when they do not decode to exactly ``out``'s bytes (a damaged or
    truncated route file).
    """
    dest = out.reshape(-1).view(np.uint8)
    pos = at = 0
    while pos < frames.size:
        head = frames[pos : pos + _HEADER].tobytes()
        raw, _block, size = (
            (int(v) for v in np.frombuffer(head[4:], "<u4")) if len(head) == _HEADER else (0, 0, 0)
        )
        if not size or pos + size > frames.size or at + raw > dest.size:
            break
        blosc.decompress(frames[pos : pos + size], dest[at : at + raw])
        pos, at = pos + size, at + raw
    if pos != frames.size or at != dest.size:
        raise OSError(f"route file damaged: {at} of {dest.size} bytes decoded")


def _segment_file(workdir: str, bucket: int, task: int) -> str:
    return os.path.join(workdir, f"b{bucket:06d}", f"t{task:06d}")


def _write_segment(path: str, arrays: tuple[np.ndarray, ...]) -> list[int]:
    """Write ``arrays`` compressed one after the other as file ``path``; their sizes."""
    frames = [pack(a) for a in arrays]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for fr in frames:
            f.writelines(fr)
    return [sum(map(len, fr)) for fr in frames]


PIECE_READERS = 4
"""Slices of one task read at once: each is read by the I/O threads, and slices of small
sources alone would leave most of them idle (a shallow queue reads a disk slowly)."""


def _read_pieces(job: RouteRowsJob) -> tuple[np.ndarray, ...]:
    """Read the CSR slices of a task end to end into this thread's route buffers.

    The slices are read concurrently, each at its place in the buffers. Returns their
    pointer, data, indices and the output row of every row.
    """
    pieces = [(job.part, job.r0, job.r1, job.indptr), *job.more]
    sizes = [int(p[b]) - int(p[a]) for _, a, b, p in pieces]
    starts = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    data = scratch("route-data", int(starts[-1]), job.part.dtype)
    indices = scratch("route-indices", int(starts[-1]), job.part.index_dtype)

    def read(k: int) -> tuple[np.ndarray, int]:
        part, a, b, p = pieces[k]
        at = slice(int(starts[k]), int(starts[k + 1]))
        q, d, _ = part.read_rows(a, b, p, out=(data[at], indices[at]))
        return q, d.size

    if len(pieces) == 1:
        done = [read(0)]
    else:
        with ThreadPoolExecutor(min(PIECE_READERS, len(pieces))) as pool:
            done = list(pool.map(read, range(len(pieces))))
    ptrs, rows, pos = [np.zeros(1, np.int64)], [], 0
    for k, ((q, m), (part, a, b, _)) in enumerate(zip(done, pieces, strict=True)):
        if pos != starts[k]:  # a gene map kept fewer entries before: close the gap
            data[pos : pos + m] = data[starts[k] : starts[k] + m]
            indices[pos : pos + m] = indices[starts[k] : starts[k] + m]
        ptrs.append(q[1:] + pos)
        rows.append(job.inv[part.row0 + a : part.row0 + b])
        pos += m
    return np.concatenate(ptrs), data[:pos], indices[:pos], np.concatenate(rows)


def _read_task(job: RouteRowsJob) -> tuple[np.ndarray, ...]:
    """Read a route task's rows: their pointer, values, column indices and output rows."""
    if job.part is None:
        s = job.indptr
        e0, e1 = int(s[job.r0]), int(s[job.r1])
        data = read_slice(job.src, f"{job.path}/data", e0, e1, buffer="route-data")
        indices = read_slice(job.src, f"{job.path}/indices", e0, e1, buffer="route-indices")
        return s[job.r0 : job.r1 + 1] - e0, data, indices, job.inv[job.r0 : job.r1]
    if not job.more and job.part.encoding == "dense":
        ptr, data, indices = job.part.read_rows(job.r0, job.r1, job.indptr)
        return ptr, data, indices, job.inv[job.part.row0 + job.r0 : job.part.row0 + job.r1]
    return _read_pieces(job)


def route_rows(job: RouteRowsJob) -> tuple[np.ndarray, ValueStats]:
    """Run a :class:`RouteRowsJob`; return its segment table (:data:`SEGMENT_COLUMNS`).

    Also the range and integer-ness of the values it routed: the stored dtype is chosen
    from them, so the values are not read once more just for that.
    """
    ptr, data, indices, out_row = _read_task(job)
    nnz = np.diff(ptr)
    keep = np.flatnonzero(nnz > 0)
    out_start = job.out_ptr[out_row[keep]].astype(np.int64, copy=False)
    nnz = nnz[keep]
    first = np.searchsorted(job.bounds, out_start, side="right") - 1
    last = np.searchsorted(job.bounds, out_start + nnz - 1, side="right") - 1
    # one entry per (row, bucket it touches): a row straddling buckets (rare) goes to each
    span = last - first + 1
    row = np.repeat(np.arange(keep.size), span)
    bucket = np.repeat(first - (np.cumsum(span) - span), span) + np.arange(row.size)
    order = np.argsort(bucket, kind="stable")
    row, bucket = row[order], bucket[order]
    used, at, rows = np.unique(bucket, return_index=True, return_counts=True)
    row_nnz = nnz[row]
    elems = np.add.reduceat(row_nnz, at) if row.size else np.zeros(0, np.int64)
    meta = np.stack([out_start[row], row_nnz], axis=1).astype(np.int64, copy=False)
    src_row = keep[row]
    sizes = np.zeros((used.size, 3), dtype=np.int64)
    for k in range(used.size):  # one compressed segment file per bucket fed
        a, z, n = int(at[k]), int(at[k] + rows[k]), int(elems[k])
        g_data = scratch("route-gdata", n, data.dtype)
        g_idx = scratch("route-gindices", n, indices.dtype)
        gather_rows(ptr, src_row[a:z], data, indices, g_data, g_idx)
        path = _segment_file(job.workdir, int(used[k]), job.task)
        sizes[k] = _write_segment(path, (meta[a:z], g_data, g_idx))
    table = np.column_stack([np.full(used.size, job.task), used, rows, elems, sizes])
    stats = ValueStats()
    for a in range(0, data.size, PIECE_ELEMS):  # a piece at a time: small temporaries
        stats = stats.merge(value_stats(data[a : a + PIECE_ELEMS]))
    trim_heap()
    return table.astype(np.int64), stats


def segments_by_bucket(tables: list[np.ndarray], n_buckets: int) -> list[np.ndarray]:
    """Return the route tasks' segment tables regrouped per bucket (rows in task order)."""
    if not tables:
        return [np.zeros((0, len(SEGMENT_COLUMNS)), np.int64) for _ in range(n_buckets)]
    allseg = np.concatenate(tables)
    allseg = allseg[np.lexsort((allseg[:, 0], allseg[:, 1]))]
    cuts = np.searchsorted(allseg[:, 1], np.arange(n_buckets + 1))
    return [allseg[cuts[b] : cuts[b + 1]] for b in range(n_buckets)]


@dataclass(frozen=True)
class RouteCscJob:
    """Route the entries of source columns ``[c0, c1)`` of a CSC matrix to their buckets."""

    src: str
    path: str
    c0: int
    c1: int
    col_ptr: np.ndarray
    inv: np.ndarray
    out_ptr: np.ndarray
    bounds: np.ndarray
    workdir: str
    index_dtype: np.dtype
    part: Part | None = None
    """Several sources or a gene map: this source's place and gene map; ``c0``/``c1``
    are then source columns of a CSC part, or source rows of a CSR or dense one."""


def route_csc(job: RouteCscJob) -> int:
    """Run a :class:`RouteCscJob`; returns bytes read."""
    if job.part is None:
        p = job.col_ptr
        e0, e1 = int(p[job.c0]), int(p[job.c1])
        data = read_slice(job.src, f"{job.path}/data", e0, e1)
        rows = read_slice(job.src, f"{job.path}/indices", e0, e1)
        cols = np.repeat(
            np.arange(job.c0, job.c1, dtype=job.index_dtype), np.diff(p[job.c0 : job.c1 + 1])
        )
    else:
        rows, cols, data = job.part.read_entries(job.c0, job.c1, job.col_ptr)
        rows = rows + job.part.row0
        cols = cols.astype(job.index_dtype, copy=False)
    out_row = job.inv[rows].astype(np.int64)  # the route files hold int64 rows
    first = np.searchsorted(job.bounds, job.out_ptr[out_row], side="right") - 1
    last = np.searchsorted(job.bounds, job.out_ptr[out_row + 1] - 1, side="right") - 1
    order = np.argsort(first, kind="stable")
    cuts = np.searchsorted(first[order], np.arange(len(job.bounds)))
    o_row, o_data, o_col = out_row[order], data[order], cols[order]
    for b in np.unique(first):
        a, z = cuts[b], cuts[b + 1]
        _append(job.workdir, int(b), {"meta": o_row[a:z], "data": o_data[a:z], "idx": o_col[a:z]})
    span = last - first
    for k in range(1, int(span.max(initial=0)) + 1):  # entries of rows straddling buckets
        sel = np.flatnonzero(span >= k)
        for b in np.unique(first[sel] + k):
            s = sel[first[sel] + k == b]
            _append(job.workdir, int(b), {"meta": out_row[s], "data": data[s], "idx": cols[s]})
    trim_heap()
    return data.nbytes + rows.nbytes


@dataclass(frozen=True)
class RouteDenseJob:
    """Route source rows ``[r0, r1)`` of a dense matrix to their buckets (row bounds)."""

    src: str
    path: str
    r0: int
    r1: int
    inv: np.ndarray
    bounds: np.ndarray
    workdir: str
    part: Part | None = None
    """Several sources or a gene map: this source's place and gene map."""


def route_dense(job: RouteDenseJob) -> int:
    """Run a :class:`RouteDenseJob`; returns bytes read."""
    if job.part is None:
        values = read_slice(job.src, job.path, job.r0, job.r1)
        out_row = job.inv[job.r0 : job.r1].astype(np.int64)
    else:
        values = job.part.read_dense(job.r0, job.r1)
        out_row = job.inv[job.part.row0 + job.r0 : job.part.row0 + job.r1].astype(np.int64)
    first = np.searchsorted(job.bounds, out_row, side="right") - 1
    order = np.argsort(first, kind="stable")
    cuts = np.searchsorted(first[order], np.arange(len(job.bounds)))
    o_row, o_val = out_row[order], values[order]
    for b in np.unique(first):
        a, z = cuts[b], cuts[b + 1]
        _append(job.workdir, int(b), {"meta": o_row[a:z], "data": o_val[a:z]})
    trim_heap()
    return values.nbytes


# -- pass 2 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssembleJob:
    """Assemble bucket ``bucket`` (output range ``[start, stop)``) and write its shards.

    ``kind`` is ``rows`` (CSR source), ``csc`` or ``dense``. For ``csc``, ``base`` is
    the output position of the first element of the first row overlapping the bucket.
    """

    kind: str
    workdir: str
    bucket: int
    start: int
    stop: int
    base: int
    dst: str
    dst_path: str
    shard: int
    dtype: np.dtype
    index_dtype: np.dtype | None
    n_vars: int
    segments: np.ndarray | None = None
    """``rows``: the bucket's segments (:data:`SEGMENT_COLUMNS`), see :func:`segments_by_bucket`."""


def _load_segments(job: AssembleJob) -> tuple[np.ndarray, ...]:
    """Read a ``rows`` bucket from its route tasks' segment files, decoding them in parallel.

    Returns data and indices (the segments end to end), meta (output start and nnz of
    every row, in the same order) and ``ptr``, the CSR pointer over data/indices.
    """
    seg = job.segments
    rows_at = np.r_[0, np.cumsum(seg[:, 2])].astype(np.int64)
    elem_at = np.r_[0, np.cumsum(seg[:, 3])].astype(np.int64)
    data = scratch("bucket-data", int(elem_at[-1]), job.dtype)
    idx = scratch("bucket-idx", int(elem_at[-1]), job.index_dtype)
    meta = np.empty((int(rows_at[-1]), 2), dtype=np.int64)

    def read(k: int) -> None:
        task, bucket, _rows, _elems, *sizes = (int(v) for v in seg[k])
        path = _segment_file(job.workdir, bucket, task)
        frames = np.empty(sum(sizes), dtype=np.uint8)
        with open(path, "rb", buffering=0) as f:
            pread_full(f.fileno(), memoryview(frames), 0)
        cut = np.cumsum([0, *sizes])
        outs = (
            meta[rows_at[k] : rows_at[k + 1]],
            data[elem_at[k] : elem_at[k + 1]],
            idx[elem_at[k] : elem_at[k + 1]],
        )
        for j, out in enumerate(outs):
            unpack(frames[cut[j] : cut[j + 1]], out)

    io_map(read, range(seg.shape[0]))
    ptr = np.zeros(meta.shape[0] + 1, dtype=np.int64)
    np.cumsum(meta[:, 1], out=ptr[1:])
    return data, idx, meta, ptr


def assemble(job: AssembleJob) -> int:
    """Run an :class:`AssembleJob`; returns bytes written (uncompressed)."""
    try:
        return _assemble(job)
    finally:
        trim_heap()


def _assemble(job: AssembleJob) -> int:
    if job.kind == "dense":
        parts = _load(job.workdir, job.bucket, {"meta": np.dtype(np.int64), "data": job.dtype})
        values = parts["data"].reshape(parts["meta"].size, job.n_vars)
        order = np.argsort(parts["meta"], kind="stable")
        rows = parts["meta"][order]
        if not np.array_equal(rows, np.arange(job.start, job.stop)):
            raise RuntimeError(f"bucket {job.bucket}: rows missing or repeated (a bug)")
        out = {None: values[order]}
    else:
        if job.kind == "rows":
            return _assemble_rows(job)
        meta_dt = np.dtype(np.int64)
        parts = _load(
            job.workdir, job.bucket, {"meta": meta_dt, "data": job.dtype, "idx": job.index_dtype}
        )
        seg = np.lexsort((parts["idx"], parts["meta"]))
        base = job.base
        lo, hi = job.start - base, job.stop - base
        if hi > seg.size or lo < 0:
            raise RuntimeError(f"bucket {job.bucket}: {seg.size} elements, need [{lo}, {hi})")
        seg = seg[lo:hi]
        out = {"data": parts["data"][seg], "indices": parts["idx"][seg]}
    n = 0
    for name, values in out.items():
        path = job.dst_path if name is None else f"{job.dst_path}/{name}"
        for a in range(0, values.shape[0], job.shard):
            write_region(job.dst, path, job.start + a, values[a : a + job.shard])
        n += values.nbytes
    shutil.rmtree(Path(job.workdir) / f"b{job.bucket:06d}", ignore_errors=True)
    return n


def _assemble_rows(job: AssembleJob) -> int:
    """Pass 2 of a CSR source: the bucket's rows in output order, written shard by shard."""
    data, idx, meta, ptr = _load_segments(job)
    rows = np.argsort(meta[:, 0], kind="stable")
    starts, nnz = meta[rows, 0], meta[rows, 1]
    base = int(starts[0]) if starts.size else job.start
    ends = np.cumsum(nnz)
    if starts.size and int(starts[-1] + nnz[-1] - base) != int(ends[-1]):
        raise RuntimeError(f"bucket {job.bucket}: rows not contiguous (a bug)")
    n, pending = 0, []
    src = [data, idx]
    for a in range(job.start, job.stop, job.shard):
        b = min(a + job.shard, job.stop)
        r0 = int(np.searchsorted(ends, a - base, side="right"))
        r1 = int(np.searchsorted(ends, b - base - 1, side="right")) + 1
        first = int(ends[r0] - nnz[r0]) + base
        size = int(ends[r1 - 1]) + base - first
        for p in pending:  # the shard buffers are about to be reused
            p.result()
        outs = [scratch(f"shard-{i}", size, x.dtype) for i, x in enumerate(src)]
        gather_rows(ptr, rows[r0:r1], *src, *outs)
        pending = [
            submit_region(job.dst, f"{job.dst_path}/{name}", a, buf[a - first : b - first])
            for name, buf in zip(("data", "indices"), outs, strict=True)
        ]
        n += 2 * (b - a)
    for p in pending:
        p.result()
    shutil.rmtree(Path(job.workdir) / f"b{job.bucket:06d}", ignore_errors=True)  # consumed
    return n
