"""The fetch planner: a set of blocks -> the exact inner chunks to read (pure, no I/O).

A *fetch* is a set of blocks read together. Planning sorts the blocks, merges runs
of consecutive blocks into row ranges, maps each row range to the element ranges it
needs in every array of the matrix (CSR ``data``/``indices`` through the block
pointer, ``indptr`` through the rows, dense ``values`` through the rows), widens
them to whole inner chunks and coalesces neighbouring chunk ranges into one read.

The same plan serves the executor (:mod:`loader.store`), which issues every read at
once, and the cost model, which predicts a fetch's time from ``n_requests``,
``bytes_read`` and ``n_chunks`` without touching the disk.
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict

import numpy as np

from loader.argtypes import typechecked
from loader.errors import InputError
from loader.layout import ArrayLayout, Manifest, MatrixLayout

__all__ = [
    "FetchPlan",
    "ReadRange",
    "blocks_to_rows",
    "fetch_ranges",
    "plan_fetch",
    "ranges_to_rows",
]


class ReadRange(NamedTuple):
    """Element range ``[start, stop)`` on axis 0 of one zarr array of the matrix.

    ``array`` is the array's role in the matrix (``"data"``, ``"indices"``,
    ``"indptr"`` or ``"values"``); :attr:`loader.layout.MatrixLayout.arrays` maps it
    to its path. The range is aligned to the array's inner chunks (``stop`` is
    clipped to the array's length).
    """

    array: str
    start: int
    stop: int


class FetchPlan(TypedDict):
    """What reading one fetch costs and which elements it needs.

    ``blocks``: the fetch's block ids, sorted and unique. ``row_ranges``: coalesced
    stored-row ranges. ``reads``: chunk-aligned, coalesced reads, sorted per array.
    ``needed``: per array, the exact element ranges the rows occupy (an ``(n, 2)``
    int64 array, one row per row range, empty ranges kept); the executor asks the
    storage layer for these and the storage layer fetches the chunks in ``reads``.
    ``n_chunks``: inner chunks touched over all arrays (for a dense array, row chunks
    times column chunks). ``n_requests``: ``len(reads)``. ``bytes_needed``:
    uncompressed bytes of the rows themselves; ``bytes_read``: uncompressed bytes of
    the chunks read (``>= bytes_needed``, the difference is over-read).
    """

    blocks: np.ndarray
    row_ranges: list[tuple[int, int]]
    reads: list[ReadRange]
    needed: dict[str, np.ndarray]
    n_rows: int
    n_chunks: int
    n_requests: int
    bytes_needed: int
    bytes_read: int


def _as_blocks(blocks: object, n_blocks: int) -> np.ndarray:
    arr = np.asarray(blocks)
    if arr.ndim != 1 and arr.size:
        arr = arr.ravel()
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"blocks={blocks!r:.60} of dtype {arr.dtype}: must be integer block ids")
    arr = np.unique(arr.astype(np.int64, copy=False))
    if arr[0] < 0 or arr[-1] >= n_blocks:
        bad = arr[0] if arr[0] < 0 else arr[-1]
        raise InputError(f"block id {int(bad)} out of range: the store has {n_blocks} blocks")
    return arr


def blocks_to_rows(
    blocks: np.ndarray, *, block_size: int, n_obs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coalesce sorted unique ``blocks`` into runs of consecutive blocks.

    Returns
    -------
    first, last
        First and last block of each run (int64).
    bounds
        ``(n_runs, 2)`` stored-row range ``[start, stop)`` of each run.
    """
    if blocks.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros((0, 2), dtype=np.int64)
    cut = np.flatnonzero(np.diff(blocks) != 1) + 1
    first = blocks[np.r_[0, cut]]
    last = blocks[np.r_[cut - 1, blocks.size - 1]]
    bounds = np.stack(
        [first * block_size, np.minimum((last + 1) * block_size, n_obs)], axis=1
    ).astype(np.int64)
    return first, last, bounds


def ranges_to_rows(bounds: np.ndarray) -> np.ndarray:
    """All rows of the ``(n, 2)`` ranges ``bounds``, in order (int64, vectorised)."""
    sizes = (bounds[:, 1] - bounds[:, 0]).astype(np.int64)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # Each row is its range's start plus its position inside the range.
    starts = np.repeat(bounds[:, 0].astype(np.int64) - np.cumsum(sizes) + sizes, sizes)
    return starts + np.arange(total, dtype=np.int64)


def _chunk_reads(
    name: str,
    ranges: np.ndarray,
    layout: ArrayLayout,
    *,
    max_gap_chunks: int,
) -> tuple[list[ReadRange], int, int, int]:
    """Chunk-aligned, coalesced reads covering ``ranges`` of one array.

    Returns the reads, the chunks they touch, their uncompressed bytes and the
    uncompressed bytes of ``ranges`` themselves.
    """
    length = layout.shape[0]
    chunk = layout.chunks[0]
    # Elements per axis-0 position and chunks per axis-0 chunk (dense: all columns).
    width = int(np.prod(layout.shape[1:], dtype=np.int64)) if len(layout.shape) > 1 else 1
    col_chunks = 1
    for s, c in zip(layout.shape[1:], layout.chunks[1:], strict=True):
        col_chunks *= -(-s // c)
    item = np.dtype(layout.dtype).itemsize
    nonempty = ranges[ranges[:, 1] > ranges[:, 0]]
    needed = int((nonempty[:, 1] - nonempty[:, 0]).sum()) * width * item
    if nonempty.size == 0:
        return [], 0, 0, 0
    c_lo = nonempty[:, 0] // chunk
    c_hi = -(-nonempty[:, 1] // chunk)
    # Ranges come sorted by start; a new read starts where the gap to everything
    # before exceeds max_gap_chunks.
    reach = np.maximum.accumulate(c_hi)
    new = np.r_[True, c_lo[1:] > reach[:-1] + max_gap_chunks]
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], c_lo.size] - 1
    g_lo = c_lo[starts]
    g_hi = reach[ends]
    n_chunks = int((g_hi - g_lo).sum()) * col_chunks
    lo = g_lo * chunk
    hi = np.minimum(g_hi * chunk, length)
    bytes_read = int((hi - lo).sum()) * width * item
    reads = [ReadRange(name, a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
    return reads, n_chunks, bytes_read, needed


def needed_ranges(
    bounds: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    *,
    matrix: MatrixLayout,
    block_pointer: np.ndarray | None,
    row_chunked: bool = False,
) -> dict[str, np.ndarray]:
    """Exact element ranges each array of ``matrix`` needs for the row runs ``bounds``.

    ``row_chunked``: ``indptr`` is in row chunks (manifest ``row_chunks``), so a run
    ``[r0, r1)`` reads ``indptr[r0:r1]`` (its blocks' chunks) and takes ``indptr[r1]``
    from the block pointer; otherwise ``indptr[r0:r1 + 1]``.
    """
    if matrix.is_csr:
        if block_pointer is None:
            raise InputError("a CSR matrix needs its block_pointer to plan a fetch")
        bp = np.asarray(block_pointer, dtype=np.int64)
        nnz = np.stack([bp[first], bp[last + 1]], axis=1) if first.size else bounds.copy()
        return {
            "data": nnz,
            "indices": nnz,
            "indptr": bounds.copy()
            if row_chunked
            else np.stack([bounds[:, 0], bounds[:, 1] + 1], axis=1),
        }
    return {"values": bounds}


@typechecked
def plan_fetch(
    blocks: object,
    *,
    manifest: Manifest,
    block_pointer: np.ndarray | None,
    matrix: str = "X",
    max_gap_chunks: int = 0,
) -> FetchPlan:
    """Plan the reads of one fetch.

    Parameters
    ----------
    blocks
        Block ids of the fetch (any order, duplicates ignored), in units of
        ``manifest.block_size``.
    manifest
        The store's manifest (or a virtual one for a raw h5ad).
    block_pointer
        For a CSR matrix, the ``indptr`` value at every block boundary
        (``n_blocks + 1`` int64 values); ``None`` for a dense matrix.
    matrix
        Which matrix to read (``"X"`` or a layer such as ``"layers/counts"``).
    max_gap_chunks
        Merge two reads of one array when at most this many unneeded chunks lie
        between them (fewer requests, more over-read). ``0`` merges only touching
        or overlapping chunk ranges.

    Returns
    -------
    FetchPlan
    """
    if (
        isinstance(max_gap_chunks, bool)
        or not isinstance(max_gap_chunks, int | np.integer)
        or max_gap_chunks < 0
    ):
        raise InputError(f"max_gap_chunks={max_gap_chunks!r}: must be an integer >= 0")
    ids, bounds, needed = fetch_ranges(
        blocks, manifest=manifest, block_pointer=block_pointer, matrix=matrix
    )
    layout = manifest.matrices[matrix]
    reads: list[ReadRange] = []
    n_chunks = bytes_read = bytes_needed = 0
    for name, ranges in needed.items():
        r, c, b_read, b_need = _chunk_reads(
            name, ranges, layout.arrays[name], max_gap_chunks=int(max_gap_chunks)
        )
        reads += r
        n_chunks += c
        bytes_read += b_read
        bytes_needed += b_need
    return FetchPlan(
        blocks=ids,
        row_ranges=[tuple(r) for r in bounds.tolist()],
        reads=reads,
        needed=needed,
        n_rows=int((bounds[:, 1] - bounds[:, 0]).sum()),
        n_chunks=n_chunks,
        n_requests=len(reads),
        bytes_needed=bytes_needed,
        bytes_read=bytes_read,
    )


def fetch_ranges(
    blocks: object,
    *,
    manifest: Manifest,
    block_pointer: np.ndarray | None,
    matrix: str = "X",
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Return what a reader needs to issue a fetch, without the read accounting.

    Unlike :func:`plan_fetch`, only the sorted unique block ids, the ``(n, 2)``
    stored-row ranges of their runs, and the element ranges each array needs (same
    checks and errors).
    """
    if matrix not in manifest.matrices:
        raise InputError(
            f"matrix={matrix!r}: not in the store; available: {', '.join(manifest.matrices)}"
        )
    layout = manifest.matrices[matrix]
    if layout.is_csr and block_pointer is not None:
        if len(block_pointer) != manifest.n_blocks + 1:
            raise InputError(
                f"block_pointer has {len(block_pointer)} values; the manifest's "
                f"{manifest.n_blocks} blocks need {manifest.n_blocks + 1}"
            )
    ids = _as_blocks(blocks, manifest.n_blocks)
    first, last, bounds = blocks_to_rows(ids, block_size=manifest.block_size, n_obs=manifest.n_obs)
    needed = needed_ranges(
        bounds,
        first,
        last,
        matrix=layout,
        block_pointer=block_pointer,
        row_chunked=manifest.row_chunks > 0,
    )
    return ids, bounds, needed
