"""What a conversion writes, from one source or several: the :class:`Input`.

:func:`single_input` describes one modern source as it is (every element kept);
:func:`sources_input` merges several (or a legacy one, or one with a gene panel)
under the rules of :mod:`sclayout.convert.sources`, with one
:class:`~sclayout.convert.parts.Part` per source for every output matrix. Both give
the small elements a writer that puts their rows in the stored order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# anndata (and dask with it) is imported where it is used: `sclayout inspect` and
# `verify` of a store alone start faster without it
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from loader.errors import InputError
from sclayout.convert.checks import SourceInfo
from sclayout.convert.obs import FrameObs, StreamedObs
from sclayout.convert.parts import Part
from sclayout.convert.source import MatrixInfo, Source, fingerprint, io_map, open_group
from sclayout.convert.sources import Combined, combine, source_names
from sclayout.convert.write import index_dtype_for

__all__ = ["Input", "check_by", "quiet_write", "single_input", "sources_input"]


@dataclass(frozen=True)
class Input:
    """What a conversion writes, from one source or several.

    ``matrices``: each output matrix (its path, shape, dtype) with one part per
    source; ``write_small(root, perm, dataset_kwargs)`` writes the small elements but
    obs with rows in stored order; ``obs`` reads and writes obs a column at a time;
    ``row0``: the first row of every source in the concatenation, and the total
    (several sources only).
    """

    n_obs: int
    n_vars: int
    obs: StreamedObs | FrameObs
    write_small: Callable[[zarr.Group, np.ndarray, dict[str, Any]], None]
    matrices: list[tuple[MatrixInfo, list[Part]]]
    sources: list[dict[str, Any]]
    genes: dict[str, Any]
    notes: list[str]
    row0: np.ndarray | None = None
    source_key: str = ""
    """The obs column naming each row's source ("" when there is none)."""


def single_input(source: Source) -> Input:
    """One modern source as it is: every element kept, every matrix one plain part."""
    obs = StreamedObs([source.path], [source.n_obs], source_names([source.path]))
    matrices = []
    for info in source.row_matrices():
        idt = info.index_dtype if info.index_dtype is not None else index_dtype_for(info.shape[1])
        part = Part(source.path, info, 0, info.shape[1], info.dtype, idt)
        matrices.append((info, [part]))
    x = matrices[0][0]
    nnz = x.nnz if x.encoding != "dense" else x.shape[0] * x.shape[1]
    entry = {
        "name": source_names([source.path])[0],
        "row0": 0,
        "n_obs": source.n_obs,
        "n_vars": source.n_vars,
        "genes_present": source.n_vars,
        "fingerprint": fingerprint(source.path, n_obs=source.n_obs, n_vars=source.n_vars, nnz=nnz),
    }
    return Input(
        n_obs=source.n_obs,
        n_vars=source.n_vars,
        obs=obs,
        write_small=lambda root, perm, kw: write_small(source, root, perm, kw),
        matrices=matrices,
        sources=[entry],
        genes={"join": "same", "n_vars": source.n_vars, "var_conflicts": {}},
        notes=[],
    )


def check_by(srcs, infos: list[SourceInfo], columns, source_key: str) -> None:
    """``--by`` columns must be in some source's obs, or be the source column."""
    available = [source_key] if source_key else []
    for info in infos:
        available += [c for c in info.obs_columns if c not in available]
    missing = [c for c in columns if c not in available]
    if missing:
        raise InputError(
            f"--by {missing[0]!r}: no such obs column in any source; available: "
            f"{', '.join(available) or '(none)'}"
        )


def sources_input(
    srcs, infos: list[SourceInfo], *, join, var_names, source_key: str, strict: bool
) -> Input:
    """Return the merged tables and the per-source parts of every output matrix."""
    names = source_names(srcs)
    key = source_key if len(srcs) > 1 else ""
    comb = combine(srcs, names, join=join, var_names=var_names, source_key=key, strict=strict)
    genes = comb.genes
    n_vars = len(genes.var_names)
    sizes = [i.n_obs for i in infos]
    row0 = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    matrices: list[tuple[MatrixInfo, list[MatrixInfo]]] = []
    entries = []
    xs = [m["X"] for m in comb.matrices]
    nnzs = [x.nnz if x.encoding != "dense" else x.shape[0] * x.shape[1] for x in xs]
    prints = io_map(  # plain file reads, in parallel: the sources' ends are cold
        lambda k: fingerprint(srcs[k], n_obs=sizes[k], n_vars=xs[k].shape[1], nnz=nnzs[k]),
        range(len(srcs)),
    )
    for k, x in enumerate(xs):
        entries.append(
            {
                "name": names[k],
                "row0": int(row0[k]),
                "n_obs": int(sizes[k]),
                "n_vars": int(x.shape[1]),
                "genes_present": int(genes.present[k]),
                "fingerprint": prints[k],
            }
        )
        mats = [x] + [comb.matrices[k][f"layers/{n}"] for n in comb.layers]
        for j, info in enumerate(mats):
            if k == 0:
                matrices.append((info, []))
            matrices[j][1].append(info)
    out = _merged(matrices, srcs, row0, genes, n_vars)
    if comb.raw_x is not None:  # one source: raw kept as it is, with its own genes
        out.append(_kept_raw(srcs[0], comb.raw_x))
    if len({i.encoding for i in matrices[0][1]}) > 1 and out[0][0].encoding == "csr":
        comb.notes.append("dense and sparse X mixed: stored as CSR")
    return Input(
        n_obs=int(row0[-1]),
        n_vars=n_vars,
        obs=comb.obs,
        write_small=lambda root, perm, kw: write_combined(comb, root, perm, kw),
        matrices=out,
        sources=entries,
        genes={
            "join": genes.join,
            "n_vars": n_vars,
            "var_conflicts": dict(comb.var_conflicts),
        },
        notes=list(comb.notes),
        row0=row0 if len(srcs) > 1 else None,
        source_key=key,
    )


def _merged(
    matrices: list[tuple[MatrixInfo, list[MatrixInfo]]],
    srcs: list,
    row0: np.ndarray,
    genes: Any,
    n_vars: int,
) -> list[tuple[MatrixInfo, list[Part]]]:
    """Return each output matrix (X, then the layers) with one part per source.

    The stored dtype holds every source's; the matrix is dense only if every source's is.
    """
    idt = index_dtype_for(n_vars)
    out = []
    for first, per_source in matrices:
        dtype = np.result_type(*[i.dtype for i in per_source])
        enc = "dense" if all(i.encoding == "dense" for i in per_source) else "csr"
        target = MatrixInfo(first.path, enc, (int(row0[-1]), n_vars), dtype, idt, 0)
        parts = [
            Part(
                str(Path(s).resolve()),
                info,
                int(row0[k]),
                n_vars,
                dtype,
                idt,
                genes.colmaps[k],
                genes.monotonic[k],
            )
            for k, (s, info) in enumerate(zip(srcs, per_source, strict=True))
        ]
        out.append((target, parts))
    return out


def _kept_raw(src: Any, raw_x: str) -> tuple[MatrixInfo, list[Part]]:
    """Return the output raw/X of a single source: as it is, with its own genes."""
    with open_group(src) as root:
        raw = Source(root, src).matrix_info(raw_x)
    raw_idt = raw.index_dtype or index_dtype_for(raw.shape[1])
    enc = "dense" if raw.encoding == "dense" else "csr"
    target = MatrixInfo("raw/X", enc, raw.shape, raw.dtype, raw_idt, 0)
    return target, [Part(str(Path(src).resolve()), raw, 0, raw.shape[1], raw.dtype, raw_idt)]


def write_combined(comb: Combined, root: zarr.Group, perm: np.ndarray, kw: dict[str, Any]) -> None:
    """var/obsm/uns of several sources (obs is streamed, layers filled as matrices)."""
    quiet_write(root, "var", comb.var, kw)
    quiet_write(root, "obsm", {k: take_rows(v, perm) for k, v in comb.obsm.items()}, kw)
    quiet_write(root, "varm", comb.varm, kw)
    quiet_write(root, "obsp", {k: permute_pairwise(v, perm) for k, v in comb.obsp.items()}, kw)
    for key in ("varp", "layers"):
        quiet_write(root, key, {}, kw)
    uns = dict(comb.uns)
    uns.pop("sclayout", None)
    quiet_write(root, "uns", uns, kw)
    if comb.raw_var is not None:
        raw = root.require_group("raw")
        raw.attrs.update({"encoding-type": "raw", "encoding-version": "0.1.0"})
        quiet_write(raw, "var", comb.raw_var, kw)
        quiet_write(raw, "varm", {}, kw)


def quiet_write(group: Any, key: str, value: Any, kw: dict[str, Any]) -> None:
    """Write one element with anndata's writer (``kw``: its ``dataset_kwargs``).

    anndata reopens each array to fill it, so the array's own config is lost: every
    chunk is stored only with zarr's default set for the duration of the write.
    """
    import anndata as ad

    with (
        warnings.catch_warnings(),
        ad.settings.override(zarr_write_format=3),
        zarr.config.set({"array.write_empty_chunks": True}),
    ):
        warnings.simplefilter("ignore")
        ad.io.write_elem(group, key, value, dataset_kwargs=kw)


def take_rows(value: Any, perm: np.ndarray) -> Any:
    if isinstance(value, pd.DataFrame):
        return value.iloc[perm]
    return value[perm]


def write_small(source: Source, root: zarr.Group, perm: np.ndarray, kw: dict[str, Any]) -> None:
    """Write var/obsm/varm/obsp/varp/uns/raw (except raw/X) with anndata's writer.

    ``kw`` are the writer's ``dataset_kwargs``; obs is streamed (:mod:`sclayout.convert.obs`).
    """
    quiet_write(root, "var", source.read_elem("var"), kw)
    obsm = source.read_elem("obsm") if source.has("obsm") else {}
    quiet_write(root, "obsm", {k: take_rows(v, perm) for k, v in obsm.items()}, kw)
    for key in ("varm", "varp"):
        quiet_write(root, key, source.read_elem(key) if source.has(key) else {}, kw)
    obsp = source.read_elem("obsp") if source.has("obsp") else {}
    quiet_write(root, "obsp", {k: permute_pairwise(v, perm) for k, v in obsp.items()}, kw)
    uns = source.read_elem("uns") if source.has("uns") else {}
    uns.pop("sclayout", None)  # a layout store as source: its own arrays are rebuilt
    quiet_write(root, "uns", uns, kw)
    quiet_write(root, "layers", {}, kw)
    if source.has("raw") and source.has("raw/X"):
        raw = root.require_group("raw")
        raw.attrs.update({"encoding-type": "raw", "encoding-version": "0.1.0"})
        quiet_write(raw, "var", source.read_elem("raw/var"), kw)
        raw_varm = source.read_elem("raw/varm") if source.has("raw/varm") else {}
        quiet_write(raw, "varm", raw_varm, kw)


def permute_pairwise(value: Any, perm: np.ndarray) -> Any:
    if sp.issparse(value):
        fmt = value.format
        return value[perm][:, perm].asformat(fmt)
    return np.asarray(value)[np.ix_(perm, perm)]
