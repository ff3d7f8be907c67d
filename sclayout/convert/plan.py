"""Pure chunk and shard choice for the arrays of a layout store (no I/O).

A *plan* says, for one row-aligned matrix, the chunk and shard shape of each of its
zarr arrays. Dense chunks hold whole blocks; CSR ``data``/``indices`` inner chunks
are sized from the nnz of a typical block; inner chunks are grouped into shards so
that the number of files stays in the thousands at 10^8 cells (docs/design.md,
"Blocks, chunks and shards").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loader.argtypes import typechecked
from loader.errors import InputError
from loader.layout import row_chunk_rows

__all__ = [
    "CSR_CHUNK_NNZ_MIN",
    "DEFAULT_BLOCK_SIZE",
    "DENSE_CHUNK_MAX_BYTES",
    "SHARD_BYTES_MAX",
    "ArrayPlan",
    "MatrixPlan",
    "parse_memory_budget",
    "plan_csr",
    "plan_dense",
    "plan_row_table",
    "shard_bytes_for_budget",
]

DEFAULT_BLOCK_SIZE = 64
"""Rows per block when neither ``block_size`` nor a spec gives one. 64 rows of a
~2,000-nnz/cell dataset are ~1 MB of float32 data+indices: large enough that a random
block read is bandwidth- not latency-bound, small enough that a 16-block fetch of a
64-cell batch still mixes 16 blocks (the E[D] formula in docs/cost-model.md; scDataset's
b16/f64 setting is in the same range)."""

CSR_CHUNK_NNZ_MIN = 4096
"""Smallest CSR inner chunk (elements, 16 KiB of float32). Below this a read is pure
latency (docs/design.md, "Reads in flight"), so smaller chunks only add requests."""

DENSE_CHUNK_MAX_BYTES = 16 * 2**20
"""Largest dense chunk before the gene axis is tiled: 16 MiB keeps one chunk's decode
short at blosc-lz4 speeds and bounds a worker's buffer."""

SHARD_BYTES_MAX = 128 * 2**20
"""Largest shard (uncompressed bytes). 10^8 cells × 2,000 nnz × 4 B = 800 GB of
``data`` is ~6,000 shards: thousands of files, not millions, while a shard
written whole stays a small fraction of a 2 GB memory budget."""

SHARD_BUDGET_FRACTION = 32
"""A shard is at most ``memory_budget / 32``: a reorder task holds about five times a
shard (its bucket of data + indices, the sorted copy, the writer's buffers), two
tasks run at once, and the process itself needs a few hundred MB (``/16`` overshot a
2 GB budget; ``benchmarks/convert.py`` reports the peak RSS)."""


@typechecked(own_checks=("value",))
def parse_memory_budget(value: str | int, *, name: str = "memory_budget") -> int:
    """Bytes from a size such as ``2GB``, read by ``dask.utils.parse_bytes``.

    For example ``2GB`` (10^9), ``512MiB`` (2^20), ``1.5G``, ``1e9`` or a number of
    bytes.

    Raises
    ------
    InputError
        For anything else or a size that is not positive, naming the value and the
        accepted forms.
    """
    from dask.utils import parse_bytes

    bad = InputError(f"{name}={value!r}: not a size; use e.g. 2GB, 512MiB or a number of bytes")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise bad
    if isinstance(value, str) and value.strip()[:1] not in set("0123456789.+-"):
        raise bad  # dask reads a bare unit ("GB") as one of it
    try:
        n = int(parse_bytes(value))
    except (ValueError, TypeError):
        raise bad from None
    if n <= 0:
        raise InputError(f"{name}={value!r}: must be positive, e.g. 2GB")
    return n


def shard_bytes_for_budget(memory_budget: int) -> int:
    """Target uncompressed shard size for a memory budget (bytes)."""
    return max(1, min(SHARD_BYTES_MAX, memory_budget // SHARD_BUDGET_FRACTION))


@dataclass(frozen=True)
class ArrayPlan:
    """Chunk and shard shape of one zarr array (``shards`` None: unsharded)."""

    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None


@dataclass(frozen=True)
class MatrixPlan:
    """Arrays of one matrix: ``data``/``indices``/``indptr`` (csr) or ``values`` (dense)."""

    encoding: str
    arrays: dict[str, ArrayPlan]

    @property
    def elements_per_shard(self) -> int:
        """CSR: elements of data/indices per shard; dense: rows per shard."""
        a = self.arrays["data"] if self.encoding == "csr" else self.arrays["values"]
        return (a.shards or a.chunks)[0]


def plan_csr(
    *,
    n_obs: int,
    nnz: int,
    block_size: int,
    itemsize: int,
    shard_bytes: int,
    csr_chunk_nnz: int | None = None,
    shard_chunks: int | None = None,
) -> MatrixPlan:
    """Chunks and shards for a CSR matrix.

    Parameters
    ----------
    n_obs, nnz
        Rows and stored elements of the matrix.
    block_size
        Rows per block.
    itemsize
        Bytes per element of ``data`` (sizes the shards).
    shard_bytes
        Target uncompressed bytes per ``data`` shard.
    csr_chunk_nnz
        Elements per inner chunk; default: the nnz of a typical block (mean nnz per
        row × block_size), at least :data:`CSR_CHUNK_NNZ_MIN`. A block then touches at
        most two inner chunks and reads at most twice its size.
    shard_chunks
        Inner chunks per shard; default: as many as fit in ``shard_bytes``.
    """
    if csr_chunk_nnz is None:
        per_block = math.ceil(nnz / n_obs * block_size) if n_obs else 0
        csr_chunk_nnz = max(CSR_CHUNK_NNZ_MIN, per_block)
    n_chunks = max(1, math.ceil(nnz / csr_chunk_nnz))
    if shard_chunks is None:
        shard_chunks = max(1, shard_bytes // max(1, csr_chunk_nnz * itemsize))
    shard_chunks = min(shard_chunks, n_chunks)
    elem = ArrayPlan(chunks=(csr_chunk_nnz,), shards=(csr_chunk_nnz * shard_chunks,))
    indptr = plan_row_table(n_obs + 1, block_size=block_size, itemsize=8, shard_bytes=shard_bytes)
    return MatrixPlan(encoding="csr", arrays={"data": elem, "indices": elem, "indptr": indptr})


def plan_row_table(n_rows: int, *, block_size: int, itemsize: int, shard_bytes: int) -> ArrayPlan:
    """Chunks and shards of a per-row table (``indptr``, the source index, provenance).

    Inner chunks of :func:`loader.layout.row_chunk_rows` rows (whole blocks), so a
    reader decodes only its blocks' chunks; as many per shard as fit in ``shard_bytes``.
    """
    chunk = row_chunk_rows(block_size)
    n_chunks = max(1, math.ceil(n_rows / chunk))
    per_shard = min(n_chunks, max(1, shard_bytes // (chunk * itemsize)))
    return ArrayPlan(chunks=(chunk,), shards=(chunk * per_shard,))


def plan_dense(
    *,
    n_obs: int,
    n_vars: int,
    block_size: int,
    itemsize: int,
    shard_bytes: int,
    chunk_blocks: int = 1,
    shard_chunks: int | None = None,
) -> MatrixPlan:
    """Chunks and shards for a dense matrix: a chunk holds ``chunk_blocks`` whole blocks.

    The gene axis is tiled only when a chunk would exceed
    :data:`DENSE_CHUNK_MAX_BYTES`; a shard spans every gene tile and as many chunk
    rows as fit in ``shard_bytes``.
    """
    rows = block_size * chunk_blocks
    cols = max(1, n_vars)
    row_bytes = cols * itemsize
    n_tiles = max(1, math.ceil(rows * row_bytes / DENSE_CHUNK_MAX_BYTES))
    tile = math.ceil(cols / n_tiles)
    n_row_chunks = max(1, math.ceil(n_obs / rows))
    if shard_chunks is None:
        shard_chunks = max(1, shard_bytes // max(1, rows * row_bytes))
    shard_chunks = min(shard_chunks, n_row_chunks)
    values = ArrayPlan(
        chunks=(rows, tile), shards=(rows * shard_chunks, tile * math.ceil(cols / tile))
    )
    return MatrixPlan(encoding="dense", arrays={"values": values})
