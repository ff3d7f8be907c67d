"""Damage a layout store the ways disks, copies and other tools do.

For the corruption matrix and the fuzz test: delete an inner chunk or a shard, flip bits
or bytes in a chunk, write an out-of-range column index, truncate a shard. Each works
on sharded arrays (the matrices) and on arrays stored one file per chunk (what anndata
writes: obs, var, obsm, uns); :func:`damage_array` applies one kind by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import google_crc32c
import numpy as np
import zarr

MISSING = 2**64 - 1


def chunk_files(store: Path, array: str) -> list[Path]:
    """Every chunk (or shard) file of ``array``, in key order."""
    folder = store / array / "c"
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sorted(files, key=lambda p: [int(x) for x in p.relative_to(folder).parts])


def _sharding(store: Path, array: str) -> dict | None:
    meta = json.loads((store / array / "zarr.json").read_text())
    codec = meta["codecs"][0]
    return codec["configuration"] if codec["name"] == "sharding_indexed" else None


def shard_index(store: Path, array: str, shard: Path) -> np.ndarray:
    """``(n, 2)`` offset/nbytes of a shard's inner chunks (index at the end, crc32c)."""
    conf = _sharding(store, array)
    meta = json.loads((store / array / "zarr.json").read_text())
    n = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // conf["chunk_shape"][0]
    raw = shard.read_bytes()
    return np.frombuffer(raw[-(16 * n + 4) : -4], dtype="<u8").reshape(n, 2).copy()


def write_index(shard: Path, index: np.ndarray) -> None:
    """Replace a shard's index (with a valid crc32c: damage the index cannot reveal)."""
    raw = bytearray(shard.read_bytes())
    body = index.astype("<u8").tobytes()
    crc = google_crc32c.value(body).to_bytes(4, "little")
    raw[-(len(body) + 4) :] = body + crc
    shard.write_bytes(bytes(raw))


def chunk_span(store: Path, array: str, which: int = 0) -> tuple[Path, int, int]:
    """``(file, offset, nbytes)`` of a stored inner chunk (or a whole chunk file)."""
    files = chunk_files(store, array)
    if _sharding(store, array) is None:
        f = files[which % len(files)]
        return f, 0, f.stat().st_size
    spans = []
    for f in files:
        index = shard_index(store, array, f)
        spans += [(f, int(o), int(n)) for o, n in index if o != MISSING]
    return spans[which % len(spans)]


def delete_chunk(store: Path, array: str, which: int = 0) -> None:
    """Remove one inner chunk.

    Its shard index entry is marked absent (a sharded array), or its chunk file deleted.
    """
    files = chunk_files(store, array)
    if _sharding(store, array) is None:
        files[which % len(files)].unlink()
        return
    f = files[which % len(files)]
    index = shard_index(store, array, f)
    index[0] = MISSING
    write_index(f, index)


def delete_shard(store: Path, array: str, which: int = 0) -> None:
    """Delete one whole shard (or chunk file) of ``array``, as a lost or removed file is."""
    files = chunk_files(store, array)
    files[which % len(files)].unlink()


def flip(store: Path, array: str, *, nbytes: int, which: int = 0, seed: int = 0) -> None:
    """Flip one bit (``nbytes=0``) or invert ``nbytes`` bytes inside one stored chunk."""
    f, off, size = chunk_span(store, array, which)
    raw = bytearray(f.read_bytes())
    rng = np.random.default_rng(seed)
    if nbytes == 0:
        pos = off + int(rng.integers(size))
        raw[pos] ^= 1 << int(rng.integers(8))
    else:
        start = off + int(rng.integers(max(1, size - nbytes)))
        for pos in range(start, min(start + nbytes, off + size)):
            raw[pos] ^= 0xFF
    f.write_bytes(bytes(raw))


def truncate_shard(store: Path, array: str, which: int = 0) -> None:
    """Cut one shard (or chunk file) of ``array`` short, as an interrupted copy leaves it."""
    f = chunk_files(store, array)[which % len(chunk_files(store, array))]
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])


def bad_index(store: Path, array: str = "X/indices", value: int | None = None) -> None:
    """Write a column index outside ``[0, n_vars)`` through zarr.

    Chunk checksums stay valid: only the bounds check can catch it. A negative
    ``value`` in unsigned (narrowed) ids is written as its two's-complement bytes.
    """
    arr = zarr.open_array(store / array, mode="r+")
    n_vars = json.loads((store / "zarr.json").read_text())["attributes"]["sclayout"]["n_vars"]
    value = n_vars + 7 if value is None else value
    if value < 0 and arr.dtype.kind == "u":
        value += 1 << (8 * arr.dtype.itemsize)
    arr[3] = value


ARRAY_DAMAGE = ("delete", "flip", "truncate")
"""Kinds of :func:`damage_array`."""


def damage_array(store: Path, array: str, kind: str) -> None:
    """Damage the first chunk of any ``array`` of ``store``.

    ``kind`` is one of :data:`ARRAY_DAMAGE`: ``delete`` the chunk (its file, or its
    shard index entry), ``flip`` one bit inside its stored bytes, or ``truncate`` its
    file (a chunk file, or the shard holding it) to half its size.
    """
    if kind == "delete":
        delete_chunk(store, array)
    elif kind == "flip":
        flip(store, array, nbytes=0)
    elif kind == "truncate":
        truncate_shard(store, array)
    else:
        raise ValueError(f"damage kind {kind!r}: expected one of {', '.join(ARRAY_DAMAGE)}")


DAMAGE = {
    "delete-chunk": lambda s: delete_chunk(s, "X/data", 1),
    "delete-shard": lambda s: delete_shard(s, "X/data", 1),
    "delete-indices-chunk": lambda s: delete_chunk(s, "X/indices", 1),
    "delete-source_index-chunk": lambda s: delete_chunk(s, "uns/sclayout/source_index"),
    "flip1-data": lambda s: flip(s, "X/data", nbytes=0, which=2),
    "flip16-data": lambda s: flip(s, "X/data", nbytes=16, which=2),
    "flip1-indices": lambda s: flip(s, "X/indices", nbytes=0, which=2),
    "flip16-indices": lambda s: flip(s, "X/indices", nbytes=16, which=2),
    "flip1-source_index": lambda s: flip(s, "uns/sclayout/source_index", nbytes=0),
    "flip16-source_index": lambda s: flip(s, "uns/sclayout/source_index", nbytes=16),
    "index-out-of-range": lambda s: bad_index(s),
    "index-negative": lambda s: bad_index(s, value=-3),
    "truncate-shard": lambda s: truncate_shard(s, "X/data", 1),
}
"""Every damage kind of the corruption matrix, by name."""
