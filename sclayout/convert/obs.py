"""obs of one or several sources, read and written a column at a time, in slices.

:class:`StreamedObs` never holds a whole obs table: each column is read from every
source a slice at a time into a table of the work folder (:mod:`sclayout.convert.tables`:
codes and numbers as they are, strings as UTF-8 bytes with their offsets), then written
into the store in stored order a slice at a time. The merge rules are those of
:mod:`sclayout.convert.sources` (union of columns, categories unified in order of first
appearance, a categorical column naming each row's source, ``-<source name>`` appended
to every name when names repeat). Uniqueness of the names is checked on 64-bit hashes
sorted in a table; only equal hashes are compared by name.

Columns these tables cannot carry exactly (nullable and mixed-type columns, numbers a
source lacks) are merged by pandas as before, one column at a time.
:class:`FrameObs` serves an obs already in memory (a legacy source) the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# anndata (and dask with it) is imported where it is used: `sclayout inspect` and
# `verify` of a store alone start faster without it
import h5py
import numpy as np
import pandas as pd
import zarr

from loader.errors import InputError
from sclayout.convert._buffers import trim_heap
from sclayout.convert.order import Codes, first_appearance
from sclayout.convert.source import open_group
from sclayout.convert.tables import WorkTables, row_dtype, segments, slices

__all__ = ["OBS_CHUNK", "FrameObs", "StreamedObs"]

OBS_CHUNK = 1 << 20
"""Rows per chunk of a stored obs column (one chunk per slice written)."""


@dataclass
class _Column:
    """How one output column is read from the sources and stored."""

    name: str
    kind: str
    """``categorical``, ``numeric``, ``string``, ``source`` (the source column) or
    ``pandas`` (merged in memory)."""
    dtype: np.dtype | None = None
    categories: list = field(default_factory=list)
    remaps: list = field(default_factory=list)
    """Per source: its category codes' unified codes (None: absent)."""
    ordered: bool = False
    """Categories ordered (one source's ordered categorical kept as it is)."""


def _kind(node: Any) -> str:
    enc = node.attrs.get("encoding-type", "array")
    if enc == "categorical":
        return "categorical"
    if enc in ("array", "string-array") and getattr(node, "ndim", 0) == 1:
        if enc == "string-array" or node.dtype.kind in "OTSU":
            return "string"
        return "numeric" if node.dtype.kind in "iufb" else "pandas"
    return "pandas"


def _read(node: Any, a: int, b: int) -> np.ndarray:
    """Rows ``[a, b)`` of a 1-D array element (strings as an object array)."""
    if isinstance(node, h5py.Dataset) and h5py.check_string_dtype(node.dtype) is not None:
        return node.asstr()[a:b].astype(object)
    values = np.asarray(node[a:b])
    return values.astype(object) if values.dtype.kind in "TSU" else values


def _read_utf8(node: Any, a: int, b: int) -> np.ndarray:
    """Rows ``[a, b)`` of a string element as UTF-8 ``bytes`` objects.

    h5py hands out the stored bytes themselves (no decoding to ``str`` and back).
    """
    if isinstance(node, h5py.Dataset) and h5py.check_string_dtype(node.dtype) is not None:
        return np.asarray(node[a:b]).astype(object)
    values = _read(node, a, b)
    out = np.empty(values.size, dtype=object)
    out[:] = [str(v).encode() for v in values]
    return out


def _categories(node: Any) -> list:
    import anndata as ad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(ad.io.read_elem(node["categories"]))


class StreamedObs:
    """The merged obs of ``srcs`` (``sizes`` rows each), read and written in slices."""

    def __init__(
        self,
        srcs: Sequence[str],
        sizes: Sequence[int],
        names: Sequence[str],
        source_key: str = "",
        *,
        unique_names: bool = False,
    ) -> None:
        self.srcs, self.names, self.source_key = [str(s) for s in srcs], list(names), source_key
        self.sizes = [int(s) for s in sizes]
        self.row0 = np.r_[0, np.cumsum(self.sizes)].astype(np.int64)
        self.n_obs = int(self.row0[-1])
        self.index_key, self._columns = self._plan()
        self.unique_names = unique_names
        """Whether repeated names are made unique (several sources)."""
        self.rename = False
        """Whether every name gets ``-<source name>`` (set by :meth:`check_names`)."""

    @property
    def columns(self) -> list[str]:
        """The output columns, in order."""
        return [c.name for c in self._columns]

    def _plan(self) -> tuple[str, list[_Column]]:
        """Each output column's kind, dtype and categories, from the sources' metadata."""
        seen: dict[str, list] = {}
        self._index_keys: list[str] = []
        for k, src in enumerate(self.srcs):
            with open_group(src) as root:
                obs = root["obs"]
                self._index_keys.append(str(obs.attrs.get("_index", "_index")))
                for c in list(obs.attrs.get("column-order", [])):
                    if c == self.source_key:
                        raise InputError(
                            f"--source-key {c!r}: SRC {self.names[k]} already has that obs "
                            "column; pass another --source-key, or --source-key '' for none"
                        )
                    node = obs[c]
                    kind = _kind(node)
                    cats = _categories(node) if kind == "categorical" else None
                    dtype = np.dtype(node.dtype) if kind == "numeric" else None
                    ordered = bool(node.attrs.get("ordered", False))
                    per = seen.setdefault(c, [None] * len(self.srcs))
                    per[k] = (kind, dtype, cats, ordered)
        plans = [_merged_column(c, per) for c, per in seen.items()]
        if self.source_key:
            plans.append(_Column(self.source_key, "source", categories=list(self.names)))
        keys = set(self._index_keys)
        index_key = keys.pop() if len(keys) == 1 else "_index"
        return index_key, plans

    # -- reading ------------------------------------------------------------------------
    def _slices(
        self, key: str | None, read: Callable = _read
    ) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """``(source, first row, end row, values)`` of obs element ``key``, source by source.

        ``key`` None: the names (each source's own index element); ``read`` reads a slice.
        """
        for k, src in enumerate(self.srcs):
            with open_group(src) as root:
                node = root[f"obs/{self._index_keys[k] if key is None else key}"]
                for a, b in slices(self.sizes[k]):
                    yield k, int(self.row0[k]) + a, int(self.row0[k]) + b, read(node, a, b)

    def _fill_fixed(self, col: _Column, tables: WorkTables) -> np.ndarray:
        """Read a categorical (its codes) or numeric column over every row into a table."""
        if col.kind == "source":
            out = tables.empty(f"obs-{col.name}", self.n_obs, _code_dtype(col.categories))
            for k in range(len(self.srcs)):
                for a, b in slices(self.sizes[k]):
                    out[self.row0[k] + a : self.row0[k] + b] = k
            return out
        dtype = _code_dtype(col.categories) if col.kind == "categorical" else col.dtype
        out = tables.empty(f"obs-{col.name}", self.n_obs, dtype)
        for k, remap in enumerate(col.remaps):
            if remap is None:  # a categorical column this source lacks: missing
                for a, b in slices(self.sizes[k]):
                    out[self.row0[k] + a : self.row0[k] + b] = -1
        key = col.name if col.kind == "numeric" else f"{col.name}/codes"
        for k, a, b, values in self._slices_where(key, col):
            if col.kind == "categorical":
                remap = col.remaps[k]
                values = np.where(values < 0, -1, remap[np.maximum(values, 0)])
            out[a:b] = values
        return out

    def _slices_where(self, key: str, col: _Column):
        for k, src in enumerate(self.srcs):
            if col.kind == "categorical" and col.remaps[k] is None:
                continue
            with open_group(src) as root:
                node = root[f"obs/{key}"]
                for a, b in slices(self.sizes[k]):
                    yield k, int(self.row0[k]) + a, int(self.row0[k]) + b, _read(node, a, b)

    def _fill_strings(self, key: str | None, tables: WorkTables, hashes: np.ndarray | None = None):
        """Read a string element over every row as UTF-8 bytes and offsets (and hashes)."""
        name = "names" if key is None else key
        offsets = tables.empty(f"obs-{name}-offsets", self.n_obs + 1, np.int64)
        offsets[0] = 0
        path, total = tables.path(f"obs-{name}-bytes"), 0
        with open(path, "wb") as f:
            for _, a, b, encoded in self._slices(key, _read_utf8):
                if hashes is not None:  # the same hash as of the str (pandas hashes UTF-8)
                    hashes[a:b] = pd.util.hash_array(encoded, categorize=False)
                lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
                offsets[a + 1 : b + 1] = total + np.cumsum(lengths)
                total += int(lengths.sum())
                f.write(b"".join(encoded))
        return offsets, tables.map(path, np.uint8)

    def _pandas_column(self, col: _Column) -> Any:
        """Merge a column with pandas, in memory (types the tables do not carry)."""
        import anndata as ad

        frames = []
        for k, src in enumerate(self.srcs):
            with open_group(src) as root, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                key = f"obs/{col.name}"
                values = ad.io.read_elem(root[key]) if key in root else None
            frames.append(
                pd.DataFrame({col.name: values})
                if values is not None
                else pd.DataFrame(index=pd.RangeIndex(self.sizes[k]))
            )
        if len(frames) == 1:
            return _plain(frames[0][col.name].array)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            merged = pd.concat(unify_categories(frames), join="outer", ignore_index=True)
        return _plain(merged[col.name].array)

    # -- names ----------------------------------------------------------------------------
    def check_names(self, tables: WorkTables) -> bool:
        """Whether a name repeats (then every name gets ``-<source name>``); sets :attr:`rename`.

        The names' 64-bit hashes are sorted in a table; names are compared only where
        two hashes are equal.
        """
        hashes = tables.empty("name-hashes", self.n_obs, np.uint64)
        self._names = self._fill_strings(None, tables, hashes)
        ordered = tables.empty("name-hashes-sorted", self.n_obs, np.uint64)
        for a, b in slices(self.n_obs):
            ordered[a:b] = hashes[a:b]
        ordered.sort()
        equal = [
            ordered[a:b][ordered[a + 1 : b + 1] == ordered[a:b]]
            for a, b in slices(max(0, self.n_obs - 1))
        ]
        suspects = np.unique(np.concatenate([np.zeros(0, np.uint64), *equal]))
        tables.drop(ordered)
        self.rename = bool(suspects.size) and self._repeats(hashes, suspects)
        tables.drop(hashes)
        return self.rename

    def _repeats(self, hashes: np.ndarray, suspects: np.ndarray) -> bool:
        """Whether two rows whose hash is in ``suspects`` have the same name."""
        offsets, data = self._names
        seen: set[str] = set()
        for a, b in slices(self.n_obs):
            rows = a + np.flatnonzero(np.isin(hashes[a:b], suspects))
            for name in _decode(offsets, data, rows).tolist():
                if name in seen:
                    return True
                seen.add(name)
        return False

    # -- by-columns -----------------------------------------------------------------------
    def codes(self, name: str, tables: WorkTables) -> Codes:
        """Code column ``name`` by first appearance (NaN a value); return codes and uniques."""
        col = next(c for c in self._columns if c.name == name)
        out = tables.empty(f"codes-{name}", self.n_obs, row_dtype(self.n_obs))
        if col.kind in ("categorical", "source"):
            fixed = self._fixed(col, tables)
            keys = first_appearance(lambda a, b: fixed[a:b].astype(np.int64) + 1, self.n_obs, out)
            return out, pd.Categorical.from_codes(keys - 1, categories=col.categories)
        if col.kind == "numeric":
            fixed = self._fixed(col, tables)
            keys = first_appearance(lambda a, b: _number_keys(fixed[a:b]), self.n_obs, out)
            return out, _key_values(keys, col.dtype)
        if col.kind == "string":
            offsets, data = self._fill_strings(name, tables)
            values = lambda a, b: _decode(offsets, data, np.arange(a, b))  # noqa: E731
        else:
            whole = self._pandas_column(col)
            values = lambda a, b: whole[a:b]  # noqa: E731
        return _factorize_slices(values, self.n_obs, out)

    def _fixed(self, col: _Column, tables: WorkTables) -> np.ndarray:
        cache = self.__dict__.setdefault("_fixed_tables", {})
        if col.name not in cache:
            cache[col.name] = self._fill_fixed(col, tables)
        return cache[col.name]

    # -- writing ----------------------------------------------------------------------------
    def write(self, root: zarr.Group, perm: np.ndarray, tables: WorkTables, kw: dict) -> None:
        """Write obs into ``root`` in stored order (``perm``), a column at a time."""
        group = root.create_group("obs")
        group.attrs.update(
            {
                "_index": self.index_key,
                "column-order": self.columns,
                "encoding-type": "dataframe",
                "encoding-version": "0.2.0",
            }
        )
        with zarr.config.set({"array.write_empty_chunks": True}):
            if self.unique_names and not hasattr(self, "_names"):
                self.check_names(tables)
            names = getattr(self, "_names", None) or self._fill_strings(None, tables)
            suffix = np.array([f"-{n}" for n in self.names]) if self.rename else None
            self._write_strings(group, self.index_key, names, perm, kw, suffix)
            tables.drop(*names)
            self._names = names = None
            for col in self._columns:
                self._write_column(group, col, perm, tables, kw)

    def _write_column(self, group, col: _Column, perm, tables: WorkTables, kw: dict) -> None:
        import anndata as ad

        if col.kind == "string":
            strings = self._fill_strings(col.name, tables)
            self._write_strings(group, col.name, strings, perm, kw, None)
            tables.drop(*strings)
        elif col.kind == "pandas":
            values = self._pandas_column(col)
            with warnings.catch_warnings(), ad.settings.override(zarr_write_format=3):
                warnings.simplefilter("ignore")
                ad.io.write_elem(group, col.name, values.take(np.asarray(perm)), dataset_kwargs=kw)
        else:
            fixed = self._fixed(col, tables)
            target = group
            if col.kind != "numeric":
                target = group.create_group(col.name)
                target.attrs.update(
                    {
                        "encoding-type": "categorical",
                        "encoding-version": "0.2.0",
                        "ordered": col.ordered,
                    }
                )
                with warnings.catch_warnings(), ad.settings.override(zarr_write_format=3):
                    warnings.simplefilter("ignore")
                    cats = pd.Index(col.categories).to_numpy()
                    ad.io.write_elem(target, "categories", cats, dataset_kwargs=kw)
            name = col.name if col.kind == "numeric" else "codes"
            arr = _create(target, name, self.n_obs, fixed.dtype, kw, "array")
            for a, b in slices(self.n_obs, OBS_CHUNK):
                arr[a:b] = fixed[np.asarray(perm[a:b])]
            tables.drop(self.__dict__.get("_fixed_tables", {}).pop(col.name, fixed))

    def _write_strings(self, group, name: str, strings, perm, kw: dict, suffix) -> None:
        offsets, data = strings
        arr = _create(group, name, self.n_obs, str, kw, "string-array")
        for a, b in slices(self.n_obs, OBS_CHUNK):
            rows = np.asarray(perm[a:b])
            values = _decode(offsets, data, rows)
            if suffix is not None:
                source = np.searchsorted(self.row0, rows, side="right") - 1
                values = np.char.add(values, suffix[source])
            arr[a:b] = values
            del values
            trim_heap()  # a slice's strings back to the system, not left to fragment


def _plain(values: Any) -> Any:
    """Return a column's values as anndata writes them: numpy, or pandas' own arrays."""
    return values.to_numpy() if isinstance(values, pd.arrays.NumpyExtensionArray) else values


def _create(group, name: str, n: int, dtype, kw: dict, encoding: str):
    arr = group.create_array(
        name,
        shape=(n,),
        dtype=dtype,
        chunks=(max(1, min(n, OBS_CHUNK)),),
        compressors=kw.get("compressors"),
    )
    arr.attrs.update({"encoding-type": encoding, "encoding-version": "0.2.0"})
    return arr


DECODE_ROWS = 1 << 16
"""Strings gathered per step of :func:`_decode`: its byte indices (8 bytes a character)
stay a few MB instead of 16 times the slice's text."""


def _decode(offsets: np.ndarray, data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Return the strings of ``rows`` (UTF-8 ``data`` cut at ``offsets``) as a str array."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = np.asarray(offsets[rows])
    lengths = np.asarray(offsets[rows + 1]) - starts
    width = max(1, int(lengths.max(initial=0)))
    buf = np.zeros((rows.size, width), dtype=np.uint8)
    flat = buf.ravel()
    for a in range(0, rows.size, DECODE_ROWS):  # int64 byte indices a piece at a time
        b = min(rows.size, a + DECODE_ROWS)
        at = segments(np.arange(a, b, dtype=np.int64) * width, lengths[a:b])
        flat[at] = data[segments(starts[a:b], lengths[a:b])]
    return np.char.decode(buf.view(f"S{width}").ravel(), "utf-8")


def _code_dtype(categories: list) -> np.dtype:
    """Return the dtype pandas gives the codes of this many categories."""
    n = len(categories)
    for dt in (np.int8, np.int16, np.int32):
        if n < np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def _number_keys(values: np.ndarray) -> np.ndarray:
    """int64 keys equal exactly where pandas finds the numbers equal (NaN equal to NaN)."""
    if values.dtype.kind == "f":
        v = values.astype(np.float64) + 0.0  # -0.0 == 0.0
        v[np.isnan(v)] = np.nan
        return v.view(np.int64)
    return values.astype(np.int64)


def _key_values(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        return keys.view(np.float64).astype(dtype)
    return keys.astype(dtype)


def _factorize_slices(values: Callable[[int, int], Any], n: int, out: np.ndarray) -> Codes:
    """Code any hashable values by first appearance, a slice at a time."""
    code: dict[Any, int] = {}
    uniques: list = []
    nan_code = -1
    for a, b in slices(n):
        local, found = pd.factorize(values(a, b), use_na_sentinel=False)
        glob = np.empty(len(found), dtype=np.int64)
        for i, v in enumerate(found):
            if pd.isna(v):
                if nan_code < 0:
                    nan_code = len(uniques)
                    uniques.append(v)
                glob[i] = nan_code
                continue
            if v not in code:
                code[v] = len(uniques)
                uniques.append(v)
            glob[i] = code[v]
        out[a:b] = glob[local]
    return out, pd.array(uniques) if uniques else np.zeros(0)


def _merged_column(name: str, per: list) -> _Column:
    """Decide how column ``name`` merges across the sources.

    ``per`` is each source's (kind, dtype, categories, ordered), None where the
    source lacks the column.
    """
    present = [p for p in per if p is not None]
    kinds = {p[0] for p in present}
    if kinds == {"categorical"}:
        cats: list = []
        seen: dict = {}
        remaps: list = []
        for p in per:
            if p is None:
                remaps.append(None)
                continue
            for v in p[2]:
                if v not in seen:
                    seen[v] = len(cats)
                    cats.append(v)
            remaps.append(np.array([seen[v] for v in p[2]], dtype=np.int64))
        ordered = len(per) == 1 and per[0][3]
        return _Column(name, "categorical", categories=cats, remaps=remaps, ordered=ordered)
    if len(present) == len(per) and kinds == {"numeric"}:
        dtypes = {p[1] for p in present}
        if len(dtypes) == 1 or all(d.kind in "iuf" for d in dtypes):
            return _Column(name, "numeric", dtype=np.result_type(*dtypes))
    if len(present) == len(per) and kinds == {"string"}:
        return _Column(name, "string")
    return _Column(name, "pandas")


def unify_categories(frames: list[pd.DataFrame]) -> list[pd.DataFrame]:
    """Give every categorical column the union of its categories in every frame.

    Categories are in order of first appearance; a column is added as all-NA where a
    frame lacks it.
    """
    cats: dict[str, list] = {}
    for f in frames:
        for c in f.columns:
            if isinstance(f[c].dtype, pd.CategoricalDtype):
                cats.setdefault(c, [])
    for f in frames:  # a column categorical somewhere: every source's values are categories
        for c in cats.keys() & set(f.columns):
            col = f[c]
            values = col.cat.categories if isinstance(col.dtype, pd.CategoricalDtype) else None
            values = values if values is not None else pd.unique(col.dropna())
            seen = set(cats[c])
            cats[c].extend(x for x in values if x not in seen)
    out = []
    for f in frames:
        f = f.copy()
        for c, categories in cats.items():
            if c in f.columns:
                values = (
                    f[c].astype(object) if not isinstance(f[c].dtype, pd.CategoricalDtype) else f[c]
                )
                f[c] = pd.Categorical(values, categories=categories)
            else:
                f[c] = pd.Categorical([None] * len(f), categories=categories)
        out.append(f)
    return out


class FrameObs:
    """An obs already in memory (a legacy source), served like :class:`StreamedObs`."""

    def __init__(self, obs: pd.DataFrame) -> None:
        self.obs = obs
        self.n_obs = len(obs)
        self.columns = list(obs.columns)

    def codes(self, name: str, tables: WorkTables) -> Codes:
        """Column ``name`` numbered in order of first appearance, and its uniques."""
        codes, uniques = pd.factorize(self.obs[name], use_na_sentinel=False)
        return codes.astype(np.int64), uniques

    def write(self, root: zarr.Group, perm: np.ndarray, tables: WorkTables, kw: dict) -> None:
        """Write obs into ``root`` in stored order, with anndata's writer."""
        import anndata as ad

        with (
            warnings.catch_warnings(),
            ad.settings.override(zarr_write_format=3),
            zarr.config.set({"array.write_empty_chunks": True}),
        ):
            warnings.simplefilter("ignore")
            ad.io.write_elem(root, "obs", self.obs.iloc[np.asarray(perm)], dataset_kwargs=kw)
