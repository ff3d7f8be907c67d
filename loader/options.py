"""The option groups of :class:`loader.BlockDataset`: small frozen objects.

A dataset's settings come in four groups, each of which checks itself when it is made,
so that a wrong value is a one-line :class:`~loader.errors.InputError` before any store
is opened:

- :class:`Sampling`: which rows an epoch draws, in what order (strategy, seed, weights);
- :class:`Selection`: what a batch holds (obs columns, rows, a gene panel, extra elements);
- :class:`Output`: the form of a batch (dense or CSR, dtype, a transform);
- :class:`Reading`: how the store is read (fetch size, block size, backend, read-ahead).

::

    BlockDataset(path, batch_size=64, sampling=Sampling(strategy="weighted", weights=w))

Every field is also a keyword of ``BlockDataset`` itself (``seed=3`` is
``sampling=Sampling(seed=3)``; ``output="csr"`` is ``output=Output(format="csr")``);
giving a field both ways is an error. Importing this module is cheap: the checks that
need numpy import it when an option object is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loader.errors import InputError

__all__ = [
    "DEFAULT_FETCH_FACTOR",
    "DEFAULT_PREFETCH",
    "DTYPES",
    "OUTPUTS",
    "TORCH_HINT",
    "Output",
    "Reading",
    "Sampling",
    "Selection",
    "gather",
    "torch_available",
]

DEFAULT_FETCH_FACTOR = 64
"""Minibatches per fetch when neither the caller nor a spec says. Large enough that a
fetch's fixed costs (its plan, the decoders' messages, its assembly) and the hand-offs
between the training loop and the decoders are small beside its decoding, so that a
second core speeds the loader up nearly twice; the same on every machine, so that a
seed gives the same minibatches whatever the cores (docs/design.md, "Fetch size")."""

DEFAULT_PREFETCH = 2
"""Fetches in flight ahead of the one consumed. Two keep the pipeline full: while the
consumer cuts fetch ``n``, fetch ``n+1`` is assembled and ``n+2`` read and decoded;
more only add memory (docs/design.md, "Read-ahead")."""

OUTPUTS = ("dense", "csr")
"""The formats of ``X`` in a batch."""

DTYPES = ("float32", "float16", "bfloat16")
"""The value types ``X`` can be delivered in."""

TORCH_HINT = "pip install sclayout[torch]"


def _set(obj: Any, name: str, value: Any) -> None:
    """Store a normalised field value on a frozen option object."""
    object.__setattr__(obj, name, value)


def _check_types(obj: Any, own_checks: tuple[str, ...] = ()) -> None:
    from loader.argtypes import check_fields

    check_fields(obj, own_checks=own_checks)


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    """Return a name or a sequence of names as a tuple of names."""
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True, eq=False)  # eq=False: weights may be an array
class Sampling:
    """Which rows an epoch draws, and in what order.

    Parameters
    ----------
    strategy
        ``block_shuffle`` (default), ``streaming``, ``weighted``, ``class_balanced``
        (see :func:`loader.advanced.strategies`); ``None``: the spec's, else
        ``block_shuffle`` (``weighted`` with ``store_weights``).
    seed
        Root seed; the order is a pure function of seed, epoch, rank and worker.
    weights
        ``weighted``: one weight per row, in *source* row order (as in the original
        AnnData), or a mapping ``{category: weight}`` of ``class_column``.
    class_column
        obs column whose classes ``class_balanced`` balances (weights ``1/frequency``),
        or whose categories a ``weights`` mapping names.
    replacement
        Weighted strategies: draw blocks (and rows within them) with replacement, so
        that every row's expected frequency is proportional to its weight (default);
        ``False``: each row at most once, blocks drawn in weighted random order, all
        rows of a drawn block delivered (weights then act per block, approximately).
    num_samples
        Rows per epoch for weighted strategies (default: the number of rows).
    store_weights
        With a list of inputs: one weight per input; an epoch then draws each input's
        rows in proportion to its weight (strategy ``weighted``, by default).
    drop_last
        Drop each rank's incomplete last minibatch, and the ``n % world_size`` rows
        that do not divide across ranks; otherwise those are padded by repeating the
        first rows of the epoch (like ``DistributedSampler``).
    """

    strategy: str | None = None
    seed: int = 0
    weights: Any = None
    class_column: str | None = None
    replacement: bool = True
    num_samples: int | None = None
    store_weights: Sequence[float] | None = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        _check_types(self, own_checks=("num_samples",))
        if self.strategy is not None:
            from loader.strategies import get_strategy

            get_strategy(self.strategy)
        if self.seed < 0:
            raise InputError(f"seed={self.seed!r}: must be a non-negative integer")
        _set(self, "seed", int(self.seed))
        if self.num_samples is not None:
            from loader.layout import parse_block_size

            _set(self, "num_samples", parse_block_size(self.num_samples, name="num_samples"))
        if self.store_weights is not None and self.weights is not None:
            raise InputError("store_weights= and weights= together: give one of them")
        _set(self, "replacement", bool(self.replacement))
        _set(self, "drop_last", bool(self.drop_last))


@dataclass(frozen=True, eq=False)  # eq=False: rows may be an array
class Selection:
    """What a batch holds: which obs columns, rows, genes and elements.

    Parameters
    ----------
    obs
        obs columns delivered as int64 codes (categories in ``ds.categories``).
    rows
        Only these rows: a boolean mask or an index array over the source rows, or an
        obs filter ``{column: value or [values]}``. Blocks keep their selected rows
        (trimmed, not dropped); exactly-once, resume and DDP hold on the subset.
    var_names
        A gene panel (a list, a pandas Index or a text file with one name per line):
        ``X`` has these columns in this order, genes absent from the data are zeros.
        Stores of a list may then have different var.
    extra
        More row-aligned elements delivered in each batch under their name, e.g.
        ``("layers/counts", "obsm/X_pca")`` (same output format as X, float32; with
        workers, minibatches then travel one by one).
    matrix
        ``"X"`` or a layer (``"layers/counts"``): the matrix delivered as ``X``.
    """

    obs: Sequence[str] = ()
    rows: Any = None
    var_names: Any = None
    extra: Sequence[str] = ()
    matrix: str = "X"

    def __post_init__(self) -> None:
        _check_types(self)
        _set(self, "obs", _names(self.obs))
        _set(self, "extra", _names(self.extra))

    @property
    def stacked(self) -> bool:
        """Whether these rows, genes or elements need a reader stacked over the input."""
        return bool(self.extra) or self.var_names is not None or self.rows is not None


@dataclass(frozen=True)
class Output:
    """The form of a batch.

    Parameters
    ----------
    format
        ``"dense"`` (float32) or ``"csr"`` (torch sparse CSR / scipy CSR, float32);
        the keyword ``output="csr"`` of ``BlockDataset`` is this.
    dtype
        Values of ``X`` as ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``
        (torch needed; numpy has no bfloat16); also a numpy or torch dtype.
    transform
        A callable applied to each batch dict (after ``dtype``), where the batch is
        made: in the DataLoader worker when there are workers, so it must then be
        picklable (a module-level function or a picklable object). With workers, a
        transform makes each worker send its minibatches one by one instead of in
        groups.
    """

    format: str = "dense"
    dtype: Any = "float32"
    transform: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.transform is not None and not callable(self.transform):
            raise InputError(
                f"transform={self.transform!r}: must be a callable taking and returning "
                "the batch dict"
            )
        _check_types(self)
        if self.format not in OUTPUTS:
            raise InputError(f"output={self.format!r}: unknown; known: {', '.join(OUTPUTS)}")
        _set(self, "dtype", _dtype_name(self.dtype))


def _dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"float16"`` or ``"bfloat16"`` from a name, a numpy or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        import numpy as np

        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in DTYPES:
        raise InputError(f"dtype={dtype!r}: unknown; known: {', '.join(DTYPES)}")
    if name == "bfloat16" and not torch_available():
        raise InputError(f"dtype='bfloat16' needs torch (numpy has none): {TORCH_HINT}")
    return name


def torch_available() -> bool:
    """Whether torch can be imported (without importing it if it was not yet)."""
    if "torch" in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@dataclass(frozen=True)
class Reading:
    """How the store is read: fetch size, block size, backend and read-ahead.

    Parameters
    ----------
    fetch_factor
        Minibatches per fetch (default: the spec's, else :data:`DEFAULT_FETCH_FACTOR`).
        Rows are shuffled within a fetch of about ``fetch_factor × batch_size`` rows.
    block_size
        Rows per block; ``None``: the spec's, else the store's (a store reads any
        multiple of its own; an in-memory AnnData is cut into blocks of 64 rows).
    backend
        Reader backend (``"tensorstore"``, ``"zarr"``; ``.h5ad`` always uses h5py);
        ``None``: the spec's, else ``"tensorstore"``.
    prefetch
        Fetches kept in flight ahead of the one being consumed (0: no read-ahead;
        default :data:`DEFAULT_PREFETCH`).
    prefetch_next_epoch
        Go on reading ahead past an epoch's end: the next epoch's first ``prefetch``
        fetches are read while this epoch's last one is consumed, so that an epoch does
        not begin by waiting for a read (in the process that iterates, without
        DataLoader workers). After the last epoch those fetches stay read for nothing
        until the dataset is dropped; ``False`` for a dataset read once.
    cache_dir, cache_limit
        For a remote store (``s3://``, ``gs://``, ``http(s)://``): a folder on the node
        that all its processes share, into which each shard is downloaded once and
        then read from local disk; ``cache_limit``: the bytes (``"200GB"``) it may
        hold, the least recently used shards deleted first (``loader.cache``).
    """

    fetch_factor: int | None = None
    block_size: int | None = None
    backend: str | None = None
    prefetch: int = DEFAULT_PREFETCH
    prefetch_next_epoch: bool = True
    cache_dir: Any = None
    cache_limit: Any = None

    @property
    def cache(self) -> dict[str, Any]:
        """The shard cache's arguments of :func:`loader.open_layout` (none without a folder)."""
        if self.cache_dir is None:
            return {}
        return {"cache_dir": self.cache_dir, "cache_limit": self.cache_limit}

    def __post_init__(self) -> None:
        _check_types(self, own_checks=("fetch_factor", "block_size", "prefetch"))
        from loader.layout import parse_block_size

        for name in ("fetch_factor", "block_size"):
            value = getattr(self, name)
            if value is not None:
                _set(self, name, parse_block_size(value, name=name))
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise InputError(f"prefetch={p!r}: must be an integer >= 0")
        _set(self, "prefetch_next_epoch", bool(self.prefetch_next_epoch))


GROUPS: dict[str, type] = {
    "sampling": Sampling,
    "selection": Selection,
    "output": Output,
    "reading": Reading,
}
"""``BlockDataset``'s keyword of each option group, and the group's class."""

FLAT: dict[str, str] = {
    f.name: key
    for key, cls in GROUPS.items()
    for f in dataclasses.fields(cls)
    if (key, f.name) != ("output", "format")  # that one is ``output="csr"``
}
"""Each field that is also a keyword of ``BlockDataset``, and its group's keyword."""


def gather(
    flat: dict[str, Any], groups: dict[str, Any], owner: str, others: Sequence[str] = ()
) -> dict[str, Any]:
    """Return ``{group keyword: option object}`` for all four groups.

    ``groups`` holds the option objects given (``None`` where not; ``output`` may be a
    format name) and ``flat`` the fields given as keywords of their own; a group is made
    from those, or is the one given, never both. ``others``: the owner's other keywords,
    which an unknown keyword may be a misspelling of.
    """
    for name in flat:
        if name not in FLAT:
            close = difflib.get_close_matches(name, [*FLAT, *GROUPS, *others], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InputError(
                f"{owner}: got an unexpected keyword argument {name!r}{hint}; see help({owner})"
            )
    out = {}
    for key, cls in GROUPS.items():
        given = groups.get(key)
        fields = {name: v for name, v in flat.items() if FLAT[name] == key}
        if isinstance(given, str):  # output="csr"
            fields, given = {"format": given, **fields}, None
        if given is None:
            out[key] = cls(**fields)
        elif fields:
            name = next(iter(fields))
            raise InputError(
                f"{name}= and {key}={cls.__name__}(...) together: give {name} inside "
                f"{cls.__name__}({name}=...) or as a keyword of its own, not both"
            )
        else:
            out[key] = given
    return out
