"""Whole reads of a layout store's small arrays, every chunk checked.

The matrix's chunks are read by the backends, which check them (:mod:`loader.engine.shards`,
:mod:`loader.backends`). The arrays a reader reads whole with zarr-python (obs columns,
``var``, ``obsm``, the source index, the block pointer) go through here: in a store
whose manifest says every chunk is stored (format version 2), an absent chunk is
damage, which zarr-python would read as the fill value, so chunk files are looked for
first (a ``stat`` each, no read); a chunk that fails its crc32c or does not decode is
one :class:`LayoutError` naming the store, the array and the chunk, not zarr's
``ValueError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loader.backends import damage_cause
from loader.engine.shards import missing_chunk
from loader.errors import LayoutError

__all__ = ["DECODE_ERRORS", "check_stored", "read_element", "read_whole"]

FIX = "restore the store from a good copy or reconvert it"
"""What a message about a damaged array tells the user to do."""

DECODE_ERRORS = (ValueError, RuntimeError, TypeError)
"""What zarr-python raises on bytes it cannot use: a crc32c mismatch (ValueError), a
zstd or blosc stream that does not decode (RuntimeError), a wrong decoded size."""


def check_stored(location: str, path: str) -> None:
    """Raise :class:`LayoutError` naming the first absent chunk of array ``path``."""
    gone = missing_chunk(location, path)
    if gone is not None:
        raise LayoutError(f"store {location}, array {path}, {gone} is missing; {FIX}")


def read_whole(array: Any, location: str, path: str, *, require_chunks: bool) -> np.ndarray:
    """Return the zarr array ``array`` (at ``path`` in the store at ``location``) whole.

    ``require_chunks`` (the manifest's ``all_chunks_stored``): an absent chunk is an
    error, not the fill value.
    """
    if require_chunks:
        check_stored(location, path)
    try:
        return np.asarray(array[...])
    except DECODE_ERRORS as e:
        raise _damaged(array, location, path, e) from None


def read_element(node: Any, location: str, *, require_chunks: bool) -> Any:
    """Return anndata's ``read_elem`` of the zarr group or array ``node`` of a store.

    Every array under ``node`` is checked as :func:`read_whole` checks one.
    """
    from anndata.io import read_elem

    if hasattr(node, "members"):
        arrays = [a for _, a in node.members(max_depth=None) if not hasattr(a, "members")]
    else:
        arrays = [node]
    if require_chunks:
        for a in arrays:
            check_stored(location, a.path)
    try:
        return read_elem(node)
    except DECODE_ERRORS as e:
        for a in arrays:  # the error path only: which array it was
            try:
                a[...]
            except DECODE_ERRORS:
                raise _damaged(a, location, a.path, e) from None
        raise LayoutError(
            f"store {location}, element {node.path}: cannot be read ({damage_cause(e)}); {FIX}"
        ) from None


def _damaged(array: Any, location: str, path: str, e: Exception) -> LayoutError:
    """Return the one-line error of a read of ``array`` that failed on its stored bytes.

    Names the first chunk (along axis 0) that fails when read on its own.
    """
    chunk = ""
    if array.ndim and array.shape[0]:
        rows = int(array.chunks[0])
        for c in range(-(-int(array.shape[0]) // rows)):
            try:
                array[c * rows : (c + 1) * rows]
            except DECODE_ERRORS:
                chunk = f", chunk {c}"
                break
    return LayoutError(
        f"store {location}, array {path}{chunk}: cannot be read ({damage_cause(e)}); {FIX}"
    )
