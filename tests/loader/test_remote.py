"""Reading a layout store over HTTP from a real loopback server (with Range support),
with and without injected latency: values equal to local reads."""

from __future__ import annotations

import re
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


def test_injected_delay_is_per_request(tmp_path, monkeypatch):
    import sclayout.testing.httpserver as httpserver

    slept = []
    monkeypatch.setattr(httpserver.time, "sleep", slept.append)
    (tmp_path / "f.bin").write_bytes(b"x" * 100)
    with serve_directory(tmp_path, delay=0.05) as s:
        _get(s.url + "f.bin")
        _get(s.url + "f.bin", {"Range": "bytes=0-9"})
    assert slept == [0.05, 0.05]  # one delay per request


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
        "http-object-store",
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
        "http-object-store",
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
        reader = open_layout(
            url, http_retries=1, http_retry_delay=0.05, http_timeout=30, cache_bytes=0
        )
        assert reader.submit(np.array([0, 1])).result().n_rows > 0
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    with pytest.raises(
        ReadError,
        match=r"reading http://127\.0\.0\.1:\d+/X/\S+ failed: .*check that the server is up",
    ) as e:
        reader.submit(np.array([reader.n_blocks - 1])).result()
    # the one retry ended the wait, not the timeout (tensorstore's 32 would outlast it)
    assert "no answer within" not in str(e.value)
    assert "\n" not in str(e.value)


def test_http_retry_options_are_checked_and_a_dead_url_fails_fast():
    import socket

    from loader.errors import InputError, ReadError

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ReadError, match=rf"reading http://127.0.0.1:{port}/zarr.json failed") as e:
        url = f"http://127.0.0.1:{port}/"
        open_layout(url, http_retries=1, http_retry_delay=0.05, http_timeout=30)
    assert "no answer within" not in str(e.value)  # refused, retried once: not timed out

    with pytest.raises(InputError, match="http_retries=-1"):
        open_layout("http://127.0.0.1:9/", http_retries=-1)
    for bad in (0, -1, "5", None):
        with pytest.raises(InputError, match=rf"http_timeout={bad!r}: pass a number of seconds"):
            open_layout("http://127.0.0.1:9/", http_timeout=bad)


@pytest.fixture
def frozen():
    """A loopback server that accepts connections and never answers; ``frozen(port)``
    starts one (on a given port, or a free one) and returns its port."""
    import socket
    import threading

    socks, conns = [], []

    def start(port: int = 0) -> int:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        socks.append(sock)

        def accept() -> None:
            while True:
                try:
                    conns.append(sock.accept()[0])  # held open, never read or answered
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        return sock.getsockname()[1]

    yield start
    for c in conns + socks:
        c.close()


def test_the_default_remote_timeout_is_at_most_a_minute():
    from loader.backends import TensorstoreBackend, TensorstoreSettings

    assert 0 < TensorstoreSettings.HTTP_TIMEOUT <= 60
    assert TensorstoreBackend("http://127.0.0.1:9/")._timeout == TensorstoreSettings.HTTP_TIMEOUT


def test_a_frozen_server_fails_open_with_read_error_naming_the_url(frozen):
    from loader.errors import ReadError

    port = frozen()
    with pytest.raises(
        ReadError,
        match=rf"^reading http://127\.0\.0\.1:{port}/zarr\.json failed: no answer within 0\.5 s; "
        "check that the server is up and answers, or allow longer with http_timeout=$",
    ):
        open_layout(f"http://127.0.0.1:{port}/", http_timeout=0.5)


def test_a_server_that_freezes_mid_run_fails_the_fetch_naming_the_url(data):
    from loader import BlockDataset
    from loader.errors import ReadError

    _, store = data
    with serve_directory(store) as s:
        reader = open_layout(s.url, http_timeout=0.5, cache_bytes=0)
        assert reader.submit(np.array([0])).result().n_rows > 0
        _ = reader.block_pointer, reader.source_index()  # metadata read while it answers
        s.freeze()  # connections stay open, requests get no answer
        url = re.escape(s.url.rstrip("/"))
        with pytest.raises(ReadError, match=rf"^reading {url}/X/\S+ failed: no answer within"):
            reader.submit(np.array([reader.n_blocks - 1])).result()
        with pytest.raises(ReadError, match=rf"^reading {url}/\S+ failed: no answer within"):
            next(iter(BlockDataset(reader, batch_size=8)))  # the loader, through the reader
