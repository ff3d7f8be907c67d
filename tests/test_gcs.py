"""Layout stores in a ``gs://`` bucket, against a GCS JSON-API server on loopback
(``sclayout.testing.gcsserver``, which tensorstore's ``gcs`` driver is pointed at with
``TENSORSTORE_GCS_HTTP_URL``): values equal the local store's, reads are ranged, convert
writes there, and a server that goes away is one line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from loader.store import open_layout
from sclayout.testing.gcsserver import serve_gcs

STORE_KW = dict(block_size=8, order="shuffled", seed=3)
"""The options of the session's shared store: the bucket's copy must equal it."""


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """One loopback GCS server (bucket ``data``) with the variables pointing at it."""
    root = tmp_path_factory.mktemp("gcs")
    with serve_gcs(root, buckets=("data",)) as server, server.environment():
        yield server


@pytest.fixture(scope="module")
def gcs_store(gcs, shared_store):
    """The shared source converted straight into ``gs://data/shared.zarr``."""
    from sclayout.convert.convert import convert

    src, local = shared_store
    url = "gs://data/shared.zarr"
    convert(src, url, jobs=2, **STORE_KW)
    return url, local


def test_a_store_on_gcs_equals_the_local_store(gcs, gcs_store, assert_same_as_local):
    url, local_path = gcs_store
    remote = open_layout(url, cache_bytes=0, whole_array_bytes=0)
    blocks = np.arange(remote.n_blocks)
    gcs.stats.media_gets = gcs.stats.ranged_gets = 0
    one = remote.submit(blocks[-1:]).result()  # one block: byte ranges of its shards
    assert gcs.stats.ranged_gets > 0, gcs.stats  # (the rest: the arrays' zarr.json)
    assert np.array_equal(one.index, open_layout(local_path).submit(blocks[-1:]).result().index)
    assert_same_as_local(url, local_path, remote, batch_size=512, fetch_factor=8)


def test_convert_writes_the_objects_of_a_local_store(gcs, gcs_store):
    """The bucket holds the same keys as the local store (the format is unchanged)."""
    _, local = gcs_store
    bucket = gcs.root / "data" / "shared.zarr"
    keys = {p.relative_to(bucket).as_posix() for p in bucket.rglob("*") if p.is_file()}
    want = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert keys == want
    # the shards, byte for byte
    for k in want:
        if "/c/" in k and k.startswith("X/"):
            assert (bucket / k).read_bytes() == (local / k).read_bytes(), k


_CHILD = """
import sys
import numpy as np
from loader.errors import ReadError
from loader.store import open_layout
reader = open_layout(sys.argv[1], http_retries=1, http_retry_delay=0.05, http_timeout=20,
                     cache_bytes=0)
assert reader.submit(np.array([0, 1])).result().n_rows > 0
print("read", flush=True)
sys.stdin.readline()  # the server is killed meanwhile
try:
    reader.submit(np.array([reader.n_blocks - 1])).result()
except ReadError as e:
    print("ReadError:", e)
"""


def test_a_server_that_goes_away_fails_reads_with_one_line(tmp_path, shared_store):
    """In child processes: tensorstore reads ``TENSORSTORE_GCS_HTTP_URL`` once per process."""
    import shutil

    (tmp_path / "gone").mkdir()
    shutil.copytree(shared_store[1], tmp_path / "gone" / "st.zarr")
    server = subprocess.Popen(
        [sys.executable, "-m", "sclayout.testing.gcsserver", str(tmp_path), "--max-seconds", "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = server.stdout.readline().strip()
        env = {
            **os.environ,
            "TENSORSTORE_GCS_HTTP_URL": endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        }
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, "gs://gone/st.zarr"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout.readline().strip() == "read"
        server.kill()
        server.wait()
        out, err = child.communicate("go\n", timeout=60)
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    assert child.returncode == 0, err
    line = out.strip()
    assert line.startswith("ReadError: reading gs://gone/st.zarr/X/"), line
    assert "\n" not in line and "check that the server is up" in line
