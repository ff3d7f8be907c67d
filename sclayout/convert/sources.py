"""Several sources as one dataset: checks, the gene plan and the merged tables.

Everything here reads metadata and per-cell or per-gene *tables* only (obs, var,
obsm); the matrices are streamed later through :class:`~sclayout.convert.parts.Part`.
The rules (docs/convert.md):

- **Genes.** Sources whose ``var_names`` are identical (same genes, same order) keep
  them. Otherwise the caller must choose: ``join="inner"`` keeps the genes of the
  first source present in every source, in the first source's order; ``join="outer"``
  keeps the union: the first source's genes in its order, then each next source's new
  genes in its order; ``var_names=[...]`` keeps exactly that list. A gene a source
  lacks is a structural zero there. Duplicate gene names within a source are refused.
- **var columns.** The union of columns; each gene takes the first non-missing value
  in source order. A gene given two different values is a *conflict*, counted per
  column in the manifest and shown by ``inspect``.
- **obs.** The union of columns (missing values are NA), categories unified across
  sources, plus a categorical column naming each row's source (``source_key``). When
  ``obs_names`` repeat across sources, every name gets ``-<source name>`` appended.
- **Other elements.** layers and obsm present in every source are concatenated;
  others are dropped with a note (``strict`` refuses instead). ``uns`` comes from the
  first source; ``raw`` and every ``varm``, ``varp`` and ``obsp`` entry are dropped
  with a note each (one source keeps its raw as it is, its obsp, and its varm when
  its genes are kept); ``strict`` refuses them too.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from loader.errors import InputError
from sclayout.convert.checks import SourceInfo, inspect_source
from sclayout.convert.obs import FrameObs, StreamedObs, unify_categories
from sclayout.convert.source import MatrixInfo, Source, is_legacy, open_group, source_tables

__all__ = [
    "JOINS",
    "Combined",
    "GenePlan",
    "check_sources",
    "combine",
    "plan_genes",
    "read_var_names",
    "source_names",
]

JOINS = ("inner", "outer")


def check_sources(srcs: Sequence[str | os.PathLike]) -> list[SourceInfo]:
    """Validate every source from its metadata; refuse an empty list and repeats."""
    if not srcs:
        raise InputError("no SRC given: pass at least one .h5ad file or AnnData zarr store")
    seen: dict[Path, str] = {}
    for s in srcs:
        p = Path(s)
        key = p.resolve() if p.exists() else p.absolute()
        if key in seen:
            raise InputError(f"SRC {s} is given twice (also as {seen[key]}): pass each source once")
        seen[key] = str(s)
    return [inspect_source(s) for s in srcs]


def check_destination_apart(dst: Path, srcs: Sequence[str | os.PathLike]) -> None:
    """DST must be none of the sources, nor inside one, nor contain one."""
    d = dst.resolve()
    for s in srcs:
        p = Path(s).resolve()
        if d == p or p in d.parents or d in p.parents:
            raise InputError(
                f"DST {dst} is SRC, inside it or contains it (SRC {s}): choose another DST"
            )


def source_names(srcs: Sequence[str | os.PathLike]) -> list[str]:
    """Names of the sources: file name stems, made unique with ``-2``, ``-3``, ..."""
    out: list[str] = []
    for s in srcs:
        p = Path(s)
        stem = p.name[: -len(p.suffix)] if p.suffix in (".h5ad", ".zarr", ".h5") else p.name
        name, k = stem, 2
        while name in out:
            name, k = f"{stem}-{k}", k + 1
        out.append(name)
    return out


def read_var_names(path: str | os.PathLike) -> list[str]:
    """Read a ``--var-names`` file: one gene a line (blank lines skipped); refuses repeats."""
    p = Path(path)
    try:
        names = [line.strip() for line in p.read_text().splitlines()]
    except OSError as e:
        raise InputError(
            f"--var-names {p}: cannot read it ({e.strerror}); check the path"
        ) from None
    names = [n for n in names if n]
    if not names:
        raise InputError(f"--var-names {p}: no gene names in it; write one gene a line")
    dup = pd.Index(names)[pd.Index(names).duplicated()]
    if len(dup):
        raise InputError(
            f"--var-names {p}: {len(dup)} genes listed more than once (first: {dup[0]!r}); "
            "list each gene once"
        )
    return names


@dataclass(frozen=True)
class GenePlan:
    """The store's genes and, per source, the map from its columns to them."""

    var_names: pd.Index
    join: str
    """``same`` (identical genes), ``inner``, ``outer`` or ``var_names``."""
    colmaps: list[np.ndarray | None]
    """Per source: output column of each source column (-1: dropped), or None."""
    monotonic: list[bool]
    present: list[int]
    """Per source: how many of the store's genes it has."""


def _duplicates(index: pd.Index, name: str) -> None:
    dup = index[index.duplicated()]
    if len(dup):
        raise InputError(
            f"SRC {name}: {len(dup)} duplicate gene names (first: {dup[0]!r}); make them "
            "unique first (adata.var_names_make_unique()) and save again"
        )


def plan_genes(
    var_indexes: Sequence[pd.Index],
    names: Sequence[str],
    *,
    join: str | None,
    var_names: Sequence[str] | None,
) -> GenePlan:
    """Choose the store's genes from the sources' ``var_names`` (module docstring)."""
    if join is not None and join not in JOINS:
        raise InputError(f"--join {join!r}: unknown; choose one of {', '.join(JOINS)}")
    if join is not None and var_names is not None:
        raise InputError(
            "--join and --var-names both given: pass one (--var-names fixes the genes)"
        )
    if len(var_indexes) > 1 or var_names is not None:
        for idx, name in zip(var_indexes, names, strict=True):
            _duplicates(idx, name)
    first = var_indexes[0]
    same = all(idx.equals(first) for idx in var_indexes[1:])
    if var_names is not None:
        target = pd.Index(list(var_names))
        kind = "var_names"
        for idx, name in zip(var_indexes, names, strict=True):
            if not idx.isin(target).any():
                raise InputError(
                    f"--var-names: no gene in common with SRC {name} (its genes look like "
                    f"{', '.join(map(str, idx[:3]))}); check the file or the source"
                )
    elif same:
        target, kind = first, "same"
    elif join is None:
        details = []
        for idx, name in zip(var_indexes[1:], names[1:], strict=True):
            if not idx.equals(first):
                extra = int((~idx.isin(first)).sum())
                lack = int((~first.isin(idx)).sum())
                details.append(f"{name}: {extra} genes not in {names[0]}, {lack} missing")
        raise InputError(
            f"the sources' genes differ in {len(details)} of {len(names)} files ("
            + "; ".join(details[:3])
            + ("; ..." if len(details) > 3 else "")
            + "): pass --join outer (union), --join inner (common genes) or --var-names FILE"
        )
    elif join == "inner":
        keep = np.ones(len(first), dtype=bool)
        for idx in var_indexes[1:]:
            keep &= first.isin(idx)
        if not keep.any():
            raise InputError(
                f"--join inner: no gene is in every source ({', '.join(names)}); "
                "use --join outer or check the files"
            )
        target, kind = first[keep], "inner"
    else:
        target = first
        for idx in var_indexes[1:]:  # each source's new genes, in its order
            target = target.append(idx[~idx.isin(target)])
        kind = "outer"
    colmaps: list[np.ndarray | None] = []
    monotonic, present = [], []
    for idx in var_indexes:
        if kind == "same":
            colmaps.append(None)
            monotonic.append(True)
            present.append(len(idx))
            continue
        m = target.get_indexer(idx).astype(np.int64)
        kept = m[m >= 0]
        colmaps.append(m)
        monotonic.append(bool(np.all(np.diff(kept) > 0)))
        present.append(int(kept.size))
    return GenePlan(target, kind, colmaps, monotonic, present)


@dataclass
class Combined:
    """The merged small elements of several sources, and what was left out."""

    genes: GenePlan
    obs: StreamedObs | FrameObs
    """The merged obs: streamed from the sources, or in memory for legacy files."""
    var: pd.DataFrame
    obsm: dict[str, Any]
    uns: dict[str, Any]
    layers: list[str]
    """Layers present in every source (concatenated like X)."""
    var_conflicts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    varm: dict[str, Any] = field(default_factory=dict)
    """One source with its own genes only: its varm."""
    obsp: dict[str, Any] = field(default_factory=dict)
    """One source: its obsp (rows and columns are its cells, permuted like them)."""
    raw_x: str | None = None
    """One source only: the source key of raw's X, kept as it is (its own genes)."""
    raw_var: pd.DataFrame | None = None
    matrices: list[dict[str, MatrixInfo]] = field(default_factory=list)
    """Per source: X and its layers (by path), described while the source was open."""


def merge_obs(
    frames: Sequence[pd.DataFrame], names: Sequence[str], *, source_key: str
) -> pd.DataFrame:
    """Union of the obs columns, categories unified, the source column, unique names."""
    if source_key:
        for f, name in zip(frames, names, strict=True):
            if source_key in f.columns:
                raise InputError(
                    f"--source-key {source_key!r}: SRC {name} already has that obs column; "
                    "pass another --source-key, or --source-key '' for none"
                )
    order: list[str] = []
    for f in frames:
        order.extend(c for c in f.columns if c not in order)
    unified = unify_categories(list(frames))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs = pd.concat(unified, join="outer")
    obs = obs[order]
    if source_key:
        codes = np.repeat(np.arange(len(frames)), [len(f) for f in frames])
        obs[source_key] = pd.Categorical.from_codes(codes, categories=list(names))
    if not obs.index.is_unique:
        suffix = np.repeat(np.asarray(names, dtype=object), [len(f) for f in frames])
        obs.index = pd.Index(obs.index.astype(str) + "-" + suffix)
    obs.index = obs.index.astype(str)
    return obs


def merge_var(
    frames: Sequence[pd.DataFrame], target: pd.Index
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Var over ``target``: each column's first non-missing value per gene.

    Values are taken in source order; returns it and the number of genes per column
    given conflicting values.
    """
    order: list[str] = []
    for f in frames:
        order.extend(c for c in f.columns if c not in order)
    var = pd.DataFrame(index=target)
    conflicts: dict[str, int] = {}
    for c in order:
        merged: pd.Series | None = None
        categorical = False
        for f in frames:
            if c not in f.columns:
                continue
            col = f[c]
            categorical |= isinstance(col.dtype, pd.CategoricalDtype)
            s = col.astype(object).reindex(target)
            if merged is None:
                merged = s
                continue
            both = merged.notna() & s.notna()
            differ = int((both & (merged != s)).sum())
            if differ:
                conflicts[c] = conflicts.get(c, 0) + differ
            merged = merged.where(merged.notna(), s)
        values = merged.infer_objects()
        dtypes = {f[c].dtype for f in frames if c in f.columns}
        if categorical:
            values = values.astype("category")
        elif len(dtypes) == 1 and (values.notna().all() or next(iter(dtypes)).kind == "f"):
            with contextlib.suppress(TypeError, ValueError):  # keep the sources' dtype
                values = values.astype(next(iter(dtypes)))
        var[c] = values
    return var, conflicts


def _stack(values: list[Any]) -> Any:
    if all(isinstance(v, pd.DataFrame) for v in values):
        return pd.concat(values)
    if all(sp.issparse(v) for v in values):
        return sp.vstack([sp.csr_matrix(v) for v in values]).tocsr()
    return np.concatenate([np.asarray(v) for v in values])


def _row_shape(v: Any) -> tuple:
    return ("frame", tuple(v.columns)) if isinstance(v, pd.DataFrame) else tuple(v.shape[1:])


def combine(
    srcs: Sequence[str | os.PathLike],
    names: Sequence[str],
    *,
    join: str | None,
    var_names: Sequence[str] | None,
    source_key: str,
    strict: bool,
) -> Combined:
    """Read and merge the sources' obs, var, obsm and uns (module docstring's rules)."""
    tables = []
    layer_sets = []
    matrices = []
    sizes = []
    legacy = False
    for s in srcs:  # each source opened once: its metadata is read while it is at hand
        with open_group(s) as root:
            legacy |= is_legacy(root)
    for s in srcs:
        with open_group(s) as root:
            tables.append(source_tables(root, s, pairwise=len(srcs) == 1, obs=legacy))
            sizes.append(Source(root, s).n_obs)
            layer_sets.append(set(root["layers"].keys()) if "layers" in root else set())
            src = Source(root, s)
            keys = ["X", *(f"layers/{k}" for k in sorted(layer_sets[-1]))]
            matrices.append({k: src.matrix_info(k) for k in keys})
    genes = plan_genes(
        [pd.Index(t["var"].index) for t in tables], names, join=join, var_names=var_names
    )
    notes: list[str] = []
    if legacy:  # anndata < 0.7 files: their obs is read whole, as anndata builds it
        obs: StreamedObs | FrameObs = FrameObs(
            merge_obs([t["obs"] for t in tables], names, source_key=source_key)
        )
    else:
        obs = StreamedObs(srcs, sizes, names, source_key, unique_names=True)
    var, conflicts = merge_var([t["var"] for t in tables], genes.var_names)
    common_layers = set.intersection(*layer_sets)
    for k in sorted(set.union(*layer_sets) - common_layers):
        notes.append(f"layer {k!r} dropped: not in every source")
    obsm: dict[str, Any] = {}
    keys = [set(t["obsm"]) for t in tables]
    for k in sorted(set.union(*keys)):
        values = [t["obsm"].get(k) for t in tables]
        if any(v is None for v in values):
            notes.append(f"obsm {k!r} dropped: not in every source")
        elif len({_row_shape(v) for v in values}) > 1:
            notes.append(f"obsm {k!r} dropped: its width differs between sources")
        else:
            obsm[k] = _stack(values)
    one = len(tables) == 1 and tables[0]["raw_x"] is not None and tables[0]["raw_var"] is not None
    keep_varm = len(tables) == 1 and genes.join == "same"  # var-aligned: same genes only
    if not one and any(t["has"]["raw"] for t in tables):
        notes.append("raw dropped: each source's raw has its own genes, not combined")
    for key in ("varm", "varp", "obsp"):  # one note per element dropped
        if (key == "varm" and keep_varm) or (key == "obsp" and len(tables) == 1):
            continue
        for k in sorted(set().union(*(t["has"][key] for t in tables))):
            notes.append(f"{key} {k!r} dropped: not combined across sources")
    dtypes = {str(t["x_dtype"]) for t in tables}
    if strict and notes:
        raise InputError(f"--strict: {notes[0]}; drop --strict to convert without it")
    if len(dtypes) > 1:
        notes.append(f"X dtypes {', '.join(sorted(dtypes))} upcast to one")
    return Combined(
        genes=genes,
        obs=obs,
        var=var,
        obsm=obsm,
        uns=tables[0]["uns"],
        layers=sorted(common_layers),
        var_conflicts=conflicts,
        notes=notes,
        varm=dict(tables[0]["varm"]) if keep_varm else {},
        obsp=dict(tables[0]["obsp"]) if len(tables) == 1 else {},
        raw_x=tables[0]["raw_x"] if one else None,
        raw_var=tables[0]["raw_var"] if one else None,
        matrices=matrices,
    )


def matrix_dtype(infos: Sequence[MatrixInfo]) -> np.dtype:
    """Return the common dtype of the sources' matrices (numpy's promotion)."""
    return np.result_type(*[i.dtype for i in infos])
