"""Layout specs: the JSON that ``sclayout recommend`` writes.

Both ``sclayout convert --spec`` and :class:`loader.BlockDataset` accept it.

A spec has two halves: how to lay the store out (:class:`StoreSpec`) and how to read
it (:class:`LoaderSettings`). ``predicted`` carries the cost model's figures for the
pick, for the record; readers ignore it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loader.errors import FormatVersionError, SpecError
from loader.layout import RowOrder, parse_block_size
from loader.strategies import strategies

__all__ = ["SPEC_FORMAT", "SPEC_VERSION", "LayoutSpec", "LoaderSettings", "StoreSpec"]

SPEC_FORMAT = "sclayout-spec"
SPEC_VERSION = 1


def _positive_or_none(value: Any, name: str) -> int | None:
    return None if value is None else parse_block_size(value, name=name)


@dataclass(frozen=True)
class StoreSpec:
    """How ``convert`` lays a store out.

    Parameters
    ----------
    block_size
        Rows per block, the unit the loader samples.
    order
        Row order of the store.
    codec
        Codec name (``blosc-lz4``, ``blosc-lz4hc``, ``blosc-zstd``, ``zstd``, ``gzip``,
        ``none``).
    chunk_blocks
        Dense arrays: blocks per chunk along rows.
    csr_chunk_nnz
        CSR ``data``/``indices``: elements per inner chunk; ``None`` derives it from
        the nnz of a typical block.
    shard_chunks
        Inner chunks per shard; ``None`` derives it from a target shard size.
    """

    block_size: int
    order: RowOrder = field(default_factory=RowOrder)
    codec: str = "blosc-lz4"
    chunk_blocks: int = 1
    csr_chunk_nnz: int | None = None
    shard_chunks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", parse_block_size(self.block_size))
        object.__setattr__(
            self, "chunk_blocks", parse_block_size(self.chunk_blocks, name="chunk_blocks")
        )
        object.__setattr__(
            self, "csr_chunk_nnz", _positive_or_none(self.csr_chunk_nnz, "csr_chunk_nnz")
        )
        object.__setattr__(
            self, "shard_chunks", _positive_or_none(self.shard_chunks, "shard_chunks")
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the store settings as the JSON-ready dict of a spec."""
        return {
            "block_size": self.block_size,
            "order": self.order.to_dict(),
            "codec": self.codec,
            "chunk_blocks": self.chunk_blocks,
            "csr_chunk_nnz": self.csr_chunk_nnz,
            "shard_chunks": self.shard_chunks,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreSpec:
        """Return the store settings in ``d``; an unknown key is a :class:`SpecError`."""
        known = {"block_size", "order", "codec", "chunk_blocks", "csr_chunk_nnz", "shard_chunks"}
        unknown = set(d) - known
        if unknown:
            raise SpecError(
                f"store spec has unknown keys {sorted(unknown)}; known: {sorted(known)}"
            )
        if "block_size" not in d:
            raise SpecError("store spec lacks 'block_size'")
        kw = dict(d)
        kw["order"] = RowOrder.from_dict(d.get("order", {"kind": "original"}))
        return cls(**kw)


@dataclass(frozen=True)
class LoaderSettings:
    """How :class:`loader.BlockDataset` reads a store."""

    batch_size: int = 64
    fetch_factor: int = 16
    num_workers: int = 0
    strategy: str = "block_shuffle"
    backend: str = "tensorstore"

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", parse_block_size(self.batch_size, name="batch_size"))
        object.__setattr__(
            self, "fetch_factor", parse_block_size(self.fetch_factor, name="fetch_factor")
        )
        if (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 0
        ):
            raise SpecError(f"num_workers={self.num_workers!r}: must be an integer >= 0")
        known = strategies()  # the registry BlockDataset samples with, not a copy of it
        if self.strategy not in known:
            raise SpecError(f"strategy={self.strategy!r}: unknown; known: {', '.join(known)}")

    def to_dict(self) -> dict[str, Any]:
        """Return the loader settings as the JSON-ready dict of a spec."""
        return {
            "batch_size": self.batch_size,
            "fetch_factor": self.fetch_factor,
            "num_workers": self.num_workers,
            "strategy": self.strategy,
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoaderSettings:
        """Return the loader settings in ``d``; an unknown key is a :class:`SpecError`."""
        known = {"batch_size", "fetch_factor", "num_workers", "strategy", "backend"}
        unknown = set(d) - known
        if unknown:
            raise SpecError(
                f"loader settings have unknown keys {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**d)


@dataclass(frozen=True)
class LayoutSpec:
    """A store layout plus the loader settings to read it with."""

    store: StoreSpec
    loader: LoaderSettings = field(default_factory=LoaderSettings)
    predicted: Mapping[str, Any] = field(default_factory=dict)

    def with_store(self, **changes: Any) -> LayoutSpec:
        """Return a copy of the spec with the store settings ``changes``."""
        return replace(self, store=replace(self.store, **changes))

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as its JSON-ready dict, with format and version."""
        return {
            "format": SPEC_FORMAT,
            "version": SPEC_VERSION,
            "store": self.store.to_dict(),
            "loader": self.loader.to_dict(),
            "predicted": dict(self.predicted),
        }

    @classmethod
    def from_dict(cls, d: Any) -> LayoutSpec:
        """Return the spec in ``d``; anything that is not a layout spec is a :class:`SpecError`."""
        if not isinstance(d, Mapping) or d.get("format") != SPEC_FORMAT:
            raise SpecError(
                'not a layout spec (no "format": "sclayout-spec"); '
                "write one with `sclayout recommend --spec-out FILE`"
            )
        if d.get("version") != SPEC_VERSION:
            raise FormatVersionError(
                f"layout spec version {d.get('version')!r} is not readable by this sclayout "
                f"(reads version {SPEC_VERSION}): upgrade with `pip install -U sclayout`"
            )
        if "store" not in d:
            raise SpecError("layout spec lacks 'store'")
        for key in ("store", "loader", "predicted"):
            if key in d and not isinstance(d[key], Mapping):
                raise SpecError(
                    f"layout spec {key!r} is {type(d[key]).__name__}, not an object "
                    '({"key": value, ...}); rewrite it with `sclayout recommend --spec-out FILE`'
                )
        return cls(
            store=StoreSpec.from_dict(d["store"]),
            loader=LoaderSettings.from_dict(d.get("loader", {})),
            predicted=dict(d.get("predicted", {})),
        )

    def save(self, path: str | Path) -> None:
        """Write the spec as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayoutSpec:
        """Read the spec in the JSON file ``path``; an unreadable file is a :class:`SpecError`."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise SpecError(f"cannot read layout spec {p}: {e.strerror}; check the path") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(
                f"layout spec {p} is not valid JSON ({e.msg} at line {e.lineno})"
            ) from None
        return cls.from_dict(data)
