"""What ``BlockDataset`` reads besides one store.

In-memory AnnData, several stores as one dataset, a gene panel, a subset of rows, and
extra row-aligned elements.

Each is a reader with the interface of :class:`loader.store.LayoutReader` that the
sampler and the pipeline use (``block_lengths``, ``source_index``, ``obs_codes``,
``submit(blocks, order=) -> .result() -> take / take_slice``), wrapping other readers:

- :class:`MatrixReader`: an in-memory matrix (AnnData ``X``, a layer, an ``obsm``
  array) cut into blocks of ``block_size`` rows.
- :class:`ConcatReader`: several readers as one, rows and blocks concatenated; source
  row ids of reader ``i`` are offset by the rows of the readers before it.
- :class:`PanelReader`: output columns in a given gene order, through a column map
  computed once and applied to each decoded minibatch (absent genes are zeros).
- :class:`SubsetReader`: only some rows. A block keeps its selected rows (it is
  trimmed, and still read whole); a block without any is left out of the sampling, and
  neighbouring trimmed blocks are sampled together.

:func:`build_readers` stacks them for the arguments of ``BlockDataset``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from loader.errors import InputError
from loader.layout import parse_block_size
from loader.sampler import arange_runs

__all__ = [
    "ConcatReader",
    "MatrixReader",
    "PanelReader",
    "SubsetReader",
    "build_readers",
    "is_anndata",
]

LOOKUP_CHUNK = 2**16
"""Column ids looked up in the gene panel's column map at a time: the ids (up to 8
bytes each) and their panel columns fit in a core's L2 cache, and numpy's ``take``
into a given output is not buffered."""

MEMORY_BLOCK_SIZE = 64
"""Rows per block of an in-memory AnnData: the converter's default block size, so the
sampling matches a converted store's."""


def _block_of(starts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, rows, side="right") - 1


class _Ready:
    """A fetch that is already there (in-memory readers)."""

    def __init__(self, fetched: Any) -> None:
        self._fetched = fetched

    def result(self) -> Any:
        return self._fetched


def _cancel(pending: Any) -> None:
    """``pending.cancel()`` where the pending fetch has one."""
    cancel = getattr(pending, "cancel", None)
    if cancel is not None:
        cancel()


def _as_output(X: Any, output: str) -> Any:
    if output == "dense":
        return np.ascontiguousarray(X.toarray() if sp.issparse(X) else X, dtype=np.float32)
    if output in ("csr", "view"):
        return sp.csr_matrix(X, dtype=np.float32)
    raise InputError(f"output={output!r}: unknown for this input; known: dense, csr")


# ----------------------------------------------------------------- in memory


def _obs_codes_of(frame: Any, column: str) -> tuple[np.ndarray, list]:
    import pandas as pd

    if frame is None or column not in frame.columns:
        known = [] if frame is None else list(frame.columns)
        raise InputError(
            f"obs column {column!r}: not in the data's obs; available: {', '.join(map(str, known))}"
        )
    values = frame[column]
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy().astype(np.int64), list(values.cat.categories)
    codes, uniques = pd.factorize(values, sort=True)
    return codes.astype(np.int64), list(uniques)


class MatrixReader:
    """Rows of an in-memory matrix (numpy or scipy sparse) in blocks of ``block_size``."""

    kind = "memory"
    backend = "memory"

    def __init__(
        self, matrix: Any, *, block_size: int, obs: Any = None, var_names: Any = None
    ) -> None:
        if sp.issparse(matrix):
            matrix = matrix.tocsr()
        elif not isinstance(matrix, np.ndarray) or matrix.ndim != 2:
            raise InputError(
                f"an AnnData whose X is {type(matrix).__name__}, not a matrix: give X as a "
                "numpy array or a scipy sparse matrix (an AnnData read in backed mode: pass "
                "its path instead)"
            )
        self.matrix = matrix
        self.n_obs, self.n_vars = (int(s) for s in matrix.shape)
        self.block_size = parse_block_size(block_size)
        self.n_blocks = -(-self.n_obs // self.block_size)
        self.obs = obs
        self._var_names = None if var_names is None else [str(v) for v in var_names]
        self._codes: dict[str, tuple[np.ndarray, list]] = {}

    @property
    def is_csr(self) -> bool:
        """Whether the matrix is scipy sparse."""
        return sp.issparse(self.matrix)

    def var_names(self) -> list[str]:
        """Return the var names; an input without them is an :class:`InputError`."""
        if self._var_names is None:
            raise InputError("var_names: this input has no var names; pass an AnnData")
        return self._var_names

    def block_lengths(self) -> np.ndarray:
        """Return the rows of each block (the last one possibly short)."""
        starts = np.arange(self.n_blocks, dtype=np.int64) * self.block_size
        return np.minimum(starts + self.block_size, self.n_obs) - starts

    def source_index(self) -> np.ndarray:
        """Return the source row of each row: the identity, as the rows are not reordered."""
        return np.arange(self.n_obs, dtype=np.int64)

    def obs_codes(self, column: str) -> tuple[np.ndarray, list]:
        """Return the codes and categories of obs ``column`` (computed once)."""
        if column not in self._codes:
            self._codes[column] = _obs_codes_of(self.obs, column)
        return self._codes[column]

    def categorical_obs_columns(self) -> list[str]:
        """Return the obs columns that are categoricals, in order."""
        import pandas as pd

        if self.obs is None:
            return []
        return [c for c in self.obs.columns if isinstance(self.obs[c].dtype, pd.CategoricalDtype)]

    def submit(self, blocks: np.ndarray, *, order: np.ndarray | None = None) -> _Ready:
        """Return the rows of ``blocks`` (in ``order`` if given) as a fetch already there."""
        blocks = np.asarray(blocks, dtype=np.int64)
        starts = blocks * self.block_size
        rows = arange_runs(starts, np.minimum(starts + self.block_size, self.n_obs) - starts)
        if order is not None:
            rows = rows[np.asarray(order, dtype=np.int64)]
        return _Ready(_RowsFetched(self, rows))

    def rows_of(self, rows: np.ndarray, output: str) -> Any:
        """Return the matrix rows ``rows`` as ``output``."""
        return _as_output(self.matrix[rows], output)


class _RowsFetched:
    """The rows of a fetch of a :class:`MatrixReader` (taken when asked)."""

    def __init__(self, reader: MatrixReader, rows: np.ndarray) -> None:
        self.reader, self.rows, self.index = reader, rows, rows
        self.n_rows = int(rows.size)

    def take(
        self, positions: np.ndarray, *, output: str = "dense", obs: Sequence[str] = ()
    ) -> dict[str, Any]:
        stored = self.rows[np.asarray(positions, dtype=np.int64)]
        return {
            "X": self.reader.rows_of(stored, output),
            "index": stored.copy(),
            "obs": {c: self.reader.obs_codes(c)[0][stored] for c in obs},
        }


# ----------------------------------------------------------------- several readers


class ConcatReader:
    """Several readers of the same width as one.

    Their rows (and blocks) come one after the other.
    """

    kind = "concat"

    def __init__(self, readers: Sequence[Any]) -> None:
        self.readers = list(readers)
        widths = {int(r.n_vars) for r in self.readers}
        if len(widths) != 1:
            raise InputError(
                f"stores of different widths ({sorted(widths)} genes) in one list: pass "
                "var_names= to map them onto one gene panel"
            )
        self.n_vars = widths.pop()
        lengths = [np.asarray(r.block_lengths(), dtype=np.int64) for r in self.readers]
        self._lengths = np.concatenate(lengths)
        self._boff = np.cumsum([0, *(x.size for x in lengths)])
        self._roff = np.cumsum([0, *(int(r.n_obs) for r in self.readers)])
        self.n_obs = int(self._roff[-1])
        self.n_blocks = int(self._lengths.size)
        self.block_size = max(int(r.block_size) for r in self.readers)
        self._codes: dict[str, tuple[np.ndarray, list]] = {}

    @property
    def is_csr(self) -> bool:
        """Whether any input is CSR."""
        return any(_is_csr(r) for r in self.readers)

    @property
    def backend(self) -> str:
        """``tensorstore`` if any input reads with it (the dataset's fork check asks)."""
        names = {getattr(r, "backend", None) for r in self.readers}
        return "tensorstore" if "tensorstore" in names else str(names.pop())

    @property
    def input_offsets(self) -> np.ndarray:
        """First source row of each input, plus the total."""
        return self._roff

    @property
    def state_key(self) -> str:
        """Digest of the inputs' keys, which identifies the rows for resuming."""
        return _digest(repr([_state_key(r) for r in self.readers]))

    def block_lengths(self) -> np.ndarray:
        """Return the rows of each block, the inputs' blocks one after the other."""
        return self._lengths

    def source_index(self) -> np.ndarray:
        """Return the source row of each row, offset by the rows of the inputs before it."""
        pairs = zip(self.readers, self._roff[:-1], strict=True)
        return np.concatenate([np.asarray(r.source_index(), np.int64) + o for r, o in pairs])

    def obs_codes(self, column: str) -> tuple[np.ndarray, list]:
        """Codes over the union of the readers' categories (in first-seen order)."""
        if column not in self._codes:
            cats: dict[Any, int] = {}
            parts = []
            for r in self.readers:
                codes, own = r.obs_codes(column)
                remap = np.array([cats.setdefault(c, len(cats)) for c in own] + [-1], np.int64)
                parts.append(remap[np.asarray(codes, dtype=np.int64)])  # -1 stays -1
            self._codes[column] = (np.concatenate(parts), list(cats))
        return self._codes[column]

    def submit(self, blocks: np.ndarray, *, order: np.ndarray | None = None) -> _ConcatPending:
        """Every input's part of the fetch is submitted at once (reads in flight)."""
        blocks = np.sort(np.asarray(blocks, dtype=np.int64))
        which = _block_of(self._boff, blocks)
        parts = []
        for i in np.unique(which):
            local = blocks[which == i] - self._boff[i]
            parts.append((int(i), self.readers[i].submit(local)))
        return _ConcatPending(self, parts, order)


class _ConcatPending:
    def __init__(self, reader: ConcatReader, parts: list, order: np.ndarray | None) -> None:
        self.reader, self.parts, self.order = reader, parts, order

    def result(self) -> _ConcatFetched:
        return _ConcatFetched(self.reader, [(i, p.result()) for i, p in self.parts], self.order)

    def cancel(self) -> None:
        """Cancel each input's reads not yet started (an abandoned fetch)."""
        for _, p in self.parts:
            _cancel(p)


class _ConcatFetched:
    def __init__(self, reader: ConcatReader, parts: list, order: np.ndarray | None) -> None:
        self.reader = reader
        self._parts = parts
        sizes = [f.n_rows for _, f in self._parts]
        self._off = np.cumsum([0, *sizes])
        total = int(self._off[-1])
        self._order = None if order is None else np.asarray(order, dtype=np.int64)
        self.n_rows = total if self._order is None else int(self._order.size)

    def take(
        self, positions: np.ndarray, *, output: str = "dense", obs: Sequence[str] = ()
    ) -> dict[str, Any]:
        pos = np.asarray(positions, dtype=np.int64)
        if self._order is not None:
            pos = self._order[pos]
        part = _block_of(self._off, pos)
        Xs, index, stored, where = [], [], [], []
        for j in np.unique(part):
            i, f = self._parts[j]
            sel = np.flatnonzero(part == j)
            local = pos[sel] - self._off[j]
            got = f.take(local, output=output)
            Xs.append(got["X"])
            index.append(np.asarray(got["index"], np.int64) + self.reader._roff[i])
            stored.append(np.asarray(f.rows, np.int64)[local] + self.reader._roff[i])
            where.append(sel)
        back = np.argsort(np.concatenate(where), kind="stable")
        X = sp.vstack(Xs, format="csr") if sp.issparse(Xs[0]) else np.concatenate(Xs)
        rows = np.concatenate(stored)[back]
        return {
            "X": X[back],
            "index": np.concatenate(index)[back],
            "obs": {c: self.reader.obs_codes(c)[0][rows] for c in obs},
        }


# ----------------------------------------------------------------- gene panel


def _is_csr(reader: Any) -> bool:
    flag = getattr(reader, "is_csr", None)
    if flag is not None:
        return bool(flag)
    layout = getattr(reader, "layout", None)
    return bool(layout is not None and layout.is_csr)


def panel_names(var_names: Any) -> list[str]:
    """Return the panel as a list of names.

    From a list, a pandas Index or a text file (one name per line); duplicates are an
    error.
    """
    if isinstance(var_names, str | os.PathLike):
        path = os.fspath(var_names)
        try:
            with open(path) as f:
                names = [ln.strip() for ln in f if ln.strip()]
        except OSError as e:
            raise InputError(
                f"var_names={path!r}: cannot read ({e.strerror}); check the path"
            ) from None
    else:
        try:
            names = [str(v) for v in var_names]
        except TypeError:
            raise InputError(
                f"var_names={var_names!r}: give a list, a pandas Index or a file of gene names"
            ) from None
    if not names:
        raise InputError("var_names: empty; give at least one gene name")
    seen: set[str] = set()
    dup = [n for n in names if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
    if dup:
        raise InputError(
            f"var_names: {len(dup)} duplicate name(s), e.g. {dup[0]!r}; give each gene once"
        )
    return names


class _Wrapping:
    """What a reader that wraps another one (``inner``) passes through unchanged."""

    inner: Any

    @property
    def manifest(self) -> Any:
        """Manifest of the inner reader, or ``None`` if it has none."""
        return getattr(self.inner, "manifest", None)

    @property
    def backend(self) -> Any:
        """Backend of the inner reader, or ``None`` if it has none."""
        return getattr(self.inner, "backend", None)


class PanelReader(_Wrapping):
    """The inner reader's rows in the columns of a gene panel (absent genes: zeros).

    ``columns[j]`` is the panel column of the inner reader's column ``j``, or ``-1`` for
    a gene outside the panel: the map is computed once, and applied to each decoded
    minibatch (CSR: a gather of column ids; dense: one column gather).
    """

    kind = "panel"

    def __init__(self, inner: Any, columns: np.ndarray, n_vars: int) -> None:
        self.inner = inner
        self.columns = np.asarray(columns, dtype=np.int64)
        self.n_vars = int(n_vars)
        self.n_obs = int(inner.n_obs)
        self.block_size = inner.block_size
        self.n_blocks = int(np.asarray(inner.block_lengths()).size)
        self.is_csr = _is_csr(inner)
        self._src = np.flatnonzero(self.columns >= 0)
        self._dst = self.columns[self._src]

    @property
    def state_key(self) -> str:
        """Digest of the inner key and the panel: it identifies the rows for resuming."""
        return _digest(repr([_state_key(self.inner), self.columns.tobytes()]))

    def block_lengths(self) -> np.ndarray:
        """Return the inner reader's block lengths (a panel keeps every row)."""
        return self.inner.block_lengths()

    def source_index(self) -> np.ndarray:
        """Return the inner reader's source index (a panel keeps every row)."""
        return self.inner.source_index()

    def obs_codes(self, column: str) -> tuple[np.ndarray, list]:
        """Return the inner reader's codes and categories of obs ``column``."""
        return self.inner.obs_codes(column)

    def obs_categories(self, column: str) -> list:
        """Return the categories of obs ``column`` (the inner fetches read its codes)."""
        own = getattr(self.inner, "obs_categories", None)
        return own(column) if own is not None else self.inner.obs_codes(column)[1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # a thread pool: made again where it is used
        return state

    def submit(self, blocks: np.ndarray, *, order: np.ndarray | None = None) -> Any:
        """Start the fetch of ``blocks``; its rows come in the panel's columns."""
        from loader.store import LayoutReader

        if not isinstance(self.inner, LayoutReader):  # remapped per minibatch
            return _PanelPending(self, self.inner.submit(blocks, order=order))
        # a store: the whole fetch is remapped once it is decoded, in a thread of its
        # own (overlapping the consumer, as the reader's assembly does), and the
        # minibatches are then cut from the narrower fetch by the reader's fast path
        pending = self.inner.submit(blocks)
        return self._thread().submit(self._assemble, pending, order)

    def close(self) -> None:
        """Stop this panel's remapping thread (its inner reader stays open)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None and pool[0] == os.getpid():
            pool[1].shutdown(wait=True, cancel_futures=True)

    def _thread(self) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        pool = getattr(self, "_pool", None)
        if pool is None or pool[0] != os.getpid():
            pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="sclayout-panel"))
            self._pool = pool
        return pool[1]

    def _assemble(self, pending: Any, order: np.ndarray | None) -> Any:
        from loader.assemble import CSRRows, DenseRows
        from loader.store import Fetched

        f = pending.result()
        v, rows, index = f.values, f.rows, f.index
        keep: Any = slice(None)
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            # a row subset delivers only some rows of the blocks read: drop the others
            # first (one row gather), so the remap touches only delivered rows' values
            need = np.zeros(v.n_rows, dtype=bool)
            need[order] = True
            if not need.all():
                keep = np.flatnonzero(need)
                order = (np.cumsum(need) - 1)[order]
                rows, index = rows[keep], index[keep]
                if isinstance(v, CSRRows):
                    v = v.permute(keep)
        if isinstance(v, CSRRows):
            cols = self._panel_columns(v.indices)
            kept = np.flatnonzero(cols >= 0)
            indptr = np.searchsorted(kept, v.indptr).astype(v.indptr.dtype)
            values: Any = CSRRows(
                v.data[kept], cols[kept].astype(v.indptr.dtype), indptr, self.n_vars
            )
        else:
            picked = v.values[keep]
            out = np.zeros((picked.shape[0], self.n_vars), dtype=v.values.dtype)
            out[:, self._dst] = picked[:, self._src]
            values = DenseRows(out)
        obs = f.obs_at(keep) if hasattr(f, "obs_at") else None  # obs codes read per fetch
        if order is None:
            return Fetched(f.reader, rows, index, values, obs=obs)
        return Fetched.delivered(f.reader, rows, index, values, order, obs=obs)

    def _panel_columns(self, indices: np.ndarray) -> np.ndarray:
        """Return the panel column of each column id in ``indices`` (``-1``: not in the panel).

        One lookup in the column map, stored in the smallest signed type that holds the
        panel and done in pieces of :data:`LOOKUP_CHUNK` ids, so the map, the ids and the
        result stay in cache; ``indices`` are already bounds-checked.
        """
        small = np.int16 if self.n_vars < 2**15 else np.int32
        lut = getattr(self, "_lut_cache", None)
        if lut is None:
            lut = self._lut_cache = self.columns.astype(small)
        out = np.empty(indices.shape[0], dtype=small)
        for a in range(0, indices.shape[0], LOOKUP_CHUNK):
            b = a + LOOKUP_CHUNK
            np.take(lut, indices[a:b], out=out[a:b], mode="clip")
        return out

    def remap(self, X: Any, output: str) -> Any:
        """``X`` (the inner reader's columns) in the panel's columns, as ``output``."""
        n = X.shape[0]
        if sp.issparse(X):
            X = X.tocsr()
            cols = self.columns[X.indices]
            keep = cols >= 0
            kept = np.concatenate([[0], np.cumsum(keep)])[X.indptr]
            data, cols = X.data[keep], cols[keep]
            if output == "dense":
                out = np.zeros((n, self.n_vars), dtype=np.float32)
                out[np.repeat(np.arange(n), np.diff(kept)), cols] = data
                return out
            return sp.csr_matrix(
                (data.astype(np.float32, copy=False), cols, kept), shape=(n, self.n_vars)
            )
        out = np.zeros((n, self.n_vars), dtype=np.float32)
        out[:, self._dst] = np.asarray(X)[:, self._src]
        return out if output == "dense" else sp.csr_matrix(out)


class _PanelPending:
    def __init__(self, reader: PanelReader, inner: Any) -> None:
        self.reader, self.inner = reader, inner

    def result(self) -> _PanelFetched:
        return _PanelFetched(self.reader, self.inner.result())

    def cancel(self) -> None:
        """Cancel the inner reader's reads not yet started (an abandoned fetch)."""
        _cancel(self.inner)


class _PanelFetched:
    def __init__(self, reader: PanelReader, inner: Any) -> None:
        self.reader, self.inner = reader, inner
        self.n_rows = int(inner.n_rows)
        self.rows = getattr(inner, "rows", None)

    def _inner_output(self) -> str:
        return "view" if self.reader.is_csr else "dense"  # view: remap copies anyway

    def _remapped(self, got: dict[str, Any], output: str) -> dict[str, Any]:
        return {**got, "X": self.reader.remap(got["X"], output)}

    def take(
        self, positions: np.ndarray, *, output: str = "dense", obs: Sequence[str] = ()
    ) -> dict[str, Any]:
        got = self.inner.take(positions, output=self._inner_output(), obs=obs)
        return self._remapped(got, output)

    def take_slice(
        self, a: int, b: int, *, output: str = "dense", obs: Sequence[str] = ()
    ) -> dict[str, Any]:
        fast = getattr(self.inner, "take_slice", None)
        if fast is None:
            return self.take(np.arange(a, b), output=output, obs=obs)
        return self._remapped(fast(a, b, output=self._inner_output(), obs=obs), output)


# ----------------------------------------------------------------- rows


class SubsetReader(_Wrapping):
    """Only the stored rows ``rows`` (sorted, unique) of the inner reader.

    Each inner block is trimmed to its selected rows (one without any is left out), and
    neighbouring trimmed blocks are sampled together: a block of the subset is the
    trimmed inner blocks of one aligned group of ``group`` inner blocks, ``group``
    chosen so that it holds about an inner block's rows. A fetch reads the inner blocks
    whole and delivers only the selected rows; grouping neighbours lets a sparse
    selection decode each compressed chunk once for all the rows it serves, instead of
    once per trimmed block that touches it.
    """

    kind = "subset"

    def __init__(self, inner: Any, rows: np.ndarray) -> None:
        self.inner = inner
        self.rows = np.asarray(rows, dtype=np.int64)
        inner_lengths = np.asarray(inner.block_lengths(), dtype=np.int64)
        self._inner_starts = np.concatenate([[0], np.cumsum(inner_lengths)])
        self._inner_lengths = inner_lengths
        block = _block_of(self._inner_starts, self.rows)
        # the inner blocks holding selected rows, how many each, where they start in rows
        self._trimmed, counts = np.unique(block, return_counts=True)
        self._counts = counts.astype(np.int64)
        self._trimmed_starts = np.concatenate([[0], np.cumsum(self._counts)])
        self.group = self._group_size()
        group = self._trimmed // self.group
        first = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if group.size else group
        self._first = np.concatenate([first, [self._trimmed.size]]).astype(np.int64)
        self._lengths = np.add.reduceat(self._counts, first) if group.size else self._counts
        self.n_obs = int(self.rows.size)
        self.n_source = int(inner.n_obs)  # per-row weights are given for every source row
        self.n_vars = int(inner.n_vars)
        self.n_blocks = int(self._lengths.size)
        self.block_size = inner.block_size
        self.is_csr = _is_csr(inner)

    def _group_size(self) -> int:
        """Inner blocks per group: the mean inner block over the mean selected rows of one."""
        if not self._counts.size:
            return 1
        per_block = float(self._inner_lengths.mean())
        kept = float(self._counts.mean())
        return max(1, int(per_block / kept + 0.5))

    @property
    def state_key(self) -> str:
        """Digest of the inner key and the rows kept: it identifies the rows for resuming."""
        return _digest(repr([_state_key(self.inner), _digest(self.rows.tobytes())]))

    def block_lengths(self) -> np.ndarray:
        """Return the kept rows of each block (group of trimmed inner blocks)."""
        return self._lengths

    def source_index(self) -> np.ndarray:
        """Return the source row of each kept row."""
        return np.asarray(self.inner.source_index(), dtype=np.int64)[self.rows]

    def obs_codes(self, column: str) -> tuple[np.ndarray, list]:
        """Return the codes of obs ``column`` for the kept rows, and its categories."""
        codes, cats = self.inner.obs_codes(column)
        return np.asarray(codes, dtype=np.int64)[self.rows], cats

    def submit(self, blocks: np.ndarray, *, order: np.ndarray | None = None) -> Any:
        """Start the fetch of ``blocks``; it reads whole inner blocks and keeps the chosen rows."""
        blocks = np.asarray(blocks, dtype=np.int64)  # sorted and unique, as the sampler asks
        k = arange_runs(self._first[blocks], self._first[blocks + 1] - self._first[blocks])
        inner = self._trimmed[k]
        # where each selected row of these blocks sits in the inner fetch (whole blocks)
        fetch_start = np.cumsum(self._inner_lengths[inner]) - self._inner_lengths[inner]
        n = self._counts[k]
        selected = self.rows[arange_runs(self._trimmed_starts[k], n)]
        shift = np.repeat(fetch_start - self._inner_starts[inner], n)
        positions = selected + shift
        if order is not None:
            positions = positions[np.asarray(order, dtype=np.int64)]
        return self.inner.submit(inner, order=positions)


# ----------------------------------------------------------------- building


def _digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha1(data).hexdigest()[:16]


def _state_key(reader: Any) -> str:
    """Return what identifies a reader's rows for resuming (its own key, or its store order)."""
    key = getattr(reader, "state_key", None)
    if key is not None:
        return str(key)
    m = getattr(reader, "manifest", None)
    order = m.order.to_dict() if m is not None else None
    return _digest(repr([int(reader.n_obs), int(reader.n_vars), order]))


def is_anndata(obj: Any) -> bool:
    """Whether ``obj`` is an in-memory ``anndata.AnnData`` (without importing anndata)."""
    return type(obj).__name__ == "AnnData" and hasattr(obj, "obs") and hasattr(obj, "var_names")


def _element_path(element: str) -> tuple[str, str]:
    kind, _, name = element.partition("/")
    if element == "X":
        return "X", ""
    if kind not in ("layers", "obsm") or not name:
        raise InputError(
            f"extra element {element!r}: unknown; give 'layers/NAME' or 'obsm/NAME' (or 'X')"
        )
    return kind, name


def _memory_reader(adata: Any, element: str, block_size: int) -> MatrixReader:
    kind, name = _element_path(element)
    if kind == "X":
        return MatrixReader(
            adata.X, block_size=block_size, obs=adata.obs, var_names=adata.var_names
        )
    group = getattr(adata, kind)
    if name not in group:
        raise InputError(
            f"extra element {element!r}: not in the AnnData; available in {kind}: "
            f"{', '.join(group.keys()) or '(none)'}"
        )
    return MatrixReader(group[name], block_size=block_size)


def _store_var_names(reader: Any) -> list[str]:
    """Var names of a layout store or an .h5ad (read once, with anndata)."""
    cached = getattr(reader, "_sclayout_var_names", None)
    if cached is not None:
        return cached
    names = [str(v) for v in _read_element(reader, "var").index]
    reader._sclayout_var_names = names
    return names


def _read_element(reader: Any, element: str) -> Any:
    """Read a small element (``var``, ``obsm/NAME``) of a store or .h5ad whole."""
    from anndata.io import read_elem

    location = getattr(reader, "location", None)
    if location is None:
        raise InputError(
            f"{element}: reading it from this reader is not supported; "
            "use a store (local or in a bucket) or an .h5ad"
        )
    if reader.kind == "h5ad":
        import h5py

        with h5py.File(location, "r") as f:
            if element not in f:
                raise InputError(f"extra element {element!r}: not in {location}")
            return read_elem(f[element])
    import zarr

    from loader.checked import read_element

    # a remote store's element: from a partial local copy of it
    local = getattr(reader, "local_elements", None)
    root = zarr.open_group(location if local is None else local([element]), mode="r")
    try:
        node = root[element]
    except KeyError:
        raise InputError(f"extra element {element!r}: not in {location}") from None
    # a version-2 store stores every chunk: an absent one is damage, not the fill value
    stored = bool(getattr(getattr(reader, "manifest", None), "all_chunks_stored", False))
    return read_element(node, location, require_chunks=stored)


def _store_extra(reader: Any, element: str, open_matrix: Any) -> Any:
    """Return the reader of extra ``element`` of a store, on the same block grid as ``reader``."""
    kind, _ = _element_path(element)
    if kind == "obsm":
        value = _read_element(reader, element)
        if hasattr(value, "to_numpy"):  # a data frame in obsm
            value = value.to_numpy()
        return MatrixReader(value, block_size=reader.block_size)
    try:
        return open_matrix(element)
    except InputError as e:
        raise InputError(f"extra element {element!r}: {e}") from None


def build_readers(
    inputs: Sequence[Any],
    *,
    open_store: Any,
    block_size: int | None,
    var_names: Any = None,
    rows: Any = None,
    extra: Sequence[str] = (),
) -> tuple[Any, dict[str, Any]]:
    """Return the reader of ``X`` and one per ``extra`` element for ``BlockDataset``'s inputs.

    ``inputs`` are store paths / URLs, readers or in-memory AnnData objects;
    ``open_store(path, matrix)`` opens one store (with the dataset's settings).
    Everything is validated here, before anything is read.
    """
    panel = None if var_names is None else panel_names(var_names)
    extra = tuple(extra)
    for e in extra:
        _element_path(e)
    per_input: list[dict[str, Any]] = []
    for item in inputs:
        if is_anndata(item):
            bs = MEMORY_BLOCK_SIZE if block_size is None else block_size
            x = _memory_reader(item, "X", bs)
            readers = {"X": x, **{e: _memory_reader(item, e, bs) for e in extra}}
            names = x.var_names()
        else:
            x = open_store(item, "X")
            readers = {"X": x}
            for e in extra:
                readers[e] = _store_extra(x, e, lambda m, item=item: open_store(item, m))
            names = None
        for e, r in readers.items():
            if e != "X" and int(r.n_obs) != int(x.n_obs):
                raise InputError(f"extra element {e!r}: {r.n_obs} rows, X has {x.n_obs}")
        per_input.append({"readers": readers, "names": names})
    if panel is not None:
        pos = {g: j for j, g in enumerate(panel)}
        for d in per_input:
            x = d["readers"]["X"]
            names = d["names"] if d["names"] is not None else _store_var_names(x)
            cols = np.array([pos.get(g, -1) for g in names], dtype=np.int64)
            d["readers"]["X"] = PanelReader(x, cols, len(panel))
    elif len(per_input) > 1:
        first = _names_or_none(per_input[0])
        for i, d in enumerate(per_input[1:], start=1):
            other = _names_or_none(d)
            if first is not None and other is not None and first != other:
                raise InputError(
                    f"input {i} has other var than input 0 ({len(other)} vs {len(first)} "
                    "genes, or another order): pass var_names= to map them onto one panel"
                )
    if len(per_input) == 1:
        out = dict(per_input[0]["readers"])
    else:
        out = {e: ConcatReader([d["readers"][e] for d in per_input]) for e in ("X", *extra)}
    if rows is not None:
        selected = select_rows(out["X"], rows)
        out = {e: SubsetReader(r, selected) for e, r in out.items()}
    x = out.pop("X")
    return x, out


def _names_or_none(d: dict[str, Any]) -> list[str] | None:
    if d["names"] is not None:
        return d["names"]
    try:
        return _store_var_names(d["readers"]["X"])
    except InputError:
        return None  # e.g. over HTTP: widths are still checked


def select_rows(reader: Any, rows: Any) -> np.ndarray:
    """Return the stored rows of ``reader`` chosen by ``rows``.

    ``rows`` is a boolean mask or an index array over the source rows, or
    ``{obs column: value or list of values}``.
    """
    n = int(reader.n_obs)
    if isinstance(rows, Mapping):
        keep = np.ones(n, dtype=bool)
        for col, want in rows.items():
            codes, cats = reader.obs_codes(col)
            values = list(want) if isinstance(want, list | tuple | set) else [want]
            unknown = [v for v in values if v not in cats]
            if unknown:
                raise InputError(
                    f"rows={{{col!r}: ...}}: {unknown} not in obs column {col!r}; "
                    f"known: {cats[:20]}"
                )
            wanted = np.isin(np.asarray(codes), [cats.index(v) for v in values])
            keep &= wanted
        stored = np.flatnonzero(keep)
    else:
        arr = np.asarray(rows)
        source = np.asarray(reader.source_index(), dtype=np.int64)
        if arr.dtype == bool:
            if arr.shape != (n,):
                raise InputError(
                    f"rows: a mask of {arr.size} values for {n} rows; give one value per row "
                    "(source order), an index array or {obs column: value}"
                )
            stored = np.flatnonzero(arr[source])
        elif arr.ndim == 1 and (arr.size == 0 or arr.dtype.kind in "iu"):
            idx = arr.astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise InputError(
                    f"rows: index {int(idx.min() if idx.min() < 0 else idx.max())} outside "
                    f"0..{n - 1}; give source row numbers of the data"
                )
            if np.unique(idx).size != idx.size:
                raise InputError("rows: the index array has duplicates; give each row once")
            mask = np.zeros(n, dtype=bool)
            mask[idx] = True
            stored = np.flatnonzero(mask[source])
        else:
            raise InputError(
                f"rows={rows!r:.60}: expected a boolean mask, an integer index array or "
                f"{{obs column: value}}, got {type(rows).__name__}"
            )
    if stored.size == 0:
        raise InputError("rows: selects no row; check the mask, indices or obs filter")
    return stored.astype(np.int64)
