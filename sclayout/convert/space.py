"""Disk space: what the store will take, and one line when a write runs out of it.

The converter refuses to start when DST's file system lacks room for the *store*
(not the source: a gzip ``.h5ad`` may grow, a dense one shrink), estimated from the
number of stored values, the dtypes convert narrows them to and the ratio the chosen
codec reaches on a sample of them.
A write that still runs out of space (another process filled the disk) becomes
:func:`no_space_error`.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from loader.errors import InputError
from sclayout.convert.checks import explain_read_errors
from sclayout.convert.codecs import get_codec
from sclayout.convert.external import ROUTE_CODEC
from sclayout.convert.narrow import stored_dtypes, value_stats
from sclayout.convert.source import MatrixInfo, Source

__all__ = [
    "check_free_space",
    "device_of",
    "estimate_store_bytes",
    "is_no_space",
    "no_space_error",
    "route_bytes",
]

_READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
"""What a damaged source chunk raises through h5py or zarr."""

SAMPLE_ELEMENTS = 1 << 18
"""Values per array compressed to measure the codec's ratio: about a megabyte, a few
milliseconds of encoding, and large enough for blosc's blocks to reach their ratio."""


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
    return total


def _stored_in_source(source: Source, key: str) -> int:
    """Bytes element ``key`` takes in the source (HDF5 storage or zarr files)."""
    node = source.root[key]
    if hasattr(node, "id") and hasattr(node.id, "get_storage_size"):  # h5py dataset
        return int(node.id.get_storage_size())
    if hasattr(node, "keys") and not hasattr(node, "dtype"):  # a group: its arrays
        return sum(_stored_in_source(source, f"{key}/{k}") for k in node.keys())
    return _tree_bytes(Path(source.path, key))


def _sample(source: Source, key: str, n: int) -> np.ndarray:
    """About :data:`SAMPLE_ELEMENTS` values from the middle of ``key``."""
    node = source.root[key]
    row = int(np.prod(node.shape[1:], dtype=np.int64)) if len(node.shape) > 1 else 1
    take = max(1, min(n, SAMPLE_ELEMENTS // max(row, 1)))
    start = max(0, n // 2 - take // 2)
    with explain_read_errors(source.path, what=key, errors=_READ_ERRORS):
        return np.ascontiguousarray(node[start : start + take])


def _ratio(sample: np.ndarray, compressors: Any) -> float:
    """Return the stored bytes per raw byte of ``sample`` with the codec."""
    if sample.nbytes == 0:
        return 1.0
    arr = zarr.create_array(
        zarr.storage.MemoryStore(),
        shape=sample.shape,
        dtype=sample.dtype,
        chunks=sample.shape,
        compressors=compressors,
        fill_value=0,
    )
    arr[...] = sample
    meta = zarr.create_array(
        zarr.storage.MemoryStore(), shape=sample.shape, dtype=sample.dtype, chunks=sample.shape
    ).nbytes_stored()  # the metadata document alone: no chunk was written
    return max(arr.nbytes_stored() - meta, 1) / sample.nbytes


SAMPLED_SOURCES = 3
"""Sources whose arrays are sampled for the codec's ratio; the next sources of a
conversion take the mean of those for the same array (an atlas's files hold the same
kind of data, and each sample is a cold read of every file)."""


def _matrix_bytes(
    source: Source, info: MatrixInfo, compressors: Any, ratios: dict[tuple, list[float]]
) -> int:
    """Return the stored bytes of a matrix, in the dtypes convert narrows a sample to.

    The narrowing is judged on the sample: a guess, as the codec's ratio is. ``ratios``
    keeps the stored bytes per value measured on the first :data:`SAMPLED_SOURCES`
    sources, by array.
    """

    def per_value(key: str, n: int, role: int) -> float:
        seen = ratios.setdefault((key.rsplit("/", 1)[-1], info.path), [])
        if len(seen) < SAMPLED_SOURCES:
            sample = _sample(source, key, n)
            # the column id dtype depends on n_vars only, once narrowing is on
            sample = sample.astype(stored_dtypes(info, value_stats(sample))[role])
            seen.append(sample.itemsize * _ratio(sample, compressors))
        return sum(seen) / len(seen)

    n_obs, n_vars = info.shape
    if info.encoding == "dense":
        return int(n_obs * n_vars * per_value(info.path, n_obs, 0))
    nnz = info.nnz
    total = (n_obs + 1) * 8  # indptr: int64, compresses well, counted raw
    total += int(nnz * per_value(f"{info.path}/data", nnz, 0))
    total += int(nnz * per_value(f"{info.path}/indices", nnz, 1))
    return total


def estimate_store_bytes(
    source: Source,
    codec: str,
    *,
    ratios: dict[tuple, list[float]] | None = None,
    route: bool = False,
) -> int:
    """Bytes the layout store of ``source`` is expected to take with ``codec``.

    Row-aligned matrices (X, layers, raw/X): their stored values (``nnz`` values and
    indices, or every cell of a dense matrix) times the ratio the codec reaches on a
    sample. Every other element (obs, var, obsm, uns...) is copied and counted at its
    size in the source. ``ratios``, shared by the calls for the sources of one
    conversion, keeps the ratios measured so far (:data:`SAMPLED_SOURCES`).

    ``route``: a reordering conversion, whose route files sit beside the store written
    so far. Deleted bucket by bucket as the matrix's shards are written, they add at
    most what they exceed that matrix's share of the store by (the largest excess).
    """
    compressors = get_codec(codec)
    matrices = source.row_matrices()
    in_source = sum(_stored_in_source(source, m.path) for m in matrices)
    other = max(0, _tree_bytes(Path(source.path)) - in_source)
    ratios = {} if ratios is None else ratios
    stored = [_matrix_bytes(source, m, compressors, ratios) for m in matrices]
    excess = 0
    if route:
        excess = max(
            (_route_bytes(source, m) - b for m, b in zip(matrices, stored, strict=True)),
            default=0,
        )
    return other + sum(stored) + max(0, excess)


def route_bytes(source: Source) -> int:
    """Bytes of the route files a reordering conversion of ``source`` writes.

    A CSR matrix's values and column indices are routed compressed
    (:data:`~sclayout.convert.external.ROUTE_CODEC`, at the ratio it reaches on a sample
    of each array) with 16 bytes a row charged at half; a dense or CSC matrix's route
    files are not compressed (8 bytes a row, 8 an entry more for CSC). All of them
    exist when the first bucket is written; then they are deleted bucket by bucket as
    the store grows (:func:`estimate_store_bytes` with ``route``). The largest matrix's.
    """
    return max((_route_bytes(source, m) for m in source.row_matrices()), default=0)


def _route_bytes(source: Source, m: MatrixInfo) -> int:
    """Bytes of the route files of matrix ``m`` (see :func:`route_bytes`)."""
    n_obs, n_vars = m.shape
    if m.encoding == "dense":
        return n_obs * n_vars * m.itemsize + 8 * n_obs
    if m.encoding == "csr":
        values = m.itemsize * _route_ratio(source, f"{m.path}/data", m.nnz)
        index = np.dtype(m.index_dtype).itemsize
        index *= _route_ratio(source, f"{m.path}/indices", m.nnz)
        return int(m.nnz * (values + index)) + 8 * n_obs
    return m.nnz * (m.itemsize + np.dtype(m.index_dtype).itemsize + 8) + 16 * n_obs


def _route_ratio(source: Source, key: str, n: int) -> float:
    """Compressed bytes per raw byte of a sample of ``key`` with the route files' codec."""
    sample = _sample(source, key, n)
    if sample.nbytes == 0:
        return 1.0
    return min(1.0, len(ROUTE_CODEC.encode(sample)) / sample.nbytes)


def device_of(path: Path) -> str:
    """Return the mount point of the file system holding ``path`` (an existing directory)."""
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def check_free_space(dst: Path, need_bytes: int) -> None:
    """Raise :class:`InputError` unless DST's file system has ``need_bytes`` free."""
    parent = dst.absolute().parent
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise InputError(
            f"not enough disk space: need ~{_size(need_bytes)} at {parent}, have {_size(free)}; "
            "free space or choose another DST"
        )


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a write that ran out of space or quota.

    That is ``OSError`` ENOSPC/EDQUOT, or tensorstore's ``RESOURCE_EXHAUSTED`` for the
    same.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(cur)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def no_space_error(dst: Path, need_bytes: int) -> InputError:
    """Return the one-line error of a conversion whose writes ran out of space."""
    return InputError(
        f"no space left on {device_of(dst.absolute().parent)} while writing {dst} "
        f"(needs about {_size(need_bytes)}): free space or choose another DST"
    )
