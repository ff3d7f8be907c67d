"""``verify`` and ``inspect`` of a store in a bucket read it in place (moto's S3 server on
loopback): the same verdicts and findings as on a local copy of the same bytes, damage
named, no local copy made, and every shard byte read about once."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from sclayout.testing.s3server import serve_s3

_MISSING = 2**64 - 1


@pytest.fixture(scope="module")
def s3():
    """One loopback S3 server (bucket ``data``) with the AWS variables pointing at it."""
    with serve_s3(buckets=("data",)) as server, server.environment():
        yield server


def _index(store: Path, array: str) -> tuple[Path, bytearray, np.ndarray]:
    """Shard 0 of ``array``: its file, its bytes and its index (``(n, 2)`` offset, nbytes)."""
    meta = json.loads((store / array / "zarr.json").read_text())
    per = (
        meta["chunk_grid"]["configuration"]["chunk_shape"][0]
        // meta["codecs"][0]["configuration"]["chunk_shape"][0]
    )
    shard = store / array / "c" / "0"
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-(per * 16 + 4) : -4]), dtype="<u8").reshape(per, 2).copy()
    return shard, raw, index


def _damage(store: Path) -> None:
    """Flip a byte inside X/data's chunk 0; drop X/indices' chunk 1 from its shard index."""
    import google_crc32c

    shard, raw, index = _index(store, "X/data")
    offset, nbytes = (int(v) for v in index[0])
    raw[offset + nbytes // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    shard, raw, index = _index(store, "X/indices")
    assert index.shape[0] > 1 and index[1, 0] != _MISSING
    index[1] = _MISSING
    body = index.astype("<u8").tobytes()
    tail = body + google_crc32c.value(body).to_bytes(4, "little")
    shard.write_bytes(bytes(raw[: -len(tail)]) + tail)


@pytest.fixture(scope="module")
def pair(s3, shared_store, tmp_path_factory):
    """(source, {"sound"|"damaged": (local store, its URL in the bucket)}), equal bytes."""
    from sclayout.convert.remote import upload_tree

    src, local = shared_store
    root = tmp_path_factory.mktemp("s3checks")
    damaged = root / "damaged.zarr"
    shutil.copytree(local, damaged)
    _damage(damaged)
    out = {}
    for name, folder in (("sound", local), ("damaged", damaged)):
        url = f"s3://data/checks/{name}.zarr"
        upload_tree(folder, url)
        out[name] = (folder, url)
    return src, out


@pytest.fixture
def no_copy(tmp_path, monkeypatch):
    """TMPDIR an empty folder that must stay empty: a check makes no local copy."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp
    assert not list(tmp.iterdir())


def _shards(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and "/c/" in p.relative_to(folder).as_posix()
    }


def test_checks_of_a_bucket_store_equal_those_of_its_local_copy(s3, pair, no_copy, monkeypatch):
    from sclayout.checks import place
    from sclayout.checks.inspect import inspect_store
    from sclayout.checks.verify import verify
    from sclayout.checks.verify_store import check_store

    src, stores = pair
    got: dict[str, int] = {}
    get = place.BucketStore.get

    async def counted(self, key, prototype, byte_range=None):
        buf = await get(self, key, prototype, byte_range)
        got[key] = got.get(key, 0) + (0 if buf is None else len(buf))
        return buf

    monkeypatch.setattr(place.BucketStore, "get", counted)
    for name, (local, url) in stores.items():
        for quick in (True, False):
            here, there = check_store(local, quick=quick), check_store(url, quick=quick)
            lines = [f.replace(str(local), url) for f in here.findings]
            assert (there.summary(), there.findings) == (here.summary(), lines)
            assert here.sound == (name == "sound"), here.findings
        a, b = inspect_store(local), inspect_store(url)
        assert b["path"] == url and b["missing_chunks"] == a["missing_chunks"]
        assert b["matrices"] == a["matrices"]  # stored sizes from the shard indexes
        assert b["files"] == a["files"] and b["warnings"] == a["warnings"]
    # the damage, found and named in the bucket as on disk
    url = stores["damaged"][1]
    damaged = check_store(url)
    assert damaged.findings[0] == f"array X/indices: chunk 1 is missing (in {url}/X/indices/c/0)"
    bad = [f for f in damaged.findings if f.startswith("array X/data: chunk 0 cannot be read (")]
    assert len(bad) == 1 and bad[0].endswith(f"; in {url}/X/data/c/0)"), bad
    # one full check of the sound store reads each shard about once (its index twice)
    got.clear()
    assert check_store(stores["sound"][1]).sound
    sizes = _shards(stores["sound"][0])
    read = sum(n for k, n in got.items() if k in sizes)
    assert sum(sizes.values()) <= read <= 1.2 * sum(sizes.values()), (read, sum(sizes.values()))
    # verify SRC DST in small windows: a shard cut by windows is still one GET whole
    s3.stats.reset()
    assert verify(src, stores["sound"][1], memory_budget="256KiB").equal
    per_shard = [s3.stats.get_keys[f"/data/checks/sound.zarr/{k}"] for k in sizes]
    assert max(per_shard) <= 3, per_shard  # its index for the structure, for zarr, whole


def test_cli_checks_a_bucket_in_place_and_names_the_damage(pair, no_copy, run_cli):
    src, stores = pair
    _, url = stores["damaged"]
    r = run_cli("verify", "--quick", url)
    assert r.exit_code == 1 and "array X/indices: chunk " in r.stdout, r.output
    r = run_cli("inspect", url)
    assert r.exit_code == 1 and url in r.stdout and "X/indices: chunk " in r.stdout
    r = run_cli("verify", src, url)  # DST damaged: found by its structure first
    assert r.exit_code == 1 and "is missing" in r.stdout, r.output
    _, sound = stores["sound"]
    r = run_cli("verify", src, sound)
    assert r.exit_code == 0 and r.stdout.startswith("equal: "), r.output
