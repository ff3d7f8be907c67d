"""The direct shard reader (:mod:`loader.engine.shards`): equal to zarr-python on every
range (across inner-chunk and shard borders, the partial last chunk, absent chunks
and shards), blosc and uncompressed inner chunks, 1-d and 2-d, as stored or cast to a
wider dtype while decoding; arrays it cannot read
are left to tensorstore; a corrupted chunk is a clear error."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.engine import shards as _shards
from loader.engine.config import EngineConfig
from loader.engine.engine import Engine
from loader.errors import LayoutError

BLOSC = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")


def _write(path: Path, values: np.ndarray, *, chunk: int, shard_chunks: int, compress: bool):
    arr = zarr.create_array(
        path,
        shape=values.shape,
        dtype=values.dtype,
        chunks=(chunk, *values.shape[1:]),
        shards=(chunk * shard_chunks, *values.shape[1:]),
        compressors=(BLOSC,) if compress else None,
        fill_value=0,
    )
    arr[...] = values
    return arr


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    out = {}
    v1 = rng.integers(0, 50, 1003).astype(np.float32)  # 1003: partial last chunk/shard
    out["blosc-1d"] = (_write(d / "b1", v1, chunk=16, shard_chunks=4, compress=True), v1)
    out["raw-1d"] = (_write(d / "r1", v1, chunk=16, shard_chunks=4, compress=False), v1)
    v2 = rng.integers(0, 9, (203, 7)).astype(np.int64)
    out["blosc-2d"] = (_write(d / "b2", v2, chunk=8, shard_chunks=3, compress=True), v2)
    # zeros are not written by zarr: absent inner chunks and a whole absent shard
    v3 = np.zeros(600, dtype=np.int32)
    v3[100:140] = np.arange(40)
    out["sparse-1d"] = (_write(d / "s1", v3, chunk=10, shard_chunks=5, compress=True), v3)
    return {k: (Path(a.store.root), v) for k, (a, v) in out.items()}


ENGINE = Engine(EngineConfig(mode="threads"))
"""The decoders of this module's reads (closed after its last test)."""


@pytest.fixture(scope="module", autouse=True)
def _close_engine():
    yield
    ENGINE.close()


def _direct(folder: Path) -> _shards.DirectArray:
    got = _shards.open_direct(str(folder.parent), folder.name, whole_array_bytes=0)
    assert got is not None
    return got


def _read(direct: _shards.DirectArray, ranges: np.ndarray, dtype=None) -> np.ndarray:
    got = direct.submit(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), dtype, engine=ENGINE)
    return got if isinstance(got, np.ndarray) else got.result()


@settings(max_examples=20, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name", ["blosc-1d", "raw-1d", "blosc-2d", "sparse-1d"])
def test_ranges_equal_source(arrays, name, data):
    folder, values = arrays[name]
    n = values.shape[0]
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=12, unique=True)))
    ranges = np.array(list(zip(cuts[:-1:2], cuts[1::2], strict=False)), dtype=np.int64)
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if ranges.size == 0:
        ranges = np.array([[0, n]])
    want = np.concatenate([values[a:b] for a, b in ranges])
    direct = _direct(folder)
    assert np.array_equal(_read(direct, ranges), want)
    # cast to a wider dtype by the decode threads, chunk by chunk
    wide = _read(direct, ranges, np.float64)
    assert wide.dtype == np.float64 and np.array_equal(wide, want.astype(np.float64))
    # the same ranges through the whole-array path
    whole = _shards.open_direct(str(folder.parent), folder.name)
    assert np.array_equal(_read(whole, ranges), want)


def test_unsupported_arrays_are_left_to_tensorstore(tmp_path):
    v = np.arange(100, dtype=np.float32)
    zarr.create_array(tmp_path / "unsharded", shape=v.shape, dtype=v.dtype, chunks=(10,))[...] = v
    assert _shards.open_direct(str(tmp_path), "unsharded") is None
    zarr.create_array(
        tmp_path / "zstd",
        shape=v.shape,
        dtype=v.dtype,
        chunks=(10,),
        shards=(50,),
        compressors=(zarr.codecs.ZstdCodec(),),
    )[...] = v
    assert _shards.open_direct(str(tmp_path), "zstd") is None
    assert _shards.open_direct("http://example.org/store.zarr", "X/data") is None
    assert _shards.open_direct(str(tmp_path), "missing") is None


INDEX_BYTES = 4 * 16 + 4
"""Shard index of :func:`_shard_to_damage`'s array: 4 chunks × (offset, nbytes) + crc32c."""


def _shard_to_damage(tmp_path: Path, shard_no: int) -> tuple[np.ndarray, Path, Path, bytearray]:
    """400 float32 values in blosc shards of 4 chunks of 20: the values, the array
    folder, shard ``shard_no``'s file and its bytes."""
    v = np.arange(400, dtype=np.float32)
    arr = _write(tmp_path / "a", v, chunk=20, shard_chunks=4, compress=True)
    folder = Path(arr.store.root)
    shard = folder / "c" / str(shard_no)
    return v, folder, shard, bytearray(shard.read_bytes())


def test_corrupted_chunk_is_a_clear_error(tmp_path):
    _, folder, shard, raw = _shard_to_damage(tmp_path, 1)
    n = 4
    index = np.frombuffer(bytes(raw[-INDEX_BYTES:-4]), dtype="<u8").reshape(n, 2)
    off = int(index[0, 0])
    raw[off + 4 : off + 8] = (123).to_bytes(4, "little")  # blosc header: decoded size
    shard.write_bytes(bytes(raw))
    direct = _direct(folder)
    with pytest.raises(LayoutError, match=r"chunk 4 decodes to 123 bytes, expected 80"):
        _read(direct, [[80, 100]])
    shard.write_bytes(bytes(raw[: off + 10]) + bytes(raw[-INDEX_BYTES:]))
    with pytest.raises(LayoutError, match=r"\(shard 1\): the shard ends before byte"):
        _read(_direct(folder), [[80, 100]])


def test_corrupted_shard_index_fails_its_checksum(tmp_path):
    v, folder, shard, raw = _shard_to_damage(tmp_path, 2)
    # the second chunk's offset, one byte later: still inside the file, so without the
    # checksum the read would decode from the wrong place
    raw[-INDEX_BYTES + 16] += 1
    shard.write_bytes(bytes(raw))
    direct = _direct(folder)
    assert np.array_equal(_read(direct, [[0, 80]]), v[:80])  # other shards still read
    with pytest.raises(
        LayoutError, match=r"\(shard 2\): the shard index fails its crc32c checksum.*reconvert"
    ):
        _read(direct, [[170, 190]])


def test_metadata_parse_rejects_big_endian(tmp_path):
    v = np.arange(100, dtype=np.float32)
    arr = _write(tmp_path / "a", v, chunk=10, shard_chunks=5, compress=True)
    meta_path = Path(arr.store.root) / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"][0]["configuration"]["codecs"][0]["configuration"]["endian"] = "big"
    meta_path.write_text(json.dumps(meta))
    assert _shards.open_direct(str(tmp_path), "a") is None


def test_reopens_files_after_fork(arrays):
    folder, values = arrays["blosc-1d"]
    direct = _direct(folder)
    assert np.array_equal(_read(direct, [[0, 40]]), values[:40])
    pid = os.fork()
    if pid == 0:  # child: fresh descriptors and decode threads, same values
        ok = np.array_equal(_read(direct, [[30, 900]]), values[30:900])
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_reads_are_announced_on_a_decode_thread_for_every_array(arrays, monkeypatch):
    """``WILLNEED`` starts disk reads synchronously: the caller's thread (the training
    loop's) must not pay for it. One task on the decode threads announces every run of
    every array of the request, queued ahead of their reads."""
    if _shards._FADV_WILLNEED is None:
        pytest.skip("no posix_fadvise on this platform")
    import threading

    calls: list[tuple[str, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == _shards._FADV_WILLNEED:
            calls.append((threading.current_thread().name, fd))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    a, b = _direct(arrays["blosc-1d"][0]), _direct(arrays["blosc-2d"][0])
    ra, rb = np.array([[0, 1003]]), np.array([[5, 180]])
    got = _shards.submit_reads([(a, ra, None), (b, rb, None)], ENGINE)
    assert np.array_equal(got[0].result(), arrays["blosc-1d"][1])
    assert np.array_equal(got[1].result(), arrays["blosc-2d"][1][5:180])
    # the announcing task is queued ahead of the reads but may still be running when they
    # are done (a loaded machine): wait for it to reach every file, then check who ran it
    want = set(a._fds.values()) | set(b._fds.values())
    deadline = time.monotonic() + 30
    while {fd for _, fd in calls} != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "no run was announced"
    assert all(name.startswith("sclayout-decode") for name, _ in calls)
    assert {fd for _, fd in calls} == want


@pytest.mark.parametrize("compress", [True, False], ids=["blosc", "raw"])
def test_chunk_checksums_are_verified_before_decoding(tmp_path, compress):
    v = np.arange(400, dtype=np.float32)
    codecs = (BLOSC, zarr.codecs.Crc32cCodec()) if compress else (zarr.codecs.Crc32cCodec(),)
    zarr.create_array(
        tmp_path / "a", shape=v.shape, dtype=v.dtype, chunks=(20,), shards=(80,), compressors=codecs
    )[...] = v
    direct = _direct(tmp_path / "a")
    assert direct.meta.chunk_crc
    assert np.array_equal(_read(direct, [[0, 400]]), v)
    shard = tmp_path / "a" / "c" / "1"
    raw = bytearray(shard.read_bytes())
    raw[30] ^= 0x04  # one bit of shard 1's first chunk
    shard.write_bytes(bytes(raw))
    with pytest.raises(LayoutError, match=r"array a, chunk 4 fails its crc32c checksum"):
        _read(_direct(tmp_path / "a"), [[90, 95]])
    assert np.array_equal(_read(_direct(tmp_path / "a"), [[0, 80]]), v[:80])


def test_absent_chunks_are_an_error_only_when_every_chunk_must_exist(arrays):
    folder, values = arrays["sparse-1d"]  # chunks of zeros were never written
    lenient = _shards.open_direct(str(folder.parent), folder.name, whole_array_bytes=0)
    assert np.array_equal(_read(lenient, [[0, 600]]), values)
    strict = _shards.open_direct(
        str(folder.parent), folder.name, whole_array_bytes=0, require_chunks=True
    )
    with pytest.raises(LayoutError, match=r"array s1, chunk 0 \(shard 0\) is missing"):
        _read(strict, [[0, 600]])
    assert np.array_equal(_read(strict, [[100, 140]]), values[100:140])
    assert _shards.missing_chunk(str(folder.parent), folder.name) == "chunk 0"


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_big_shard_indexes_are_mapped_read_the_same_and_are_checked(arrays, tmp_path, monkeypatch):
    """An index of at least MAP_INDEX_BYTES is a map of its shard file (file pages that
    every process shares), not a copy: the same values, absent chunks and shards as
    before, and a damaged or truncated index is still the one-line error."""
    folder, values = arrays["raw-1d"]
    copied = _direct(folder)  # the indexes of these small test shards: read, not mapped
    assert np.array_equal(_read(copied, [[0, values.shape[0]]]), values)
    assert str(folder / "c" / "0") not in _mapped_files()
    monkeypatch.setattr(_shards, "MAP_INDEX_BYTES", 0)
    for name in ("blosc-1d", "sparse-1d"):
        folder, values = arrays[name]
        direct = _direct(folder)
        assert np.array_equal(_read(direct, [[0, values.shape[0]]]), values)
        assert np.array_equal(
            _read(direct, [[7, 9], [95, 450]]), np.r_[values[7:9], values[95:450]]
        )
        assert str(min((folder / "c").iterdir())) in _mapped_files()
    v, folder, shard, raw = _shard_to_damage(tmp_path, 2)
    raw[-INDEX_BYTES + 16] += 1
    shard.write_bytes(bytes(raw))
    direct = _direct(folder)
    assert np.array_equal(_read(direct, [[0, 80]]), v[:80])
    with pytest.raises(LayoutError, match=r"\(shard 2\): the shard index fails its crc32c"):
        _read(direct, [[170, 190]])
    shard.write_bytes(bytes(raw[: INDEX_BYTES - 8]))
    with pytest.raises(LayoutError, match=r"\(shard 2\): the shard is 60 bytes, shorter than"):
        _read(_direct(folder), [[170, 190]])
