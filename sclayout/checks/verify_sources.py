"""``sclayout verify SRC [SRC ...] DST`` for stores built from several sources.

Every source's rows are found in DST through the provenance (``source_index`` and the
sources' first rows in the manifest), mapped to DST's genes by name (a gene the source
lacks must hold no entry in DST; a gene DST lacks is not compared) and compared value
for value, X and every layer, window by window within the memory budget. obs is
compared column by column for the columns the source has, plus the source column and
obs_names. The per-row ``source_number``/``source_row`` arrays must agree with
``source_index``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# anndata (and dask with it) is imported where it is used: `sclayout inspect` and
# `verify` of a store alone start faster without it
import numpy as np
import scipy.sparse as sp
import zarr

from loader.layout import MANIFEST_KEY, Manifest
from sclayout.checks._compare import as_canonical_csr, compare_frames, sparse_row_mismatch
from sclayout.checks.verify import VerifyReport
from sclayout.checks.verify_store import open_store_root
from sclayout.convert.parts import Part
from sclayout.convert.plan import parse_memory_budget
from sclayout.convert.source import Source, close_handles, open_group, source_tables
from sclayout.convert.sources import check_sources, source_names

__all__ = ["needs_sources_verify", "verify_sources"]

MAX_LINES = 100
"""Difference lines kept in a report; the rest are only counted."""
WINDOW_SHARE = 8
"""A window of source rows (and the DST rows holding them) gets 1/8 of the budget."""


class _DstRows:
    """Rows of one DST matrix (CSR or dense) read in runs of consecutive rows."""

    def __init__(self, node: Any, *, span: int) -> None:
        self.node = node
        self.span = span
        """Most elements read at once to cover several runs of rows."""
        self.sparse = isinstance(node, zarr.Group)
        if self.sparse:
            self.ptr = np.asarray(node["indptr"][...], dtype=np.int64)
            self.shape = tuple(int(s) for s in node.attrs["shape"])

    def rows(self, rows: np.ndarray) -> Any:
        """``rows`` (sorted, unique) as CSR or a dense array."""
        runs = np.flatnonzero(np.diff(rows) != 1) + 1
        starts = rows[np.r_[0, runs]] if rows.size else rows
        stops = rows[np.r_[runs - 1, rows.size - 1]] + 1 if rows.size else rows
        if not self.sparse:
            parts = [
                np.asarray(self.node[int(a) : int(b)]) for a, b in zip(starts, stops, strict=True)
            ]
            return np.concatenate(parts) if parts else np.asarray(self.node[0:0])
        data, idx = [], []
        lo_el, hi_el = self.ptr[starts], self.ptr[stops]
        i = 0
        while i < starts.size:  # runs closer than the span limit: one read, then cut
            j = i + 1
            while j < starts.size and hi_el[j] - lo_el[i] <= self.span:
                j += 1
            lo, hi = int(lo_el[i]), int(hi_el[j - 1])
            d = np.asarray(self.node["data"][lo:hi])
            x = np.asarray(self.node["indices"][lo:hi])
            for a, b in zip(lo_el[i:j] - lo, hi_el[i:j] - lo, strict=True):
                data.append(d[a:b])
                idx.append(x[a:b])
            i = j
        counts = self.ptr[rows + 1] - self.ptr[rows]
        ptr = np.r_[0, np.cumsum(counts)].astype(np.int64)
        return sp.csr_matrix(
            (np.concatenate(data) if data else [], np.concatenate(idx) if idx else [], ptr),
            shape=(rows.size, self.shape[1]),
        )


def _source_window(part: Part, ptr: np.ndarray | None, r0: int, r1: int) -> sp.csr_matrix:
    """Source rows ``[r0, r1)`` with DST's columns and dtype, as CSR."""
    import anndata as ad

    if part.encoding == "csc":
        with open_group(part.src) as root:
            m = ad.io.sparse_dataset(root[part.path])[r0:r1]
        m = sp.csr_matrix(m)
        rows = np.repeat(np.arange(m.shape[0]), np.diff(m.indptr))
        cols = part.colmap[m.indices] if part.colmap is not None else m.indices
        keep = cols >= 0
        return sp.csr_matrix(
            (m.data[keep].astype(part.dtype), (rows[keep], cols[keep])),
            shape=(r1 - r0, part.n_vars),
        )
    p, data, idx = part.read_rows(r0, r1, ptr)
    return sp.csr_matrix((data, idx, p), shape=(r1 - r0, part.n_vars))


def _compare_matrix(
    name: str, part: Part, dst: _DstRows, inv: np.ndarray, budget: int, src_name: str
) -> tuple[list[str], int]:
    ptr = None
    if part.encoding in ("csr", "csc"):
        with open_group(part.src) as root:
            ptr = np.asarray(root[f"{part.path}/indptr"][...], dtype=np.int64)
    n = part.shape[0]
    row_bytes = max(1, part.n_vars * part.dtype.itemsize)
    if ptr is not None and part.encoding == "csr":
        row_bytes = max(1, int(ptr[-1] - ptr[0]) * (part.dtype.itemsize + 8) // max(n, 1))
    step = max(1, budget // WINDOW_SHARE // row_bytes)
    lines, values = [], 0
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        want = _source_window(part, ptr, r0, r1)
        stored = inv[part.row0 + r0 : part.row0 + r1]
        order = np.argsort(stored)
        got = dst.rows(stored[order])
        back = np.empty_like(order)
        back[order] = np.arange(order.size)
        got = got[back]
        got = as_canonical_csr(got) if sp.issparse(got) else sp.csr_matrix(got)
        want = as_canonical_csr(want)
        if not dst.sparse:  # dense store: equal non-zeros at equal places mean equal rows
            want.eliminate_zeros()
            got.eliminate_zeros()
        values += int(want.nnz)
        bad = sparse_row_mismatch(got, want)
        for r in bad[:3]:
            lines.append(f"{name}: {src_name} row {r0 + int(r)} differs in DST row {stored[r]}")
        if bad.size > 3:
            lines.append(f"{name}: {src_name}: {bad.size - 3} more rows differ in rows {r0}-{r1}")
    return lines, values


def needs_sources_verify(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> bool:
    """Whether a one-source store needs this check rather than the whole-file one.

    It does for a legacy source, or genes mapped (``--var-names``).
    """
    info = check_sources([src])[0]
    if info.legacy:
        return True
    root = open_store_root(dst, hint="reconvert with `sclayout convert --overwrite`")
    genes = Manifest.from_dict(root.attrs.get(MANIFEST_KEY)).genes
    return genes.get("join", "same") != "same"


@dataclass
class _Dst:
    """What every source's comparison needs of DST: its root, manifest and row maps."""

    root: Any
    manifest: Manifest
    inv: np.ndarray
    """DST row of each row of the concatenated sources."""
    row0: np.ndarray
    """First row of each source in the concatenation."""
    obs: Any
    var: Any
    budget: int


def verify_sources(
    srcs: list[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    progress: bool = False,
    memory_budget: int | str = "2GB",
) -> VerifyReport:
    """Compare a store built from several sources with each of them (module docstring)."""
    import anndata as ad

    budget = parse_memory_budget(memory_budget)
    infos = check_sources(srcs)
    root = open_store_root(dst, hint="reconvert with `sclayout convert --overwrite`")
    manifest = Manifest.from_dict(root.attrs.get(MANIFEST_KEY))
    if len(manifest.sources) != len(srcs):
        line = (
            f"manifest: DST was built from {len(manifest.sources) or 1} sources, "
            f"{len(srcs)} given: pass the sources it was converted from, in order"
        )
        return VerifyReport(equal=False, differences=[line], n_differences=1)
    si = np.asarray(root[manifest.source_index][...], dtype=np.int64)
    inv = np.empty_like(si)
    inv[si] = np.arange(si.size)
    row0 = np.array([int(e["row0"]) for e in manifest.sources], dtype=np.int64)
    lines = _provenance_lines(root, manifest, si, row0)
    with ad.settings.override(remove_unused_categories=False):
        d_obs = ad.io.read_elem(root["obs"])
    store = _Dst(root, manifest, inv, row0, d_obs, ad.io.read_elem(root["var"]), budget)
    names = source_names(srcs)
    values, checked = 0, 0
    try:
        for k, (s, info) in enumerate(zip(srcs, infos, strict=True)):
            entry = manifest.sources[k]
            if int(entry["n_obs"]) != info.n_obs:
                lines.append(f"{names[k]}: has {info.n_obs} rows, DST recorded {entry['n_obs']}")
                continue
            found, n_values, n_checked = _compare_source(store, k, s, info.n_obs, names[k])
            lines += found
            values += n_values
            checked += n_checked
    finally:
        close_handles()
    return VerifyReport(
        equal=not lines,
        differences=lines[:MAX_LINES],
        n_checked=checked,
        n_values=values,
        n_differences=len(lines),
    )


def _provenance_lines(root: Any, manifest: Manifest, si: np.ndarray, row0: np.ndarray) -> list[str]:
    """Return a finding if the per-row source arrays disagree with ``source_index``."""
    if not manifest.provenance:
        return []
    number = np.asarray(root[manifest.provenance["source_number"]][...], dtype=np.int64)
    row = np.asarray(root[manifest.provenance["source_row"]][...], dtype=np.int64)
    expect = np.searchsorted(row0, si, side="right") - 1
    if np.array_equal(number, expect) and np.array_equal(row, si - row0[expect]):
        return []
    return ["provenance: source_number/source_row disagree with source_index"]


def _compare_source(
    store: _Dst, k: int, s: str | os.PathLike[str], n_obs: int, name: str
) -> tuple[list[str], int, int]:
    """Compare source number ``k`` with its rows in DST: its genes, obs and matrices.

    Returns the findings, the values compared and the elements checked.
    """
    manifest, entry = store.manifest, store.manifest.sources[k]
    with open_group(s) as sroot:
        tables = source_tables(sroot, s)
        src = Source(sroot, s)
        keys = {m: m for m in manifest.matrices if m == "X" or m in sroot}
        if "raw/X" in manifest.matrices and tables["raw_x"] is not None:
            keys["raw/X"] = tables["raw_x"]  # legacy files: raw.X
        mats = {m: src.matrix_info(key) for m, key in keys.items()}
    lines: list[str] = []
    colmap = store.var.index.get_indexer(tables["var"].index).astype(np.int64)
    present = int((colmap >= 0).sum())
    if present != int(entry.get("genes_present", present)):
        lines.append(f"{name}: {present} of DST's genes, manifest says {entry['genes_present']}")
    stored = store.inv[store.row0[k] : store.row0[k] + n_obs]
    key = manifest.provenance.get("obs_key") or None
    lines += _compare_source_obs(store.obs.iloc[stored], tables["obs"], name, key)
    values, checked = 0, 1
    for m, sinfo in mats.items():
        dinfo = manifest.matrices[m]
        part = Part(
            str(Path(s).resolve()),
            sinfo,
            int(store.row0[k]),
            dinfo.shape[1],
            np.dtype(dinfo.dtype),
            np.dtype(np.int64),
            None if m == "raw/X" else colmap,  # raw keeps its own genes
            True,
        )
        dst_rows = _DstRows(store.root[m], span=store.budget // (WINDOW_SHARE * 12))
        got_lines, n = _compare_matrix(m, part, dst_rows, store.inv, store.budget, name)
        lines += got_lines
        values += n
        checked += 1
    return lines, values, checked


def _compare_source_obs(sub: Any, s_obs: Any, name: str, key: str | None) -> list[str]:
    """Compare a source's obs with its rows of DST's obs (``sub``): values, names, label."""
    cols = [c for c in s_obs.columns if c in sub.columns]
    got = sub[cols].copy()
    want = s_obs[cols].copy()
    for c in cols:  # categories are unified across sources: compare values
        got[c] = got[c].astype(object)
        want[c] = want[c].astype(object)
    got.index = want.index
    lines = compare_frames(f"obs ({name})", got, want)
    dn = np.asarray(sub.index, dtype=object)
    sn = np.asarray(s_obs.index.astype(str), dtype=object)
    if not (np.array_equal(dn, sn) or np.array_equal(dn, sn + f"-{name}")):
        lines.append(f"obs_names ({name}): DST names are not the source's")
    if key is not None and not (sub[key].astype(str) == name).all():
        lines.append(f"obs {key!r}: rows of {name} are not labelled {name!r}")
    return lines
