"""The layout store format: its versioned manifest and the block -> row map.

A layout store is an AnnData zarr v3 store (``anndata.read_zarr`` opens it) whose
root attribute ``"sclayout"`` holds the manifest below. The manifest is written
last by the converter: a store without it is not a layout store.

Format version 1
----------------
Root attribute ``sclayout``::

    {"format": "sclayout-layout", "version": 1, "tool_version": "0.1.0",
     "n_obs": ..., "n_vars": ..., "block_size": ...,
     "order": {"kind": "original"|"shuffled"|"stratified"|"grouped", "seed": ...,
               "columns": [...]},
     "matrices": {"X": {"encoding": "csr"|"dense", "shape": [n_obs, n_vars],
                        "dtype": "float32", "nnz": ...,
                        "block_pointer": "uns/sclayout/block_indptr/X" | null,
                        "arrays": {"data": {"path": "X/data", "shape": [...],
                                             "dtype": ..., "chunks": [...],
                                             "shards": [...] | null,
                                             "codec": "blosc-lz4"}, ...}},
                  "layers/counts": {...}},
     "source_index": "uns/sclayout/source_index",
     "source": {fingerprint of the source file},
     "created": ISO-8601 time}

Format version 2
----------------
Version 1 plus two integrity fields (``docs/store-format.md`` has the contract)::

    {..., "version": 2, "chunk_checksum": "crc32c", "all_chunks_stored": true}

``chunk_checksum``: every inner chunk of every array the converter wrote ends with
this checksum (zarr v3's ``crc32c`` codec), so every reader verifies it.
``all_chunks_stored``: every chunk of every array the manifest names exists, even one
equal to the fill value, so a missing chunk or shard is damage, never zeros.

``source_index`` (int64, one per stored row) is the original row position of each
stored row. For a CSR matrix the *block pointer* (int64, ``n_blocks + 1``) is the
``indptr`` value at every block boundary, so a reader finds a block's nnz range
without loading the whole ``indptr``.

Format version 2
----------------
Version 1 plus optional keys (a version-1 manifest reads as version 2 without them):
``sources`` (one entry per source, in order: ``name``, ``row0``, ``n_obs``, ``n_vars``,
``genes_present``, ``fingerprint``), ``genes`` (``join``, ``n_vars``,
``var_conflicts``), ``provenance`` (paths of the per-row ``source_number`` and
``source_row`` arrays, several sources only) and ``notes``. With several sources
``source_index`` counts rows of the sources' concatenation in the given order.

Format version 3
----------------
Version 2 plus a generation id, written by every conversion::

    {..., "version": 3, "generation": "9f0c..."}   # a fresh uuid4 hex

Two conversions never share a generation, so a reader that recorded it when a job
opened the store can tell that the store at the same path was replaced since (every
process of a job checks, see docs/store-format.md). Versions 1 and 2 have none: their
readers compare :attr:`Manifest.identity`, a digest of the whole manifest instead.

docs/store-format.md describes every version.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from loader.errors import FormatVersionError, NotALayoutStoreError, SpecError

__all__ = [
    "CHUNK_CHECKSUMS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_KEY",
    "ORDER_KINDS",
    "SCLAYOUT_UNS",
    "ArrayLayout",
    "Manifest",
    "MatrixLayout",
    "RowOrder",
    "block_pointer_path",
    "block_rows",
    "parse_block_size",
    "row_chunk_rows",
    "source_rows",
]

FORMAT = "sclayout-layout"
FORMAT_VERSION = 3
"""Version of the manifest this package writes and the newest it reads (1 and 2 still
read)."""
CHUNK_CHECKSUMS = ("crc32c",)
"""Chunk checksums a version-2 manifest may name (zarr v3 codecs every reader has)."""
MANIFEST_KEY = "sclayout"
"""Root attribute holding the manifest."""
SCLAYOUT_UNS = "uns/sclayout"
"""Group holding sclayout's own arrays. It lives under ``uns`` because anndata's
reader passes every other root key to the ``AnnData`` constructor."""
ORDER_KINDS = ("original", "shuffled", "stratified", "grouped")
ENCODINGS = ("csr", "dense")

_TOOL_VERSION = "0.1.0"


MAX_COUNT = 2**40
"""Largest block size, batch size, fetch factor or sample count accepted (rows are
counted in int64; 2**40 rows is far beyond any dataset)."""


def parse_block_size(value: Any, *, name: str = "block_size") -> int:
    """Validate a block size (or any positive integer knob) and return it as ``int``."""
    # numbers.Integral: int and numpy's integers (bool is one too: refused)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | float | str):
        raise SpecError(f"{name}={value!r}: must be a positive integer")
    if isinstance(value, numbers.Integral):
        value = int(value)
    try:
        as_float = float(value)
    except ValueError:
        raise SpecError(f"{name}={value!r}: must be a positive integer") from None
    if not math.isfinite(as_float) or as_float != int(as_float):
        raise SpecError(f"{name}={value!r}: must be a positive integer")
    if int(as_float) <= 0:
        raise SpecError(f"{name}={value!r}: must be a positive integer")
    if int(as_float) > MAX_COUNT:
        raise SpecError(f"{name}={value!r}: must be at most 2**40")
    return int(as_float)


ROW_CHUNK_MIN_ROWS = 256
"""Fewest rows in an inner chunk of a per-row table (``indptr``, the source index and
provenance) of format version 3: a reader keeps 16 bytes of shard index per inner
chunk, so chunks of a few blocks keep that small while a block still decodes 2 KiB."""


def row_chunk_rows(block_size: int) -> int:
    """Rows per inner chunk of a per-row table of a store with blocks of ``block_size``.

    Whole blocks, at least :data:`ROW_CHUNK_MIN_ROWS` rows: a block's rows then lie in
    one inner chunk, so a fetch reads only its blocks' chunks (version 3).
    """
    return block_size * max(1, -(-ROW_CHUNK_MIN_ROWS // block_size))


def block_pointer_path(matrix: str) -> str:
    """Where the block pointer of ``matrix`` ("X", "layers/counts") is stored."""
    return f"{SCLAYOUT_UNS}/block_indptr/{matrix.replace('/', '__')}"


@dataclass(frozen=True)
class ArrayLayout:
    """One zarr array of the store: where it is and how it is chunked."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None
    codec: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "chunks", tuple(int(c) for c in self.chunks))
        if self.shards is not None:
            object.__setattr__(self, "shards", tuple(int(s) for s in self.shards))
        if len(self.chunks) != len(self.shape):
            raise SpecError(
                f"array {self.path}: chunks {self.chunks} do not match shape {self.shape}"
            )
        if any(c <= 0 for c in self.chunks):
            raise SpecError(f"array {self.path}: chunks {self.chunks} must be positive")
        if self.shards is not None:
            if len(self.shards) != len(self.shape) or any(
                s % c for s, c in zip(self.shards, self.chunks, strict=True)
            ):
                raise SpecError(
                    f"array {self.path}: shards {self.shards} must be whole multiples "
                    f"of chunks {self.chunks}"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArrayLayout:
        """Return the array layout described by ``d``, a manifest entry."""
        shards = d.get("shards")
        return cls(
            path=str(d["path"]),
            shape=tuple(d["shape"]),
            dtype=str(d["dtype"]),
            chunks=tuple(d["chunks"]),
            shards=None if shards is None else tuple(shards),
            codec=str(d["codec"]),
        )


@dataclass(frozen=True)
class MatrixLayout:
    """A row-aligned matrix (X or a layer), CSR or dense, and its arrays.

    ``arrays`` holds ``data``, ``indices``, ``indptr`` for CSR and ``values`` for
    dense.
    """

    encoding: str
    shape: tuple[int, int]
    dtype: str
    nnz: int
    arrays: Mapping[str, ArrayLayout]
    block_pointer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.encoding not in ENCODINGS:
            raise SpecError(
                f"matrix encoding={self.encoding!r}: unknown; known: {', '.join(ENCODINGS)}"
            )
        need = ("data", "indices", "indptr") if self.encoding == "csr" else ("values",)
        missing = [k for k in need if k not in self.arrays]
        if missing:
            raise SpecError(f"{self.encoding} matrix lacks arrays {missing}")
        if self.encoding == "csr" and self.block_pointer is None:
            raise SpecError("a csr matrix needs a block_pointer array")

    @property
    def is_csr(self) -> bool:
        """Whether the matrix is stored as CSR (else dense)."""
        return self.encoding == "csr"

    def to_dict(self) -> dict[str, Any]:
        """Return the matrix layout as its manifest entry (JSON-ready)."""
        return {
            "encoding": self.encoding,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nnz": int(self.nnz),
            "block_pointer": self.block_pointer,
            "arrays": {k: _array_to_dict(a) for k, a in self.arrays.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MatrixLayout:
        """Return the matrix layout described by ``d``, a manifest entry."""
        return cls(
            encoding=str(d["encoding"]),
            shape=tuple(d["shape"]),
            dtype=str(d["dtype"]),
            nnz=int(d["nnz"]),
            arrays={k: ArrayLayout.from_dict(a) for k, a in d["arrays"].items()},
            block_pointer=d.get("block_pointer"),
        )


def _array_to_dict(a: ArrayLayout) -> dict[str, Any]:
    d = asdict(a)
    d["shape"] = list(a.shape)
    d["chunks"] = list(a.chunks)
    d["shards"] = None if a.shards is None else list(a.shards)
    return d


@dataclass(frozen=True)
class RowOrder:
    """How stored rows relate to source rows."""

    kind: str = "original"
    seed: int | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        if self.kind not in ORDER_KINDS:
            raise SpecError(f"order={self.kind!r}: unknown; known: {', '.join(ORDER_KINDS)}")
        if self.kind in ("stratified", "grouped") and not self.columns:
            raise SpecError(f"order={self.kind!r} needs at least one obs column (--by COL)")

    def to_dict(self) -> dict[str, Any]:
        """Return the row order as its manifest entry (JSON-ready)."""
        return {"kind": self.kind, "seed": self.seed, "columns": list(self.columns)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RowOrder:
        """Return the row order described by ``d``; a malformed one is a :class:`SpecError`."""
        form = (
            '{"kind": "original"|"shuffled"|"stratified"|"grouped", "seed": int, '
            '"columns": [names]}'
        )
        if not isinstance(d, Mapping) or "kind" not in d:
            raise SpecError(f"order={d!r}: must be an object {form}")
        columns = d.get("columns", ())
        if not isinstance(columns, list | tuple) or not all(isinstance(c, str) for c in columns):
            raise SpecError(f"order columns={columns!r}: must be a list of obs column names")
        return cls(kind=d["kind"], seed=d.get("seed"), columns=tuple(columns))


@dataclass(frozen=True)
class Manifest:
    """The versioned description of a layout store (root attribute ``sclayout``)."""

    n_obs: int
    n_vars: int
    block_size: int
    order: RowOrder
    matrices: Mapping[str, MatrixLayout]
    source: Mapping[str, Any] = field(default_factory=dict)
    source_index: str = f"{SCLAYOUT_UNS}/source_index"
    tool_version: str = _TOOL_VERSION
    created: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION
    chunk_checksum: str | None = None
    """``"crc32c"``: every inner chunk ends with its checksum (version 2); ``None``:
    chunks carry none (version 1, read without chunk checks)."""
    all_chunks_stored: bool = False
    """Every chunk of every listed array exists (version 2): an absent one is damage."""
    sources: tuple[Mapping[str, Any], ...] = ()
    """Version 2: the sources in order (name, row0, n_obs, n_vars, genes_present,
    fingerprint); empty for a version-1 store (its one source is ``source``)."""
    genes: Mapping[str, Any] = field(default_factory=dict)
    """Version 2: how the store's genes were chosen (join, n_vars, var_conflicts)."""
    provenance: Mapping[str, str] = field(default_factory=dict)
    """Version 2, several sources: paths of the per-row source_number and source_row."""
    notes: tuple[str, ...] = ()
    """Version 2: what the conversion left out or changed (dropped elements, upcasts)."""
    generation: str | None = None
    """Version 3: the id of the conversion that wrote the store (a fresh uuid4 hex each
    time); ``None`` for versions 1 and 2."""
    row_chunks: int = 0
    """Version 3: rows per inner chunk of the per-row tables (``indptr``, the source
    index, provenance), sharded and checksummed like X, so a fetch reads only its
    blocks' chunks (:func:`row_chunk_rows`); ``0``: tables in the earlier layout
    (versions 1 and 2: ``indptr`` in chunks of 8,192 rows, the others whole)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", parse_block_size(self.block_size))
        if self.chunk_checksum is not None and self.chunk_checksum not in CHUNK_CHECKSUMS:
            raise FormatVersionError(
                f"chunk_checksum={self.chunk_checksum!r} is not known to sclayout "
                f"{_TOOL_VERSION}; upgrade with `pip install -U sclayout`"
            )
        if self.row_chunks < 0:
            raise SpecError(f"row_chunks={self.row_chunks}: must be >= 0")
        if self.n_obs < 0 or self.n_vars < 0:
            raise SpecError(f"n_obs={self.n_obs}, n_vars={self.n_vars}: must be >= 0")
        if "X" not in self.matrices:
            raise SpecError("manifest lists no matrix 'X'")
        for name, m in self.matrices.items():
            if m.shape[0] != self.n_obs:
                raise SpecError(f"matrix {name} has {m.shape[0]} rows, manifest n_obs={self.n_obs}")

    @property
    def n_blocks(self) -> int:
        """Number of blocks, the last one possibly short."""
        return -(-self.n_obs // self.block_size)

    @property
    def identity(self) -> str:
        """What tells this store apart from a later conversion into the same place.

        The generation (version 3), else a digest of the whole manifest (versions 1
        and 2: it holds the creation time to the second and the sources' fingerprints).
        """
        if self.generation:
            return self.generation
        text = json.dumps(self.to_dict(), sort_keys=True).encode()
        return "manifest-" + hashlib.sha256(text).hexdigest()[:16]

    @property
    def X(self) -> MatrixLayout:
        """Layout of the main matrix ``X``."""
        return self.matrices["X"]

    def to_dict(self) -> dict[str, Any]:
        """Return the manifest as the JSON-ready dict stored in the root ``zarr.json``."""
        version_2 = (  # what version 2 added; a version-1 manifest round-trips as it was
            {
                "chunk_checksum": self.chunk_checksum,
                "all_chunks_stored": self.all_chunks_stored,
                "sources": [dict(x) for x in self.sources],
                "genes": dict(self.genes),
                "provenance": dict(self.provenance),
                "notes": list(self.notes),
            }
            if self.version >= 2
            else {}
        )
        version_3 = {"generation": self.generation} if self.version >= 3 else {}
        if self.row_chunks:
            version_3["row_chunks"] = int(self.row_chunks)
        return {
            **version_2,
            **version_3,
            "format": self.format,
            "version": self.version,
            "tool_version": self.tool_version,
            "created": self.created,
            "n_obs": int(self.n_obs),
            "n_vars": int(self.n_vars),
            "block_size": int(self.block_size),
            "order": self.order.to_dict(),
            "matrices": {k: m.to_dict() for k, m in self.matrices.items()},
            "source_index": self.source_index,
            "source": dict(self.source),
        }

    def to_json(self) -> str:
        """Return the manifest as JSON text (sorted keys, so it is stable)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """Return the manifest in ``d``; anything else is a :class:`NotALayoutStoreError`."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise NotALayoutStoreError(
                "no sclayout manifest: this is not a layout store "
                "(convert it with `sclayout convert SRC DST`)"
            )
        version = d.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise FormatVersionError(
                f"layout store format version {version!r} is not readable by sclayout "
                f"{_TOOL_VERSION} (reads versions 1 to {FORMAT_VERSION}); the store was written by "
                f"sclayout {d.get('tool_version', '?')}: upgrade with "
                "`pip install -U sclayout`"
            )
        try:
            return cls(
                format=d["format"],
                version=version,
                tool_version=str(d.get("tool_version", "")),
                created=str(d.get("created", "")),
                n_obs=int(d["n_obs"]),
                n_vars=int(d["n_vars"]),
                block_size=d["block_size"],
                order=RowOrder.from_dict(d["order"]),
                matrices={k: MatrixLayout.from_dict(m) for k, m in d["matrices"].items()},
                source_index=str(d.get("source_index", f"{SCLAYOUT_UNS}/source_index")),
                source=dict(d.get("source", {})),
                chunk_checksum=d.get("chunk_checksum") if version >= 2 else None,
                all_chunks_stored=bool(d.get("all_chunks_stored")) if version >= 2 else False,
                sources=tuple(dict(x) for x in d.get("sources", ())),
                genes=dict(d.get("genes", {})),
                provenance={str(k): str(v) for k, v in d.get("provenance", {}).items()},
                notes=tuple(str(n) for n in d.get("notes", ())),
                generation=_generation(d.get("generation")) if version >= 3 else None,
                row_chunks=int(d.get("row_chunks", 0)) if version >= 3 else 0,
            )
        except (KeyError, TypeError) as e:
            raise NotALayoutStoreError(
                f"sclayout manifest is incomplete (missing {e}); reconvert the store "
                "with `sclayout convert --overwrite`"
            ) from None

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Return the manifest in the JSON ``text``."""
        return cls.from_dict(json.loads(text))


def _generation(value: Any) -> str | None:
    """Return a manifest's generation: a non-empty string, or ``None`` (absent)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"generation={value!r}")
    return value


def source_rows(manifest: Manifest, index: Any) -> tuple[list[str], Any]:
    """Map a batch's ``index`` (rows of the sources' concatenation) to (file, row).

    Returns the source path of every index and its row within that source (int64).
    Pure: needs only the manifest, so a training loop can call it per batch.
    """
    import numpy as np

    idx = np.asarray(index, dtype=np.int64)
    entries = list(manifest.sources) or [{"row0": 0, "fingerprint": dict(manifest.source)}]
    starts = np.array([int(e["row0"]) for e in entries], dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= manifest.n_obs):
        raise IndexError(f"index out of range for a store of {manifest.n_obs} rows")
    number = np.searchsorted(starts, idx, side="right") - 1
    paths = [str(e.get("fingerprint", {}).get("path", e.get("name", ""))) for e in entries]
    return [paths[k] for k in number.tolist()], idx - starts[number]


def block_rows(block: int, *, block_size: int, n_obs: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` of block number ``block``."""
    start = block * block_size
    if block < 0 or start >= n_obs:
        raise IndexError(f"block {block} out of range for {n_obs} rows of block_size {block_size}")
    return start, min(start + block_size, n_obs)
