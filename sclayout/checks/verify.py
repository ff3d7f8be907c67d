"""``sclayout verify``: prove that a layout store holds exactly its source.

Every element of DST is compared value for value with SRC under the stored
permutation (``source_index``): X and layers (and obsm matrices, raw/X) are streamed
by row ranges in bounded memory; obs/var (dtypes, categories, values with NaN equal
to NaN), obs_names/var_names, obsm/varm, obsp/varp (obsp permuted on both axes), uns
(recursively, without ``uns/sclayout``) and raw are compared whole. The manifest is
checked too: present, readable, and consistent with the arrays it describes.

Row-aligned matrices, bounded memory
------------------------------------
Two strategies, both reading contiguous ranges only, with windows of rows that fit
an eighth of the memory budget per side (:data:`WINDOW_SHARE`):

- *passes* (when SRC fits in at most :data:`MAX_PASSES` windows): read SRC by
  consecutive rows; for each pass, read the DST rows holding them
  (``inverse[lo:hi]``, sorted) in DST windows. One read of each side.
- *gathering* (otherwise, e.g. a shuffled store far larger than the budget): read
  DST once by windows and gather the matching SRC rows, sorted, each run of
  consecutive rows as one read. Linear in the data; a CSC source, which cannot be
  read by rows, always uses passes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from loader.argtypes import typechecked
from loader.backends import damage_cause
from loader.errors import LayoutError, NotALayoutStoreError, SclayoutError, SpecError
from loader.layout import MANIFEST_KEY, Manifest
from sclayout.checks._compare import (
    MAX_ROWS_SPELT_OUT,
    as_canonical_csr,
    compare_any,
    compare_frames,
    dtype_label,
    equal_mask,
    fmt,
    sparse_row_mismatch,
)
from sclayout.checks.place import Place, open_place
from sclayout.checks.verify_store import check_store, open_store_root
from sclayout.convert.checks import SourceInfo, explain_read_errors, inspect_source
from sclayout.convert.plan import parse_memory_budget

__all__ = ["VerifyReport", "codec_name", "verify"]

MAX_PASSES = 2
"""Above this many passes over SRC, verify gathers SRC rows for each DST window
instead (one read of DST; SRC rows read in sorted runs)."""
WINDOW_SHARE = 8
"""A window of rows of each side gets 1/8 of the memory budget: comparing holds a
window about four times (as read, the selected rows, the entry masks and aligned
copies), so 1/8 keeps the peak under the budget; tests/test_verify.py::
test_memory_stays_within_budget checks it with tracemalloc."""
MAX_DIFFERENCES = 100
"""Difference lines kept in a report; the rest are only counted."""


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes
    ----------
    equal
        True when every element and the manifest check out.
    differences
        One line per finding (at most :data:`MAX_DIFFERENCES`; ``n_differences``
        counts all).
    n_checked
        Elements compared (X, each layer, obs, each uns key, ...).
    n_values
        Matrix values (stored entries or dense cells) compared.
    skipped
        Elements not compared, with the reason (none in a store sclayout wrote).
    """

    equal: bool
    differences: list[str] = field(default_factory=list)
    n_checked: int = 0
    n_values: int = 0
    n_differences: int = 0
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Return the one-line summary of the comparison."""
        if self.equal:
            return (
                f"equal: {self.n_checked} elements and {self.n_values:,} matrix values "
                "match the source"
            )
        more = self.n_differences - len(self.differences)
        tail = f" ({more} more not shown)" if more > 0 else ""
        return f"NOT equal: {self.n_differences} differences{tail}"


class _Collector:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0
        self.n_checked = 0
        self.n_values = 0
        self.skipped: list[str] = []

    def add(self, lines: list[str]) -> None:
        self.count += len(lines)
        room = MAX_DIFFERENCES - len(self.lines)
        self.lines.extend(lines[: max(room, 0)])


# --------------------------------------------------------------------------- helpers


def codec_name(array: Any) -> str:
    """Return the sclayout codec name (``blosc-lz4``, ``zstd``, ...) of a zarr array.

    Its ``crc32c`` checksum, a format-2 store's last codec, is not part of the name.
    """
    compressors = tuple(getattr(array, "compressors", ()) or ())
    compressors = tuple(c for c in compressors if "crc32c" not in type(c).__name__.lower())
    if not compressors:
        return "none"
    c = compressors[0]
    kind = type(c).__name__.lower()
    if "blosc" in kind:
        cname = getattr(c, "cname", "?")
        cname = getattr(cname, "value", cname)
        shuffle = getattr(c, "shuffle", "")
        shuffle = str(getattr(shuffle, "value", shuffle)).lower()
        return f"blosc-{cname}" + ("-bitshuffle" if "bit" in shuffle else "")
    for name in ("zstd", "gzip", "zlib", "lz4"):
        if name in kind:
            return name
    return kind


def _encoding(node: Any) -> str:
    et = node.attrs.get("encoding-type")
    if et is None:
        return "array" if hasattr(node, "dtype") else "dict"
    return et.decode() if isinstance(et, bytes) else str(et)


class _Rows:
    """Row-range reads of a CSR/CSC group or a dense array (h5py or zarr)."""

    def __init__(self, node: Any) -> None:
        import anndata.io

        self.encoding = _encoding(node)
        self._node = node
        self._indptr: np.ndarray | None = None
        if self.encoding in ("csr_matrix", "csc_matrix"):
            self._ds = anndata.io.sparse_dataset(node)
            self.shape = tuple(int(s) for s in self._ds.shape)
            self.dtype = np.dtype(self._ds.dtype)
            nnz = int(node["data"].shape[0])
            idx = np.dtype(node["indices"].dtype).itemsize
            self.row_bytes = max(1, (nnz * (self.dtype.itemsize + idx)) // max(self.shape[0], 1))
        else:
            self._ds = node
            self.shape = tuple(int(s) for s in node.shape)
            self.dtype = np.dtype(node.dtype)
            cols = int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1
            self.row_bytes = max(1, cols * self.dtype.itemsize)

    @property
    def sparse(self) -> bool:
        return self.encoding in ("csr_matrix", "csc_matrix")

    def read(self, a: int, b: int) -> Any:
        if self.sparse:
            return sp.csr_matrix(self._ds[a:b])
        return np.asarray(self._ds[a:b])

    def gather(self, rows: np.ndarray) -> Any:
        """Rows ``rows`` (sorted, unique) of a CSR or dense matrix.

        Each run of consecutive rows is one contiguous read.
        """
        if len(rows) == 0:
            return self.read(0, 0)
        runs = np.flatnonzero(np.diff(rows) != 1) + 1
        starts = rows[np.r_[0, runs]]
        stops = rows[np.r_[runs - 1, len(rows) - 1]] + 1
        if not self.sparse:
            ranges = zip(starts, stops, strict=True)
            return np.concatenate([np.asarray(self._node[int(a) : int(b)]) for a, b in ranges])
        if self._indptr is None:
            self._indptr = np.asarray(self._node["indptr"][...], dtype=np.int64)
        ptr = self._indptr
        data, indices = self._node["data"], self._node["indices"]
        d_parts, i_parts = [], []
        for a, b in zip(starts, stops, strict=True):
            lo, hi = int(ptr[a]), int(ptr[b])
            d_parts.append(np.asarray(data[lo:hi]))
            i_parts.append(np.asarray(indices[lo:hi]))
        counts = ptr[rows + 1] - ptr[rows]
        out_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=out_ptr[1:])
        return sp.csr_matrix(
            (np.concatenate(d_parts), np.concatenate(i_parts), out_ptr),
            shape=(len(rows), self.shape[1]),
        )


DST_READ_ERRORS = (OSError, RuntimeError, ValueError, KeyError)
"""What a damaged chunk of DST raises through zarr (checksum, decompression, truncation)."""


def _unreadable(what: str, e: BaseException) -> LayoutError:
    """Return the error for a DST chunk that cannot be read: the comparison cannot run.

    That is exit 2, which is not the same as "differs" (exit 1).
    """
    detail = " ".join(damage_cause(e).split())[:200]  # not the raw checksum bytes
    return LayoutError(
        f"DST {what}: a chunk cannot be read ({type(e).__name__}: {detail}); the store is "
        "damaged: list the damage with `sclayout verify DST`, then restore it or reconvert it "
        "with `sclayout convert --overwrite`"
    )


@contextmanager
def _dst_reads(what: str) -> Iterator[None]:
    try:
        yield
    except SclayoutError:
        raise
    except DST_READ_ERRORS as e:
        raise _unreadable(what, e) from None


def _window(rows: _Rows, budget: int) -> int:
    return max(1, budget // WINDOW_SHARE // rows.row_bytes)


def _as_same_kind(d: Any, s: Any) -> tuple[Any, Any]:
    """Sparse vs sparse (sorted CSR) or dense vs dense."""
    if sp.issparse(d) and sp.issparse(s):
        return as_canonical_csr(d), as_canonical_csr(s)
    return (d.toarray() if sp.issparse(d) else d), (s.toarray() if sp.issparse(s) else s)


def _describe_row(d: Any, s: Any, r: int, names: np.ndarray | None) -> str:
    dr = np.asarray(d[r].toarray()).ravel() if sp.issparse(d) else np.asarray(d[r]).ravel()
    sr = np.asarray(s[r].toarray()).ravel() if sp.issparse(s) else np.asarray(s[r]).ravel()
    bad = np.flatnonzero(~equal_mask(dr, sr))
    if len(bad) == 0:
        nd = d[r].nnz if sp.issparse(d) else "?"
        ns = s[r].nnz if sp.issparse(s) else "?"
        return f"same values but different stored entries ({nd} in DST, {ns} in SRC)"
    g = int(bad[0])
    col = f"gene {fmt(names[g])}" if names is not None and g < len(names) else f"column {g}"
    return f"{len(bad)} values differ, first at {col}: DST {fmt(dr[g])} != SRC {fmt(sr[g])}"


def _row_mismatch(d: Any, s: Any) -> np.ndarray:
    if sp.issparse(d):
        return sparse_row_mismatch(d, s)
    eq = equal_mask(d, s).reshape(d.shape[0], -1)
    return np.flatnonzero(~eq.all(axis=1))


def _progress(total: int, desc: str, on: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", disable=not on, leave=False)


# ----------------------------------------------------------------- row-aligned matrices


def _compare_rowwise(
    name: str,
    dst_node: Any,
    src_node: Any,
    *,
    si: np.ndarray,
    inv: np.ndarray,
    names: np.ndarray | None,
    budget: int,
    src: Path,
    progress: bool,
    out: _Collector,
    dtypes: dict[str, str],
) -> None:
    """Compare a row-aligned matrix (DST row i == SRC row si[i]) in bounded memory.

    DST's dtype is the manifest's (``dtypes``) for a matrix it lists: stored values
    may be narrower (lossless), and are compared value for value.
    """
    d_rows, s_rows = _Rows(dst_node), _Rows(src_node)
    out.n_checked += 1
    if d_rows.shape != s_rows.shape:
        out.add([f"{name}: shape {d_rows.shape} in DST, {s_rows.shape} in SRC"])
        return
    d_dtype = dtypes.get(name, d_rows.dtype)
    if dtype_label(np.dtype(d_dtype)) != dtype_label(s_rows.dtype):
        out.add([f"{name}: dtype {d_dtype} in DST, {s_rows.dtype} in SRC"])
    n = d_rows.shape[0]
    n_passes = -(-n // _window(s_rows, budget)) if n else 0
    gather = n_passes > MAX_PASSES and s_rows.encoding != "csc_matrix"
    parts = (
        _gathering(d_rows, s_rows, si=si, budget=budget, src=src, name=name)
        if gather
        else _source_passes(d_rows, s_rows, si=si, inv=inv, budget=budget, src=src, name=name)
    )
    bad_found: list[str] = []
    n_bad = 0
    with _progress(n, f"verify {name}", progress) as bar, _dst_reads(name):
        for rows, d_sel, s_sel in parts:
            d_sel, s_sel = _as_same_kind(d_sel, s_sel)
            out.n_values += int(d_sel.nnz if sp.issparse(d_sel) else d_sel.size)
            bad = _row_mismatch(d_sel, s_sel)
            n_bad += len(bad)
            for r in bad[: max(0, MAX_ROWS_SPELT_OUT - len(bad_found))]:
                row = int(rows[r])
                bad_found.append(
                    f"{name} row {row} (source row {int(si[row])}): "
                    + _describe_row(d_sel, s_sel, int(r), names)
                )
            bar.update(len(rows))
    out.add(bad_found)
    if n_bad > len(bad_found):
        out.add([f"{name}: {n_bad - len(bad_found)} more rows differ"])


_Parts = Iterator[tuple[np.ndarray, Any, Any]]
"""(DST rows, those DST rows, the SRC rows they must equal) in bounded pieces."""


def _source_passes(d_rows, s_rows, *, si, inv, budget, src, name) -> _Parts:
    """Read SRC in passes of consecutive rows.

    For each pass, read the DST rows holding them in sorted windows. One read of each
    side when a pass holds everything.
    """
    n = d_rows.shape[0]
    pass_rows, win_rows = _window(s_rows, budget), _window(d_rows, budget)
    for lo in range(0, n, pass_rows):
        hi = min(lo + pass_rows, n)
        with explain_read_errors(src, what=name):
            s_part = s_rows.read(lo, hi)
        targets = np.sort(inv[lo:hi])
        for a, b in _windows(targets, win_rows, n):
            d_win = d_rows.read(a, b)
            lo_t, hi_t = np.searchsorted(targets, [a, b])
            rows = targets[lo_t:hi_t]
            yield rows, d_win[rows - a], s_part[si[rows] - lo]


def _gathering(d_rows, s_rows, *, si, budget, src, name) -> _Parts:
    """Read DST once in row windows and gather the matching SRC rows.

    SRC rows are sorted, runs of consecutive rows read as one range: linear, for stores
    many passes would need.
    """
    n = d_rows.shape[0]
    win_rows = min(_window(d_rows, budget), _window(s_rows, budget))
    for a in range(0, n, win_rows):
        b = min(a + win_rows, n)
        wanted = si[a:b]
        order = np.argsort(wanted, kind="stable")
        with explain_read_errors(src, what=name):
            got = s_rows.gather(wanted[order])
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        yield np.arange(a, b), d_rows.read(a, b), got[back]


def _windows(targets: np.ndarray, size: int, n: int) -> Iterator[tuple[int, int]]:
    """DST row windows ``[a, b)`` of at most ``size`` rows that cover sorted ``targets``."""
    i = 0
    while i < len(targets):
        a = int(targets[i])
        b = min(a + size, n)
        yield a, b
        i = int(np.searchsorted(targets, b))


# ------------------------------------------------------------------------- manifest


def _check_manifest(
    dst_root: Any, info: SourceInfo, out: _Collector
) -> tuple[Manifest, np.ndarray]:
    raw = dst_root.attrs.get(MANIFEST_KEY)
    if raw is None:
        raise NotALayoutStoreError(
            "DST has no sclayout manifest: it is not a complete layout store "
            "(an interrupted conversion?); reconvert with `sclayout convert --overwrite`"
        )
    manifest = Manifest.from_dict(raw)
    out.n_checked += 1
    if (manifest.n_obs, manifest.n_vars) != (info.n_obs, info.n_vars):
        out.add(
            [
                f"manifest: n_obs x n_vars = {manifest.n_obs} x {manifest.n_vars}, "
                f"SRC has {info.n_obs} x {info.n_vars}"
            ]
        )
    try:
        si = np.asarray(dst_root[manifest.source_index][...])
    except KeyError:
        raise NotALayoutStoreError(
            f"DST lacks {manifest.source_index}, named by its manifest: the store is incomplete; "
            "reconvert with `sclayout convert --overwrite`"
        ) from None
    n = manifest.n_obs
    if si.shape != (n,) or si.dtype.kind not in "iu":
        raise LayoutError(
            f"source_index has shape {si.shape} and dtype {si.dtype}, expected ({n},) integers: "
            "the store is damaged; reconvert with `sclayout convert --overwrite`"
        )
    si = si.astype(np.int64, copy=False)
    out_of_range = np.flatnonzero((si < 0) | (si >= n))
    if len(out_of_range):
        r = int(out_of_range[0])
        raise LayoutError(
            f"source_index is not a permutation: stored row {r} points at source row {si[r]} "
            f"of {n}; the store is damaged; reconvert with `sclayout convert --overwrite`"
        )
    counts = np.bincount(si, minlength=n)
    if (counts != 1).any():
        dup = int(np.flatnonzero(counts > 1)[0])
        rows = np.flatnonzero(si == dup)[:2].tolist()
        raise LayoutError(
            f"source_index is not a permutation: source row {dup} is stored {counts[dup]} times "
            f"(stored rows {rows}); the store is damaged; reconvert with "
            "`sclayout convert --overwrite`"
        )
    if manifest.order.kind == "original" and not np.array_equal(si, np.arange(n)):
        out.add(["manifest: order 'original' but source_index is not the identity"])
    for col in manifest.order.columns:
        if col not in info.obs_columns:
            out.add([f"manifest: order column {col!r} is not an obs column of SRC"])
    unlisted = sorted(set(_row_matrices(dst_root)) - set(manifest.matrices))
    if unlisted:
        out.add(
            [f"manifest: lists no layout for {', '.join(unlisted)} (the loader cannot read it)"]
        )
    for mname, m in manifest.matrices.items():
        if mname not in dst_root:
            out.add([f"manifest: matrix {mname} is not in DST"])
            continue
        n_cols = manifest.n_vars
        if mname == "raw/X" and "raw/var" in dst_root:  # raw keeps its own genes
            raw_var = dst_root["raw/var"]
            n_cols = raw_var[raw_var.attrs.get("_index", "_index")].shape[0]
        if m.shape != (n, n_cols):
            out.add([f"manifest: matrix {mname} shape {m.shape}, expected ({n}, {n_cols})"])
        for part, a in m.arrays.items():
            out.add(_check_array(mname, part, a, dst_root))
        if m.is_csr:
            out.add(_check_block_pointer(mname, m, manifest, dst_root))
        elif "values" in m.arrays and m.arrays["values"].chunks[0] % manifest.block_size:
            out.add(
                [
                    f"manifest: {mname} chunks {m.arrays['values'].chunks} do not hold whole "
                    f"blocks of {manifest.block_size} rows"
                ]
            )
    return manifest, si


def _row_matrices(root: Any) -> list[str]:
    """Paths of the row-aligned matrices of an AnnData store: X, layers/*, raw/X."""
    found = ["X"] if "X" in root else []
    found += [f"layers/{k}" for k in _children(root, "layers")]
    if "raw" in root and "X" in root["raw"]:
        found.append("raw/X")
    return found


def _check_array(mname: str, part: str, a: Any, dst_root: Any) -> list[str]:
    if a.path not in dst_root:
        return [f"manifest: {mname} array {a.path} is not in DST"]
    arr = dst_root[a.path]
    found = {
        "shape": tuple(arr.shape),
        "dtype": str(arr.dtype),
        "chunks": tuple(arr.chunks),
        "shards": None if getattr(arr, "shards", None) is None else tuple(arr.shards),
        "codec": codec_name(arr),
    }
    want = {"shape": a.shape, "dtype": a.dtype, "chunks": a.chunks, "shards": a.shards}
    want["codec"] = a.codec
    return [
        f"manifest: {a.path} {key} {want[key]} in the manifest, {found[key]} in the array"
        for key in want
        if found[key] != want[key] and not (key == "dtype" and np.dtype(a.dtype) == arr.dtype)
    ]


def _check_block_pointer(mname: str, m: Any, manifest: Manifest, dst_root: Any) -> list[str]:
    indptr = np.asarray(dst_root[m.arrays["indptr"].path][...], dtype=np.int64)
    out = []
    nnz_data = int(dst_root[m.arrays["data"].path].shape[0])
    if not (int(m.nnz) == int(indptr[-1]) == nnz_data):
        out.append(
            f"manifest: {mname} nnz {m.nnz}, indptr[-1] {int(indptr[-1])}, data length {nnz_data}"
        )
    if m.block_pointer not in dst_root:
        return [*out, f"manifest: {mname} block pointer {m.block_pointer} is not in DST"]
    bp = np.asarray(dst_root[m.block_pointer][...], dtype=np.int64)
    bounds = np.r_[np.arange(0, manifest.n_obs, manifest.block_size), manifest.n_obs]
    want = indptr[bounds]
    if bp.shape != want.shape:
        return [
            *out,
            f"manifest: {mname} block pointer has {bp.shape[0]} entries, expected "
            f"{want.shape[0]} (n_blocks + 1)",
        ]
    bad = np.flatnonzero(bp != want)
    if len(bad):
        b = int(bad[0])
        out.append(
            f"manifest: {mname} block pointer differs from indptr at {len(bad)} block boundaries, "
            f"first block {b}: {int(bp[b])} != indptr[{int(bounds[b])}] = {int(want[b])}"
        )
    return out


# ----------------------------------------------------------------------------- verify


def _children(root: Any, key: str) -> dict[str, Any]:
    if key not in root:
        return {}
    node = root[key]
    return {k: node[k] for k in node.keys()} if hasattr(node, "keys") else {}


def _key_diffs(name: str, dst: set, src: set) -> list[str]:
    out = []
    if src - dst:
        out.append(f"{name}: {sorted(src - dst)} missing from DST")
    if dst - src:
        out.append(f"{name}: {sorted(dst - src)} in DST but not in SRC")
    return out


@typechecked
def verify(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: bool = False,
    memory_budget: int | str = "2GB",
) -> VerifyReport:
    """Compare every element of the layout store DST with its source SRC.

    Parameters
    ----------
    src
        The ``.h5ad`` file or AnnData zarr store DST was converted from.
    dst
        The layout store: a folder, or an ``s3://``/``gs://`` URL read in place.
    progress
        Show a progress bar per streamed matrix.
    memory_budget
        Bytes (or ``"2GB"``) for the streamed comparison of row-aligned matrices.

    Returns
    -------
    VerifyReport
        ``equal`` is True only when nothing differs. A missing or unreadable manifest
        or a ``source_index`` that is not a permutation is reported as the only
        difference (nothing else can be compared without them).

    Raises
    ------
    InputError
        SRC cannot be read (see :func:`~sclayout.convert.checks.check_source`).
    NotALayoutStoreError
        DST is not a zarr store at all.
    """
    budget = parse_memory_budget(memory_budget)
    src_path, dst_path = Path(src), open_place(dst)  # a bucket's store is read in place
    info = inspect_source(src_path)
    dst_root = open_store_root(dst_path, hint="reconvert with `sclayout convert --overwrite`")
    out = _Collector()
    try:
        manifest, si = _check_manifest(dst_root, info, out)
    except (LayoutError, SpecError) as e:
        out.add([str(e)])
        return VerifyReport(equal=False, differences=out.lines, n_differences=out.count)

    structure = check_store(dst_path, quick=True)  # absent chunks read as zeros otherwise
    if not structure.sound:
        out.add(structure.findings)
        return VerifyReport(equal=False, differences=out.lines, n_differences=out.count)
    dtypes = {name: m.dtype for name, m in manifest.matrices.items()}
    return _verify_contents(
        src_path, dst_path, dst_root, info, si, out, budget, progress, dtypes=dtypes
    )


def _verify_contents(
    src_path: Path,
    dst_path: Place,
    dst_root: Any,
    info: SourceInfo,
    si: np.ndarray,
    out: _Collector,
    budget: int,
    progress: bool,
    *,
    dtypes: dict[str, str],
) -> VerifyReport:
    """Run the value-for-value comparison of :func:`verify` (the manifest checked).

    ``dtypes``: the manifest's dtype of each matrix (the source's, when its values
    are stored narrower).
    """
    import anndata.io
    import h5py
    import zarr

    inv = np.empty_like(si)
    inv[si] = np.arange(len(si), dtype=si.dtype)
    src_root = (
        h5py.File(src_path, "r")
        if info.kind == "hdf5"
        else zarr.open_group(str(src_path), mode="r")
    )

    def read(node: Any, what: str) -> Any:
        if getattr(node, "store", None) is dst_root.store:  # a DST element: DST's errors
            with _dst_reads(what):
                return anndata.io.read_elem(node)
        with explain_read_errors(src_path, what=what):
            return anndata.io.read_elem(node)

    try:
        src_obs = read(src_root["obs"], "obs")
        src_var = read(src_root["var"], "var")
        kw = {
            "si": si,
            "inv": inv,
            "budget": budget,
            "src": src_path,
            "progress": progress,
            "dtypes": dtypes,
        }
        pair = _Pair(src_root, dst_root, read, si, out, kw)
        out.n_checked += 2
        out.add(compare_frames("obs", read(dst_root["obs"], "obs"), src_obs.iloc[si], si=si))
        out.add(compare_frames("var", read(dst_root["var"], "var"), src_var))
        _compare_x_and_layers(pair, np.asarray(src_var.index, dtype=object))
        _compare_obsm(pair)
        _compare_obsp(pair)
        _compare_whole(pair)
        _compare_raw(src_root, dst_root, read=read, out=out, kw=kw)
        top_s = set(src_root.keys()) - {"X", "obs", "var"}
        top_d = set(dst_root.keys()) - {"X", "obs", "var"}
        empty = {
            k for k in top_s ^ top_d if not _children(src_root, k) and not _children(dst_root, k)
        }
        out.add(_key_diffs("root", top_d - empty, top_s - empty))
    except SclayoutError:
        raise
    except DST_READ_ERRORS as e:  # SRC reads are InputErrors by now: this is DST
        raise _unreadable(dst_path.shown, e) from None
    finally:
        if info.kind == "hdf5":
            src_root.close()
    return VerifyReport(
        equal=out.count == 0,
        differences=out.lines,
        n_checked=out.n_checked,
        n_values=out.n_values,
        n_differences=out.count,
        skipped=out.skipped,
    )


@dataclass
class _Pair:
    """SRC and DST opened side by side, for the steps of :func:`_verify_contents`.

    ``read(node, what)`` reads an element, blaming SRC or DST for a failure; ``kw`` are
    the keywords of :func:`_compare_rowwise` (permutation, budget, dtypes...).
    """

    src_root: Any
    dst_root: Any
    read: Callable[[Any, str], Any]
    si: np.ndarray
    out: _Collector
    kw: dict[str, Any]

    def children(self, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Return the elements under ``key`` in SRC and in DST, noting keys only one has."""
        s_el, d_el = _children(self.src_root, key), _children(self.dst_root, key)
        self.out.add(_key_diffs(key, set(d_el), set(s_el)))
        return s_el, d_el


def _compare_x_and_layers(pair: _Pair, var_names: np.ndarray) -> None:
    """Stream X and every layer, row range by row range."""
    out, kw = pair.out, pair.kw
    _compare_rowwise("X", pair.dst_root["X"], pair.src_root["X"], names=var_names, out=out, **kw)
    s_layers, d_layers = pair.children("layers")
    for k in sorted(set(s_layers) & set(d_layers)):
        _compare_rowwise(f"layers/{k}", d_layers[k], s_layers[k], names=var_names, out=out, **kw)


def _compare_obsm(pair: _Pair) -> None:
    """Compare obsm: matrices streamed like X, data frames whole, under the permutation."""
    out, read, si = pair.out, pair.read, pair.si
    s_obsm, d_obsm = pair.children("obsm")
    for k in sorted(set(s_obsm) & set(d_obsm)):
        enc = _encoding(s_obsm[k])
        if enc in ("csr_matrix", "csc_matrix", "array"):
            _compare_rowwise(f"obsm/{k}", d_obsm[k], s_obsm[k], names=None, out=out, **pair.kw)
        elif enc == "dataframe":
            out.n_checked += 1
            s_df = read(s_obsm[k], f"obsm/{k}")
            out.add(compare_frames(f"obsm/{k}", read(d_obsm[k], k), s_df.iloc[si], si=si))
        else:
            out.skipped.append(f"obsm/{k}: encoding {enc!r} is not compared")


def _compare_obsp(pair: _Pair) -> None:
    """Compare obsp whole, the source permuted on both axes."""
    out, read, si = pair.out, pair.read, pair.si
    s_obsp, d_obsp = pair.children("obsp")
    for k in sorted(set(s_obsp) & set(d_obsp)):
        out.n_checked += 1
        s_val = read(s_obsp[k], f"obsp/{k}")
        s_perm = sp.csr_matrix(s_val)[si][:, si] if sp.issparse(s_val) else s_val[si][:, si]
        if sp.issparse(s_val):
            s_perm = type(s_val)(s_perm)
        out.add(compare_any(f"obsp/{k}", read(pair.dst_root["obsp"][k], k), s_perm))


def _compare_whole(pair: _Pair) -> None:
    """Compare the elements not aligned to rows (varm, varp, uns) whole.

    uns/sclayout is the store's own bookkeeping; a layout store used as SRC has one
    too, which the converter rebuilds rather than copies.
    """
    out, read = pair.out, pair.read
    for key in ("varm", "varp"):
        s_el, d_el = pair.children(key)
        for k in sorted(set(s_el) & set(d_el)):
            out.n_checked += 1
            out.add(compare_any(f"{key}/{k}", read(d_el[k], k), read(s_el[k], f"{key}/{k}")))
    s_uns = {k: v for k, v in _children(pair.src_root, "uns").items() if k != "sclayout"}
    d_uns = {k: v for k, v in _children(pair.dst_root, "uns").items() if k != "sclayout"}
    out.add(_key_diffs("uns", set(d_uns), set(s_uns)))
    for k in sorted(set(s_uns) & set(d_uns)):
        out.n_checked += 1
        out.add(compare_any(f"uns/{k}", read(d_uns[k], k), read(s_uns[k], f"uns/{k}")))


def _compare_raw(src_root: Any, dst_root: Any, *, read: Any, out: _Collector, kw: dict) -> None:
    # anndata writes a missing raw to zarr format 2 as a "null" element: no raw either
    has_s, has_d = (
        "raw" in r and r["raw"].attrs.get("encoding-type") != "null" for r in (src_root, dst_root)
    )
    if has_s != has_d:
        out.add([f"raw: {'missing from DST' if has_s else 'in DST but not in SRC'}"])
        return
    if not has_s:
        return
    s_raw, d_raw = src_root["raw"], dst_root["raw"]
    raw_var = read(s_raw["var"], "raw/var") if "var" in s_raw else None
    out.n_checked += 1
    if raw_var is not None and "var" in d_raw:
        out.add(compare_frames("raw/var", read(d_raw["var"], "raw/var"), raw_var))
    names = None if raw_var is None else np.asarray(raw_var.index, dtype=object)
    if "X" in s_raw and "X" in d_raw:
        _compare_rowwise("raw/X", d_raw["X"], s_raw["X"], names=names, out=out, **kw)
    s_varm, d_varm = _children(s_raw, "varm"), _children(d_raw, "varm")
    out.add(_key_diffs("raw/varm", set(d_varm), set(s_varm)))
    for k in sorted(set(s_varm) & set(d_varm)):
        out.n_checked += 1
        out.add(compare_any(f"raw/varm/{k}", read(d_varm[k], k), read(s_varm[k], k)))
    out.add(_key_diffs("raw", set(d_raw.keys()), set(s_raw.keys())))
