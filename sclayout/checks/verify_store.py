"""``sclayout verify DST``: check a layout store from its own bytes, without a source.

What is checked (``docs/store-format.md`` lists the invariants):

- *structure* (also with ``quick``): the manifest parses; every array it names
  exists with the shape, dtype, chunks and shards it states; every shard file is
  there, its index is whole and passes its crc32c, and its entries point inside the
  file; in a version-2 store every chunk of every array exists;
- *contents* (not with ``quick``): every array of the store is read once, in slices
  along its first axis, so every chunk's crc32c is verified and every chunk is
  decoded; CSR ``indptr`` starts at 0, never decreases and ends at ``nnz``; column
  ids lie in ``[0, n_vars)``; the block pointer equals ``indptr`` at every block
  boundary; ``source_index`` is a permutation of the rows.

Findings are one line each (at most :data:`MAX_FINDINGS` kept). A store written
before checksums (format version 1) is checked too, without chunk checksums: the
report says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loader.backends import damage_cause
from loader.errors import NotALayoutStoreError, SclayoutError
from loader.layout import MANIFEST_KEY, Manifest
from sclayout.checks.place import LocalPlace, Place, open_place

__all__ = ["MAX_FINDINGS", "StoreReport", "check_store"]

MAX_FINDINGS = 50
"""Finding lines kept in a report; the rest are only counted."""
SLICE_BYTES = 64 * 2**20
"""Decoded bytes read per slice of an array (whole shards, at least one): large
sequential reads (disk speed, one request per shard from a bucket), bounded memory."""


@dataclass
class StoreReport:
    """The outcome of :func:`check_store`.

    Attributes
    ----------
    findings
        One line per problem (at most :data:`MAX_FINDINGS`; ``n_findings`` counts all).
    notes
        What was not checked and why (a version-1 store has no chunk checksums).
    n_arrays, n_bytes
        Arrays checked and decoded bytes read.
    """

    findings: list[str] = field(default_factory=list)
    n_findings: int = 0
    notes: list[str] = field(default_factory=list)
    n_arrays: int = 0
    n_bytes: int = 0
    quick: bool = False

    @property
    def sound(self) -> bool:
        """Whether the check found nothing wrong."""
        return self.n_findings == 0

    def add(self, line: str) -> None:
        """Record a finding; only the first :data:`MAX_FINDINGS` are kept in full."""
        self.n_findings += 1
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(line)

    def summary(self) -> str:
        """Return the one-line summary of the check."""
        what = "structure and shard indexes" if self.quick else "every byte"
        if self.sound:
            return f"sound: {self.n_arrays} arrays checked ({what})"
        more = self.n_findings - len(self.findings)
        tail = f" ({more} more not shown)" if more > 0 else ""
        return f"DAMAGED: {self.n_findings} findings{tail}"


def open_store_root(dst: str | os.PathLike[str] | Place, *, hint: str) -> Any:
    """Open the zarr group at ``dst`` (a folder or a bucket URL) read-only.

    Raises :class:`NotALayoutStoreError` when there is none; ``hint`` ends the message
    when ``dst`` is there but zarr cannot open it.
    """
    place = open_place(dst)
    if isinstance(place, LocalPlace) and not place.location.is_dir():
        raise NotALayoutStoreError(
            f"DST {place.shown} is not a zarr store directory: convert one with "
            "`sclayout convert SRC DST`"
        )
    try:
        return place.open_group()
    except SclayoutError:
        raise
    except Exception as e:
        raise NotALayoutStoreError(
            f"DST {place.shown} cannot be opened as a zarr store ({type(e).__name__}): {hint}"
        ) from None


def _open_manifest(place: Place) -> Manifest:
    root = open_store_root(place, hint="convert one with `sclayout convert SRC DST`")
    return Manifest.from_dict(root.attrs.get(MANIFEST_KEY))


def _check_structure(
    place: Place, manifest: Manifest, report: StoreReport, progress: bool = False
) -> list[str]:
    """Check the arrays named by the manifest; return the array paths to read.

    Present, as described, shards whole (every shard index read once: a bar counts
    the arrays when ``progress``).
    """
    from tqdm.auto import tqdm

    named: list[tuple[str, Any]] = []
    for m in manifest.matrices.values():
        named += [(a.path, a) for a in m.arrays.values()]
        if m.block_pointer is not None:
            named.append((m.block_pointer, None))
    named.append((manifest.source_index, None))
    for path, layout in named:
        try:
            arr = place.open_array(path)
        except (FileNotFoundError, KeyError, ValueError, OSError):
            report.add(f"array {path}: named by the manifest but missing or unreadable")
            continue
        if layout is not None:
            found = (tuple(arr.shape), tuple(arr.chunks))
            want = (layout.shape, layout.chunks)
            if found != want or np.dtype(arr.dtype) != np.dtype(layout.dtype):
                report.add(
                    f"array {path}: shape/chunks/dtype {found[0]}/{found[1]}/{arr.dtype} on "
                    f"disk, {want[0]}/{want[1]}/{layout.dtype} in the manifest"
                )
    paths = place.array_paths()
    for path in tqdm(paths, desc="shard indexes", unit="array", disable=not progress):
        for line in place.shard_findings(path, manifest.all_chunks_stored):
            report.add(line)
    return paths


_READ_ERRORS = (ValueError, RuntimeError, TypeError, OSError)


def _read_slices(
    arr: Any, path: str, report: StoreReport, tick: Callable[[int], None], where: str
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(start, values)`` slices of ``arr`` along axis 0.

    A slice that cannot be read (crc32c mismatch, undecodable chunk) is a finding
    naming the chunk and the object (file or bucket object) under ``where`` holding it.
    """
    n = int(arr.shape[0]) if arr.shape else 1
    row = int(np.prod(arr.shape[1:], dtype=np.int64)) * np.dtype(arr.dtype).itemsize or 1
    chunk = int(arr.chunks[0]) if arr.chunks else 1
    # whole shards: zarr reads a shard read whole in one request, a part of one by one
    # request per inner chunk (one after the other: slow from a bucket)
    shards = getattr(arr, "shards", None)
    unit = int(shards[0]) if shards else chunk
    step = max(unit, SLICE_BYTES // max(row, 1) // unit * unit)
    if not arr.shape:
        yield 0, np.asarray(arr[...])
        return
    for a in range(0, n, step):
        b = min(n, a + step)
        try:
            values = np.asarray(arr[a:b])
        except _READ_ERRORS:
            for c in range(a // chunk, (b - 1) // chunk + 1):  # name the chunk(s)
                try:
                    arr[c * chunk : min((c + 1) * chunk, n)]
                except _READ_ERRORS as e:
                    cell = (c * chunk // unit,) + (0,) * (len(arr.shape) - 1)
                    key = f"{where}/{path}/{arr.metadata.encode_chunk_key(cell)}"
                    report.add(
                        f"array {path}: chunk {c} cannot be read ({damage_cause(e)}; in {key})"
                    )
            continue
        tick(values.nbytes)
        report.n_bytes += values.nbytes
        yield a, values


def _check_csr(
    place: Place,
    mname: str,
    m: Any,
    manifest: Manifest,
    report: StoreReport,
    tick: Callable[[int], None],
) -> None:
    root = place.open_group()
    try:
        indptr = np.asarray(root[m.arrays["indptr"].path][...], dtype=np.int64)
    except (KeyError, ValueError, RuntimeError, TypeError):
        return  # already a finding of the structure or slice pass
    path = m.arrays["indptr"].path
    if indptr.shape != (manifest.n_obs + 1,):
        report.add(f"array {path}: {indptr.shape[0]} values, expected n_obs + 1")
        return
    steps = np.diff(indptr)
    if indptr[0] != 0 or (steps.size and int(steps.min()) < 0) or int(indptr[-1]) != m.nnz:
        where = np.flatnonzero(steps < 0)
        at = f", first decrease at row {int(where[0])}" if where.size else ""
        report.add(
            f"array {path}: not a valid row pointer (starts at {int(indptr[0])}, ends at "
            f"{int(indptr[-1])} for nnz {m.nnz}{at})"
        )
    try:
        ind = root[m.arrays["indices"].path]
    except KeyError:
        return
    for a, values in _read_slices(ind, m.arrays["indices"].path, report, tick, place.root):
        if values.size and (int(values.min()) < 0 or int(values.max()) >= manifest.n_vars):
            bad = np.flatnonzero((values < 0) | (values >= manifest.n_vars))
            report.add(
                f"array {m.arrays['indices'].path}: column index {int(values[bad[0]])} at "
                f"element {a + int(bad[0])} outside [0, {manifest.n_vars})"
            )
    if m.block_pointer is None or m.block_pointer not in root:
        return
    try:
        bp = np.asarray(root[m.block_pointer][...], dtype=np.int64)
    except (ValueError, RuntimeError, TypeError):
        return
    bounds = np.r_[np.arange(0, manifest.n_obs, manifest.block_size), manifest.n_obs]
    if bp.shape != bounds.shape or not np.array_equal(bp, indptr[bounds]):
        report.add(f"array {m.block_pointer}: block pointer differs from {path} at block bounds")


def _check_source_index(place: Place, manifest: Manifest, report: StoreReport) -> None:
    path = manifest.source_index
    try:
        si = np.asarray(place.open_array(path)[...])
    except (FileNotFoundError, KeyError, ValueError, RuntimeError, TypeError):
        return
    n = manifest.n_obs
    if si.shape != (n,) or si.dtype.kind not in "iu":
        report.add(f"array {path}: shape {si.shape}, dtype {si.dtype}; expected ({n},) integers")
        return
    si = si.astype(np.int64, copy=False)
    bad = np.flatnonzero((si < 0) | (si >= n))
    if bad.size:
        report.add(f"array {path}: stored row {int(bad[0])} names source row {int(si[bad[0]])}")
        return
    counts = np.bincount(si, minlength=n)
    if n and int(counts.max()) > 1:
        report.add(
            f"array {path}: not a permutation (source row {int(np.argmax(counts))} appears "
            f"{int(counts.max())} times)"
        )


def check_store(
    dst: str | os.PathLike[str] | Place, *, quick: bool = False, progress: bool = False
) -> StoreReport:
    """Check the layout store ``dst`` from its own bytes (see the module docstring).

    Parameters
    ----------
    dst
        The layout store: a local directory, or an ``s3://``/``gs://`` URL read in
        place (:mod:`sclayout.checks.place`).
    quick
        Check the structure and shard indexes only (no chunk is decoded).
    progress
        Show a progress bar over the bytes read.

    Raises
    ------
    NotALayoutStoreError
        ``dst`` is not a layout store (nothing to check: exit 2 on the CLI).
    """
    place = open_place(dst)
    manifest = _open_manifest(place)
    report = StoreReport(quick=quick)
    if manifest.chunk_checksum is None:
        report.notes.append(
            f"format version {manifest.version}: chunks carry no checksums, so bit flips "
            "inside a chunk are found only by `sclayout verify SRC DST`; reconvert to add them"
        )
    paths = _check_structure(place, manifest, report, progress)
    report.n_arrays = len(paths)
    if quick:
        return report
    from tqdm.auto import tqdm

    total = 0
    for path in paths:
        try:
            arr = place.open_array(path)
            total += int(np.prod(arr.shape, dtype=np.int64)) * np.dtype(arr.dtype).itemsize
        except (ValueError, TypeError, KeyError, OSError, SclayoutError):
            continue
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress)
    try:
        indices = {m.arrays["indices"].path for m in manifest.matrices.values() if m.is_csr}
        for path in paths:
            if path in indices:
                continue  # read (and bounds-checked) by _check_csr
            try:
                arr = place.open_array(path)
            except (ValueError, TypeError, KeyError, OSError) as e:
                report.add(f"array {path}: cannot be opened ({type(e).__name__})")
                continue
            for _ in _read_slices(arr, path, report, bar.update, place.root):
                pass
        for mname, m in manifest.matrices.items():
            if m.is_csr:
                _check_csr(place, mname, m, manifest, report, bar.update)
        _check_source_index(place, manifest, report)
    finally:
        bar.close()
    return report
