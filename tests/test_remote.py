"""Reading a layout store over HTTP from a real loopback server (with Range support),
with and without injected latency: values equal to local reads."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from loader.store import open_layout
from sclayout.testing.httpserver import serve_directory


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_store):
    return shared_store


@pytest.fixture(scope="module")
def server(data):
    _, store = data
    with serve_directory(store, delay=0.002, max_seconds=300) as s:
        yield s


def _get(url: str, headers: dict | None = None, method: str = "GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def test_range_head_and_404(tmp_path):
    payload = bytes(range(256)) * 40
    (tmp_path / "f.bin").write_bytes(payload)
    with serve_directory(tmp_path) as s:
        status, headers, body = _get(s.url + "f.bin", {"Range": "bytes=10-19"})
        assert (status, body) == (206, payload[10:20])
        assert headers["Content-Range"] == f"bytes 10-19/{len(payload)}"
        assert _get(s.url + "f.bin", {"Range": "bytes=-5"})[2] == payload[-5:]
        assert _get(s.url + "f.bin", {"Range": "bytes=10000-"})[2] == payload[10000:]
        assert _get(s.url + "f.bin")[2] == payload
        status, headers, body = _get(s.url + "f.bin", method="HEAD")
        assert (status, headers["Content-Length"], body) == (200, str(len(payload)), b"")
        for bad_path in ("missing.bin", "..%2F..%2Fetc%2Fpasswd"):
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(s.url + bad_path)
            assert e.value.code == 404
            e.value.close()
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(s.url + "f.bin", {"Range": f"bytes={len(payload)}-"})
        assert e.value.code == 416
        e.value.close()
        assert s.stats.range_requests >= 3


def test_injected_delay_is_per_request(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * 100)
    with serve_directory(tmp_path, delay=0.05) as s:
        t0 = time.perf_counter()
        _get(s.url + "f.bin")
        assert time.perf_counter() - t0 >= 0.05


def test_server_stops_itself_and_on_exit(tmp_path):
    with serve_directory(tmp_path, max_seconds=0.2) as s:
        time.sleep(0.5)
        with pytest.raises(urllib.error.URLError):
            _get(s.url + "anything")
    s.stop()  # idempotent


def test_open_layout_over_http_equals_local(data, server):
    _, store = data
    local, remote = open_layout(store), open_layout(server.url)
    assert remote.manifest == local.manifest
    assert np.array_equal(remote.block_pointer, local.block_pointer)
    blocks = np.array([0, 5, 6, 17, local.n_blocks - 1])
    a, b = local.submit(blocks).result(), remote.submit(blocks).result()
    assert np.array_equal(a.index, b.index)
    pos = np.random.default_rng(0).permutation(a.n_rows)
    xa, xb = a.take(pos)["X"], b.take(pos)["X"]
    assert xa.dtype == xb.dtype and np.array_equal(xa, xb)


def test_block_dataset_over_http_equals_local(data, server):
    from loader import BlockDataset

    _, store = data
    kw = dict(batch_size=32, fetch_factor=4, seed=5, output="csr")
    local = list(BlockDataset(store, **kw))
    remote = list(BlockDataset(server.url, **kw))
    assert len(local) == len(remote) > 0
    for x, y in zip(local, remote, strict=True):
        assert np.array_equal(x["index"], y["index"])
        xa, xb = x["X"], y["X"]
        xa = xa.to_dense().numpy() if hasattr(xa, "to_dense") else xa.toarray()
        xb = xb.to_dense().numpy() if hasattr(xb, "to_dense") else xb.toarray()
        assert np.array_equal(xa, xb)
    seen = np.concatenate([np.asarray(b["index"]) for b in remote])
    assert np.array_equal(np.sort(seen), np.arange(open_layout(store).n_obs))


def test_recommend_and_bench_read_a_store_over_http(server, run_cli):
    r = run_cli(
        "recommend",
        server.url,
        "--profile",
        "http-loopback-2ms",
        "--json",
        "--fetch-factors",
        "2,4",
        "--block-sizes",
        "8,16",
        "--codecs",
        "blosc-lz4",
        "--worker-counts",
        "0",
        "--batch-size",
        "16",
    )
    assert r.exit_code == 0, r.stderr
    r = run_cli(
        "bench",
        server.url,
        "--batch-size",
        "16",
        "--fetch-factor",
        "4",
        "--runs",
        "1",
        "--seconds",
        "0.3",
        "--profile",
        "http-loopback-2ms",
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["measured_cells_per_s"] > 0 and out["predicted"]["cells_per_s"] > 0


def test_calibrate_over_http(server, monkeypatch, spy_codec_timing, tiny_plan):
    from sclayout.cost.calibrate import calibrate

    seen = spy_codec_timing
    p = calibrate(server.url, plan=tiny_plan(), codecs=("blosc-lz4", "none"))
    assert seen == [False]  # the codecs are timed the way the loader reads a URL
    assert p.kind == "http"
    assert p.latency_s >= 0.002  # the injected delay
    assert [n for n, _ in p.concurrency] == [1, 2, 4, 8, 16, 32, 64]


def test_a_server_that_goes_away_fails_reads_with_a_clear_error(data):
    from loader.errors import ReadError

    _, store = data
    # a server in its own process, killed: its connections close as a real one's do
    cmd = [sys.executable, "-m", "sclayout.testing.httpserver", str(store), "--max-seconds", "120"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        reader = open_layout(url, http_retries=1, http_retry_delay=0.05, cache_bytes=0)
        assert reader.submit(np.array([0, 1])).result().n_rows > 0
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    t0 = time.perf_counter()
    with pytest.raises(
        ReadError,
        match=r"reading http://127\.0\.0\.1:\d+/X/\S+ failed: .*check that the server is up",
    ) as e:
        reader.submit(np.array([reader.n_blocks - 1])).result()
    assert time.perf_counter() - t0 < 10  # one retry, not tensorstore's 32
    assert "\n" not in str(e.value)


def test_http_retry_options_are_checked_and_a_dead_url_fails_fast():
    import socket

    from loader.errors import InputError, ReadError

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(ReadError, match=rf"reading http://127.0.0.1:{port}/zarr.json failed"):
        open_layout(f"http://127.0.0.1:{port}/", http_retries=1, http_retry_delay=0.05)
    assert time.perf_counter() - t0 < 10

    with pytest.raises(InputError, match="http_retries=-1"):
        open_layout("http://127.0.0.1:9/", http_retries=-1)
