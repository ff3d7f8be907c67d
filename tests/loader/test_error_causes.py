"""Errors that name the real cause: an HTTP server that ignores Range requests is named
as such, not as a damaged store; and a damaged chunk is one exception with one
traceback on every backend (tensorstore's own error is not chained to it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from loader.backends import read_error
from loader.errors import LayoutError, ReadError
from loader.spec import LayoutSpec, StoreSpec
from sclayout.cli import main
from sclayout.convert import convert
from sclayout.testing.damage import DAMAGE
from sclayout.testing.httpserver import serve_directory

RANGE = (
    ": the server does not support HTTP Range requests (it answered 200 with the whole "
    "file to a ranged GET); serve the store with a server that does"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory, reader_adata, write_h5ad):
    """A folder with a small zstd store (``sound``, read through tensorstore) and a copy
    with one data chunk damaged (``damaged``)."""
    root = tmp_path_factory.mktemp("causes")
    src = write_h5ad(reader_adata(120, 30), root / "src.h5ad")
    store = StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=4, codec="zstd")
    convert(src, root / "sound", spec=LayoutSpec(store=store))
    shutil.copytree(root / "sound", root / "damaged")
    DAMAGE["flip16-data"](root / "damaged")
    return root


class _IgnoresRange(SimpleHTTPRequestHandler):
    """The standard library's file server (``python -m http.server``): a ranged GET gets
    ``200`` and the whole file. The header is dropped so that it stays so."""

    def do_GET(self) -> None:
        del self.headers["Range"]
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def no_range(root):
    """URL of ``root`` served by a server that ignores Range requests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_IgnoresRange, directory=str(root)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_a_server_that_ignores_range_is_named_not_damage(no_range):
    from loader import BlockDataset

    url = f"{no_range}/sound"
    with pytest.raises(ReadError) as e:
        for _ in BlockDataset(url, batch_size=32):
            pass
    assert not isinstance(e.value, LayoutError)
    assert str(e.value).startswith(url + RANGE) and "\n" not in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    for args in (("verify", url), ("verify", "--quick", url), ("inspect", url)):
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith(f"error: {url}{RANGE}"), (args, r.output)
        assert r.output.count("\n") == 1 and "restore" not in r.output, (args, r.output)


def test_what_looks_like_damage_over_http_is_checked_against_range_first(no_range, root):
    """A damage error over HTTP costs one probe of the server before it is named."""
    damage = ValueError(
        "DATA_LOSS: Error reading shard entry {1}/{4} in /x/X/data/c/2: Digest mismatch"
    )
    refused = read_error(f"{no_range}/sound", "X/data", damage)
    assert isinstance(refused, ReadError) and RANGE in str(refused)
    with serve_directory(root) as server:  # the project's server answers ranges
        named = read_error(server.url + "sound", "X/data", damage)
        assert isinstance(named, LayoutError) and "array X/data, chunk 9: damaged" in str(named)
        # the checks cannot list a store over HTTP: one line that says so
        r = CliRunner().invoke(main, ["inspect", server.url + "sound"])
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert "cannot list the store's files" in r.output
    assert isinstance(read_error(str(root / "sound"), "X/data", damage), LayoutError)


_EPOCHS = """
import sys, traceback
from loader import BlockDataset
from sclayout.testing.httpserver import serve_directory

root = sys.argv[1]

def epoch(path, **kw):
    for _ in BlockDataset(path, batch_size=32, **kw):
        pass

with serve_directory(root) as server:
    for name, path, kw in (
        ("zarr", f"{root}/damaged", {"backend": "zarr"}),
        ("http", server.url + "damaged", {}),
    ):
        print(f"== {name}", file=sys.stderr)
        try:
            epoch(path, **kw)
        except Exception as e:  # printed as the interpreter prints an uncaught one
            traceback.print_exception(e)
print("== tensorstore", file=sys.stderr)
epoch(f"{root}/damaged")  # uncaught: the interpreter prints it and exits 1
"""


def test_a_damaged_chunk_is_one_exception_on_every_backend(root):
    """What a user's script prints: one traceback, one exception naming the array."""
    proc = subprocess.run(
        [sys.executable, "-c", _EPOCHS, str(root)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    sections = dict(s.split("\n", 1) for s in proc.stderr.split("== ")[1:])
    assert sorted(sections) == ["http", "tensorstore", "zarr"], proc.stderr[-3000:]
    for name, text in sections.items():
        assert text.count("Traceback") == 1, (name, text)
        assert "During handling" not in text and "direct cause" not in text, (name, text)
        last = text.strip().splitlines()[-1]
        assert last.startswith("loader.errors.LayoutError: store "), (name, last)
        assert "damaged" in last and "array X/data, chunk " in last, (name, last)


def test_verify_of_an_unreadable_chunk_prints_one_line(root):
    """The whole of stderr: the reads the failed command abandoned print nothing at exit."""
    cmd = [
        sys.executable,
        "-m",
        "sclayout",
        "verify",
        str(root / "src.h5ad"),
        str(root / "damaged"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: DST X: a chunk cannot be read"), proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "Stored:" not in proc.stderr  # not zarr's raw checksum bytes
