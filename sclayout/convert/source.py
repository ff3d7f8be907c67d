"""Reading an AnnData source (.h5ad or an AnnData zarr v2/v3 store) piece by piece.

Small elements (obs, var, obsm, uns, ...) are read whole with anndata's element
reader. The row-aligned matrices (X, layers, raw/X) are described by
:class:`MatrixInfo` and read in large contiguous slices (element ranges of CSR/CSC
``data``/``indices``, row ranges of dense arrays), never row by row.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# anndata (and dask with it) is imported where it is used: `sclayout inspect` and
# `verify` of a store alone start faster without it
import h5py
import numpy as np
import zarr

from loader.errors import InputError
from sclayout.convert._buffers import ALIGN, aligned_scratch, scratch
from sclayout.convert.checks import explain_read_errors

__all__ = [
    "DirectH5Reader",
    "MatrixInfo",
    "Source",
    "fingerprint",
    "io_map",
    "open_direct",
    "open_group",
    "pread_full",
    "prefer_direct_io",
    "read_slice",
    "source_tables",
]

FINGERPRINT_BYTES = 2**20
"""Bytes hashed at each end of a source file for its fingerprint (1 MiB)."""

DIRECT_IO: bool | None = None
"""Read uncompressed HDF5 sources with ``O_DIRECT``: ``None`` (default) when the file
is not mostly in the page cache (its first :data:`CACHED_SAMPLE_BYTES` sampled),
``True`` always (where the file system allows it), ``False`` never. A conversion reads
its source once, so a cold file gains nothing from the page cache, and filling the
cache can cost much system CPU (``benchmarks/convert_io.py`` compares cold buffered and
``O_DIRECT`` reads of a source)."""

CACHED_SAMPLE_BYTES = 256 * 2**20
"""Bytes at the start of a source whose page-cache residency decides ``O_DIRECT``."""

DIRECT_PIECE = 16 * 2**20
"""Bytes per ``O_DIRECT`` read: the kernel splits it into device requests issued
together (queue depth without threads) while a thread's staging buffer stays small."""

DIRECT_GAP = 2**20
"""Runs of chunks closer than this in the file are read in one request (the gap, e.g.
a 2 KiB B-tree node, is read and dropped)."""

_ENCODINGS = {"csr_matrix": "csr", "csc_matrix": "csc", "array": "dense"}


@dataclass(frozen=True)
class MatrixInfo:
    """A row-aligned matrix of the source.

    ``path`` is its key in the AnnData tree (``X``, ``layers/counts``, ``raw/X``);
    ``encoding`` is ``csr``, ``csc`` or ``dense``; ``index_dtype`` is the dtype of
    ``indices`` (sparse only).
    """

    path: str
    encoding: str
    shape: tuple[int, int]
    dtype: np.dtype
    index_dtype: np.dtype | None
    nnz: int

    @property
    def itemsize(self) -> int:
        """Bytes per value of the matrix."""
        return self.dtype.itemsize


def _is_zarr(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in ("zarr.json", ".zgroup", ".zattrs")
    )


@contextmanager
def open_group(path: str | os.PathLike) -> Iterator[Any]:
    """Open a source's root group read-only (``h5py.File`` or ``zarr.Group``)."""
    p = Path(path)
    if p.is_file():
        with h5py.File(p, "r") as f:
            yield f
    elif _is_zarr(p):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield zarr.open_group(p, mode="r")
    else:
        raise InputError(f"SRC {p}: neither an .h5ad file nor an AnnData zarr store")


_lock = threading.Lock()
_handles: dict[tuple[str, int], Any] = {}
_arrays: dict[tuple[str, str, int], Any] = {}
_fds: dict[tuple[str, int], int] = {}
_direct_fds: dict[tuple[str, int], int | None] = {}


class DirectH5Reader:
    """Reads first-axis slices of an *uncompressed* HDF5 dataset with ``os.preadv``.

    h5py serialises every read on its global lock and holds it while copying, so two
    threads never read at once; reading the same bytes at their file offsets releases
    the GIL and needs no lock, so reads of several tasks overlap. Only for contiguous
    datasets and 1-D chunked ones without filters, every chunk allocated;
    :meth:`create` returns None otherwise and the caller uses h5py. With ``direct_fd``
    (the file opened with ``O_DIRECT``) byte ranges are read page-aligned into a staging
    buffer and copied out, bypassing the page cache.
    """

    def __init__(
        self,
        fd: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
        chunk: int | None,
        offsets: np.ndarray,
        *,
        direct_fd: int | None = None,
    ) -> None:
        self.fd, self.dtype, self.shape, self.chunk, self.offsets = fd, dtype, shape, chunk, offsets
        self.direct_fd = direct_fd
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    @classmethod
    def create(
        cls, ds: h5py.Dataset, fd: int, *, direct_fd: int | None = None
    ) -> DirectH5Reader | None:
        """Return a direct reader of ``ds``, or ``None`` where h5py must read it."""
        dtype = ds.dtype
        if dtype.hasobject or not dtype.isnative or ds.id.get_create_plist().get_nfilters():
            return None
        if ds.chunks is None:
            offset = ds.id.get_offset()
            if offset is None:  # never written: fill values only
                return None
            offsets = np.array([offset], dtype=np.int64)
            return cls(fd, dtype, ds.shape, None, offsets, direct_fd=direct_fd)
        if len(ds.shape) != 1:
            return None
        chunk = ds.chunks[0]
        n = -(-ds.shape[0] // chunk)
        if ds.id.get_num_chunks() != n:
            return None
        infos = _chunk_infos(ds, n)
        offsets = np.empty(n, dtype=np.int64)
        for info in infos:
            if info.filter_mask or info.byte_offset is None:
                return None
            offsets[info.chunk_offset[0] // chunk] = info.byte_offset
        return cls(fd, dtype, ds.shape, chunk, offsets, direct_fd=direct_fd)

    def read(
        self, start: int, stop: int, *, buffer: str | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows ``[start, stop)``; into ``out`` or this thread's scratch buffer ``buffer``."""
        stop = min(stop, self.shape[0])
        start = min(start, stop)
        shape = (stop - start, *self.shape[1:])
        if out is not None:
            out = out.reshape(shape)
        elif buffer is None:
            out = np.empty(shape, dtype=self.dtype)
        else:
            out = scratch(buffer, int(np.prod(shape, dtype=np.int64)), self.dtype).reshape(shape)
        runs = self._runs(start, stop)
        dest = out.reshape(-1).view(np.uint8)
        if self.direct_fd is not None:
            try:
                self._read_direct(dest, runs)
                return out
            except OSError as e:  # alignment the file system refuses: read it buffered
                if e.errno != errno.EINVAL:
                    raise
                self.direct_fd = None
        pieces = [  # runs cut into DIRECT_PIECE pieces, read in parallel
            (pos + a, off + a, min(DIRECT_PIECE, n - a))
            for pos, off, n in runs
            for a in range(0, n, DIRECT_PIECE)
        ]
        io_map(lambda r: pread_full(self.fd, memoryview(dest[r[0] : r[0] + r[2]]), r[1]), pieces)
        return out

    def _runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Return the runs of rows ``[start, stop)`` that lie end to end in the file.

        Each run is (position in the output, file offset, bytes).
        """
        item = self.row_bytes
        if self.chunk is None:
            return [(0, int(self.offsets[0]) + start * item, (stop - start) * item)]
        c, runs, pos = self.chunk, [], start
        while pos < stop:
            k = pos // c
            run_end = min(stop, (k + 1) * c)
            while run_end < stop and self.offsets[k + 1] == self.offsets[k] + c * item:
                k += 1
                run_end = min(stop, (k + 1) * c)
            first = pos // c
            file_off = int(self.offsets[first]) + (pos - first * c) * item
            runs.append(((pos - start) * item, file_off, (run_end - pos) * item))
            pos = run_end
        return runs

    def _read_direct(self, dest: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
        """Read ``runs`` into ``dest`` with page-aligned ``O_DIRECT`` reads.

        Runs closer than :data:`DIRECT_GAP` in the file share a request; a request is
        cut into pieces of :data:`DIRECT_PIECE` bytes, read in parallel on the I/O
        threads (:func:`io_map`), each into its thread's aligned staging buffer and
        copied out.
        """
        pieces = []
        i = 0
        while i < len(runs):
            j = i + 1  # runs[i:j] form one span of the file
            while (
                j < len(runs) and 0 <= runs[j][1] - (runs[j - 1][1] + runs[j - 1][2]) <= DIRECT_GAP
            ):
                j += 1
            lo = runs[i][1] // ALIGN * ALIGN
            hi = runs[j - 1][1] + runs[j - 1][2]
            for p0 in range(lo, hi, DIRECT_PIECE):
                pieces.append((p0, min(p0 + DIRECT_PIECE, hi), runs[i:j]))
            i = j

        def read_piece(piece: tuple[int, int, list]) -> None:
            p0, end, span = piece
            p1 = -(-end // ALIGN) * ALIGN
            stage = aligned_scratch("direct-stage", DIRECT_PIECE)
            pread_full(self.direct_fd, memoryview(stage[: p1 - p0]), p0, upto=end - p0)
            for pos, off, n in span:  # copy the parts of the runs in this piece
                a, b = max(off, p0), min(off + n, end)
                if a < b:
                    dest[pos + a - off : pos + b - off] = stage[a - p0 : b - p0]

        io_map(read_piece, pieces)


def _chunk_infos(ds: h5py.Dataset, n: int) -> list:
    """Every chunk's storage info, in one pass over the chunk index.

    ``get_chunk_info(i)`` walks the index from the start on every call (quadratic): for
    an h5ad chunked as anndata chunks it (thousands of chunks per array) that takes
    seconds per array, against milliseconds for one ``chunk_iter`` pass
    (benchmarks/h5_chunk_index.py; HDF5 >= 1.14 / h5py >= 3.8; older ones fall back).
    """
    infos: list = []
    try:
        ds.id.chunk_iter(infos.append)
    except (AttributeError, NotImplementedError):
        infos = [ds.id.get_chunk_info(i) for i in range(n)]
    return infos


IO_THREADS = 6
"""Threads issuing ``O_DIRECT`` reads for all tasks of a process. They wait on the disk
with the GIL released; a disk reads large requests fastest with several in flight
(``benchmarks/convert_io.py`` times one against several)."""

_io_lock = threading.Lock()
_io_pool: list[ThreadPoolExecutor] = []


def io_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` run on the process's :data:`IO_THREADS` I/O threads."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with _io_lock:
        if not _io_pool:
            _io_pool.append(ThreadPoolExecutor(IO_THREADS, thread_name_prefix="sclayout-io"))
        pool = _io_pool[0]
    return list(pool.map(fn, items))


def pread_full(fd: int, buf: memoryview, offset: int, *, upto: int | None = None) -> int:
    """Fill ``buf`` from ``offset``; return the bytes read.

    At least ``upto`` bytes: an ``O_DIRECT`` read of the last page may stop at the end
    of the file.
    """
    need = len(buf) if upto is None else upto
    done = 0
    while done < need:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file reading {need} bytes at {offset}")
        done += n
    return done


def prefer_direct_io(path: str | os.PathLike, *, nbytes: int = 0) -> bool:
    """Whether to bypass the page cache (``O_DIRECT``) for a source or temporary files.

    For reading source ``path`` or for ``nbytes`` of temporary files: :data:`DIRECT_IO`
    if set, else when the source is a file not mostly in the page cache or ``nbytes``
    exceeds half the RAM.
    """
    if DIRECT_IO is not None or not hasattr(os, "O_DIRECT"):
        return bool(DIRECT_IO) and hasattr(os, "O_DIRECT")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = None
    if ram is not None and nbytes > ram // 2:
        return True
    if not Path(path).is_file():
        return False
    from sclayout.pagecache import resident_fraction

    cached = resident_fraction(path, max_bytes=CACHED_SAMPLE_BYTES)
    return cached is not None and cached < 0.5


def open_direct(
    path: str | os.PathLike, flags: int, *, direct: bool = True, mode: int = 0o644
) -> int:
    """``os.open(path, flags)`` with ``O_DIRECT`` added when ``direct`` and possible.

    The file system must allow it (tmpfs does not).
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode)


def _open_direct(path: Path) -> int | None:
    """Source ``path`` opened with ``O_DIRECT`` when :func:`prefer_direct_io`, else None."""
    if not prefer_direct_io(path):
        return None
    fd = open_direct(path, os.O_RDONLY)
    if os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL):
        return fd
    os.close(fd)
    return None


def _open_array(src: str, array: str) -> Any:
    """Return a cached reader of ``src[array]``: direct pread when possible, else h5py/zarr."""
    pid = os.getpid()
    key = (src, array, pid)
    with _lock:
        if key in _arrays:
            return _arrays[key]
        p = Path(src)
        if (src, pid) not in _handles:
            if p.is_file():
                _handles[(src, pid)] = h5py.File(p, "r")
                _fds[(src, pid)] = os.open(p, os.O_RDONLY)
                _direct_fds[(src, pid)] = _open_direct(p)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _handles[(src, pid)] = zarr.open_group(p, mode="r")
        node = _handles[(src, pid)][array]
        reader = None
        if isinstance(node, h5py.Dataset):
            reader = DirectH5Reader.create(
                node, _fds[(src, pid)], direct_fd=_direct_fds[(src, pid)]
            )
        _arrays[key] = reader if reader is not None else node
        return _arrays[key]


def read_slice(
    src: str,
    array: str,
    start: int,
    stop: int,
    *,
    buffer: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``src[array][start:stop]`` along the first axis, from a cached reader.

    ``buffer`` names a per-thread scratch buffer to read into (direct HDF5 reads
    only); the result is then valid until this thread reuses that name. ``out`` (of
    the array's dtype and the slice's size) is filled and returned instead.
    """
    with reading(src, array):
        reader = _open_array(src, array)
        direct = isinstance(reader, DirectH5Reader)
        if direct and (out is None or out.dtype == reader.dtype):
            return reader.read(start, stop, buffer=buffer, out=out)
        if isinstance(reader, h5py.Dataset) and (out is not None or buffer is not None):
            into = _h5_read_into(reader, start, stop, buffer=buffer, out=out)
            if into is not None:
                return into
        values = reader.read(start, stop) if direct else np.asarray(reader[start:stop])
        if out is None:
            return values
        out = out.reshape(values.shape)
        out[...] = values
        return out


def _h5_read_into(
    ds: h5py.Dataset, start: int, stop: int, *, buffer: str | None, out: np.ndarray | None
) -> np.ndarray | None:
    """Read rows ``[start, stop)`` of an HDF5 dataset into ``out`` or scratch ``buffer``.

    HDF5 decodes each (compressed) chunk into place: no fresh array per slice and no
    second copy. None when the dtypes differ.
    """
    dtype = np.dtype(ds.dtype)
    if (out is not None and out.dtype != dtype) or dtype.hasobject:
        return None
    stop = min(stop, ds.shape[0])
    start = min(start, stop)
    shape = (stop - start, *ds.shape[1:])
    n = int(np.prod(shape, dtype=np.int64))
    dest = out.reshape(shape) if out is not None else scratch(buffer, n, dtype).reshape(shape)
    if n:
        ds.read_direct(dest, np.s_[start:stop])
    return dest


def reading(src: str | os.PathLike, what: str) -> Any:
    """Turn what a damaged source raises into a one-line :class:`InputError`.

    Besides ``OSError`` (which is left to the caller: it may be the destination's); the
    error names ``what`` (:func:`sclayout.convert.checks.explain_read_errors`).
    """
    return explain_read_errors(src, what=what, errors=(RuntimeError, KeyError, ValueError))


def close_handles() -> None:
    """Close the cached source handles."""
    with _lock:
        _arrays.clear()
        for h in _handles.values():
            if isinstance(h, h5py.File):
                h.close()
        _handles.clear()
        for fd in [*_fds.values(), *_direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        _fds.clear()
        _direct_fds.clear()
    with _io_lock:
        for pool in _io_pool:
            pool.shutdown()
        _io_pool.clear()


def _attr(node: Any, key: str, default: Any = None) -> Any:
    v = node.attrs.get(key, default)
    return v.decode() if isinstance(v, bytes) else v


class Source:
    """An open AnnData source.

    Parameters
    ----------
    root
        Root group (``h5py.File`` or ``zarr.Group``) from :func:`open_group`.
    path
        Its path, used by workers to reopen it.
    """

    def __init__(self, root: Any, path: str | os.PathLike) -> None:
        self.root = root
        self.path = str(Path(path).resolve())
        x = self.matrix_info("X") if "X" in root else None
        if x is None:
            raise InputError(f"SRC {path}: has no X matrix; sclayout needs one to lay out")
        self.n_obs, self.n_vars = x.shape

    # -- small elements ---------------------------------------------------------------
    def read_elem(self, key: str) -> Any:
        """Read element ``key`` whole with anndata (quietly)."""
        import anndata as ad

        with reading(self.path, key), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ad.io.read_elem(self.root[key])

    def has(self, key: str) -> bool:
        """Whether the source holds element ``key``."""
        return key in self.root

    def keys(self, key: str) -> list[str]:
        """Return the names inside group ``key``, or none if the source lacks it."""
        return list(self.root[key].keys()) if key in self.root else []

    # -- matrices ---------------------------------------------------------------------
    def matrix_info(self, key: str) -> MatrixInfo:
        """Describe matrix ``key``.

        Raises
        ------
        InputError
            If its encoding is not csr_matrix, csc_matrix or a 2-D array.
        """
        node = self.root[key]
        enc_type = _attr(node, "encoding-type", "array")
        legacy = _attr(node, "h5sparse_format")  # anndata < 0.7: "csr" or "csc"
        if legacy is not None and node.attrs.get("encoding-type") is None:
            shape = tuple(int(s) for s in node.attrs["h5sparse_shape"])
            return MatrixInfo(
                key,
                str(legacy),
                shape,
                np.dtype(node["data"].dtype),
                np.dtype(node["indices"].dtype),
                int(node["data"].shape[0]),
            )
        if isinstance(node, h5py.Dataset | zarr.Array):
            enc_type = "array" if enc_type in (None, "array") else enc_type
        enc = _ENCODINGS.get(enc_type)
        if enc is None:
            raise InputError(
                f"SRC element {key}: unsupported encoding {enc_type!r}; "
                "sclayout reads csr_matrix, csc_matrix or dense arrays"
            )
        if enc == "dense":
            if len(node.shape) != 2:
                raise InputError(f"SRC element {key}: a {len(node.shape)}-D array, expected 2-D")
            return MatrixInfo(key, enc, tuple(node.shape), np.dtype(node.dtype), None, 0)
        shape = tuple(int(s) for s in _attr(node, "shape"))
        return MatrixInfo(
            key,
            enc,
            shape,
            np.dtype(node["data"].dtype),
            np.dtype(node["indices"].dtype),
            int(node["data"].shape[0]),
        )

    def row_matrices(self) -> list[MatrixInfo]:
        """X, every layer and raw/X (all share the rows of X)."""
        out = [self.matrix_info("X")]
        out += [self.matrix_info(f"layers/{k}") for k in sorted(self.keys("layers"))]
        if self.has("raw") and self.has("raw/X"):
            out.append(self.matrix_info("raw/X"))
        return out

    def indptr(self, info: MatrixInfo) -> np.ndarray:
        """Return the whole ``indptr`` of a sparse matrix as int64."""
        return np.asarray(self.root[f"{info.path}/indptr"][...], dtype=np.int64)


def is_legacy(root: Any) -> bool:
    """Whether an open source uses the anndata < 0.7 layout (obs without an encoding)."""
    obs = root["obs"]
    return not hasattr(obs, "keys") or hasattr(obs, "dtype") or "encoding-type" not in obs.attrs


def source_tables(
    root: Any, path: str | os.PathLike, *, pairwise: bool = False, obs: bool = True
) -> dict[str, Any]:
    """Read a source's small elements whole: obs, var, obsm, varm, uns.

    ``has`` says whether it holds raw and the keys of its varm, varp and obsp;
    ``x_dtype`` is the dtype of X.

    ``raw_x`` is the key of raw's X (``raw/X``, or ``raw.X`` in a legacy file) or None,
    ``raw_var`` raw's var. A legacy (anndata < 0.7) file is read through anndata in
    backed mode: its tables are built in memory, X stays on disk. ``pairwise`` also
    reads ``obsp`` (one source keeps it; a legacy file's graphs in ``uns/neighbors``
    are anndata's obsp). ``obs=False`` leaves a modern source's obs unread (None): it is
    streamed a column at a time (:mod:`sclayout.convert.obs`).
    """
    import anndata as ad

    x_dtype = Source(root, path).matrix_info("X").dtype
    if is_legacy(root):
        with reading(path, "obs and var"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adata = ad.read_h5ad(path, backed="r")
            try:
                return {
                    "obs": adata.obs.copy(),
                    "var": adata.var.copy(),
                    "obsm": {k: np.asarray(v) for k, v in adata.obsm.items()},
                    "uns": dict(adata.uns),
                    "has": {
                        "raw": adata.raw is not None,
                        "varm": sorted(adata.varm.keys()),
                        "varp": [],
                        "obsp": sorted(adata.obsp.keys()),
                    },
                    "x_dtype": x_dtype,
                    "varm": {k: np.asarray(v) for k, v in adata.varm.items()},
                    "obsp": dict(adata.obsp) if pairwise else {},
                    "raw_x": "raw.X" if "raw.X" in root else None,
                    "raw_var": adata.raw.var.copy() if adata.raw is not None else None,
                }
            finally:
                adata.file.close()
    src = Source(root, path)

    def get(key: str) -> Any:
        return src.read_elem(key) if src.has(key) else {}

    return {
        "obs": src.read_elem("obs") if obs else None,
        "var": src.read_elem("var"),
        "obsm": get("obsm"),
        "uns": get("uns"),
        "has": {k: sorted(src.keys(k)) for k in ("varm", "varp", "obsp")}
        | {"raw": src.has("raw/X")},
        "x_dtype": x_dtype,
        "varm": get("varm"),
        "obsp": get("obsp") if pairwise else {},
        "raw_x": "raw/X" if src.has("raw/X") else None,
        "raw_var": src.read_elem("raw/var") if src.has("raw/X") and src.has("raw/var") else None,
    }


def fingerprint(path: str | os.PathLike, *, n_obs: int, n_vars: int, nnz: int) -> dict[str, Any]:
    """Identify a source: path, size, mtime, shape, nnz and sha256 of its ends.

    For a zarr directory the size is the sum of its files and the hashed bytes are
    those of its root metadata file.
    """
    p = Path(path).resolve()
    st = p.stat()
    if p.is_file():
        size = st.st_size
        with open(p, "rb") as f:
            head = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
            f.seek(max(0, size - FINGERPRINT_BYTES))
            tail = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
    else:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        meta = next(p / n for n in ("zarr.json", ".zattrs", ".zgroup") if (p / n).exists())
        head = tail = hashlib.sha256(meta.read_bytes()).hexdigest()
    return {
        "path": str(p),
        "size": int(size),
        "mtime": float(st.st_mtime),
        "n_obs": int(n_obs),
        "n_vars": int(n_vars),
        "nnz": int(nnz),
        "sha256_first_mib": head,
        "sha256_last_mib": tail,
    }
