"""Bad input through the CLI: a one-line error naming problem and fix, a non-zero exit,
no traceback, and DST untouched (absent stays absent, an existing store stays
byte-identical, no temporary sibling is left behind)."""

from __future__ import annotations

import errno
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from loader.errors import InputError
from sclayout.cli import main
from sclayout.convert import checks, space
from sclayout.convert.checks import check_destination, check_source

BAD_SOURCES = [
    pytest.param("missing", "does not exist: check the path", id="missing"),
    pytest.param(
        "csv",
        "is neither HDF5 (.h5ad) nor a zarr store: convert it first: anndata.io.read_csv",
        id="csv",
    ),
    pytest.param("text_as_h5ad", "damaged (no HDF5 signature)", id="text-named-h5ad"),
    pytest.param("plain_dir", "is a directory but not a zarr store", id="plain-dir"),
    pytest.param("hdf5_not_anndata", "is HDF5 but not AnnData (no obs, var)", id="hdf5"),
    pytest.param("zarr_not_anndata", "is zarr but not AnnData (no obs, var)", id="zarr"),
    pytest.param("truncated", "truncated", id="truncated"),
    pytest.param("corrupt", "damaged", id="corrupt"),
    pytest.param("encoding", "unsupported encoding-type 'bsr_matrix'", id="encoding"),
    pytest.param("encoding_version", "version '9.0.0', newer than", id="encoding-version"),
    pytest.param("empty_cells", "is empty (0 cells x 5 genes)", id="empty-cells"),
    pytest.param("empty_genes", "is empty (5 cells x 0 genes)", id="empty-genes"),
]


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, out: str, err: str, fragment: str) -> None:
    assert code != 0, out
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def good_h5ad(tmp_path_factory, small_adata, write_h5ad) -> Path:
    return write_h5ad(small_adata(), tmp_path_factory.mktemp("src") / "good.h5ad")


@pytest.fixture(scope="module")
def good_store(good_h5ad: Path) -> Path:
    dst = good_h5ad.with_name("good.zarr")
    code, _, err = run_cli("convert", good_h5ad, dst, "--block-size", "16", "--quiet")
    assert code == 0, err
    return dst


@pytest.mark.parametrize(("make", "fragment"), BAD_SOURCES)
def test_bad_source_refused_dst_absent(
    tmp_path: Path, make, fragment: str, bad_sources, snapshot
) -> None:
    src = bad_sources[make](tmp_path)
    dst = tmp_path / "out.zarr"
    before = snapshot(tmp_path)
    assert_one_line_error(*run_cli("convert", src, dst, "--block-size", "16"), fragment)
    assert not dst.exists()
    assert snapshot(tmp_path) == before  # no temporary sibling left behind


@pytest.mark.parametrize(
    ("make", "fragment"),
    [p for p in BAD_SOURCES if p.id in ("missing", "truncated", "encoding", "empty-cells")],
)
def test_bad_source_keeps_existing_store_even_with_overwrite(
    tmp_path: Path, good_store: Path, make, fragment: str, bad_sources, snapshot
) -> None:
    dst = tmp_path / "out.zarr"
    shutil.copytree(good_store, dst)
    src = bad_sources[make](tmp_path)
    before = snapshot(tmp_path)
    assert before[dst.name] == (0, 0, "dir")
    assert_one_line_error(
        *run_cli("convert", src, dst, "--block-size", "16", "--overwrite"), fragment
    )
    assert snapshot(tmp_path) == before


def test_damaged_data_found_while_converting(
    tmp_path: Path, bad_compressed_chunk, corrupt_first_chunk, gzip_h5ad, snapshot
) -> None:
    """A file whose metadata is fine but whose X data chunk is corrupt: the converter
    stops with the one-line message and removes its temporary store; verify too."""
    src = bad_compressed_chunk(tmp_path)
    check_source(src)  # the metadata checks cannot see it
    dst = tmp_path / "out.zarr"
    before = snapshot(tmp_path)
    code, out, err = run_cli("convert", src, dst, "--quiet")
    assert_one_line_error(code, out, err, "reading X/data failed (")
    assert "the file is corrupt or truncated; copy or download it again" in err
    assert snapshot(tmp_path) == before
    good = gzip_h5ad(tmp_path)
    good_dst = tmp_path / "good.zarr"
    assert run_cli("convert", good, good_dst, "--quiet")[0] == 0
    corrupt_first_chunk(good)
    code, out, err = run_cli("verify", good, good_dst)
    assert_one_line_error(code, out, err, f"SRC {good}: reading X failed (")


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "abc"])
def test_bad_block_size(tmp_path: Path, good_h5ad: Path, value: str) -> None:
    dst = tmp_path / "out.zarr"
    code, out, err = run_cli("convert", good_h5ad, dst, f"--block-size={value}")
    assert_one_line_error(code, out, err, "must be a positive integer")
    assert value in err
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_by_missing_column_lists_available(tmp_path: Path, good_h5ad: Path) -> None:
    dst = tmp_path / "out.zarr"
    args = ("convert", good_h5ad, dst, "--order", "stratified", "--by", "donor")
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, "--by 'donor': no such obs column")
    assert "available: plate, score, name" in err
    assert not list(tmp_path.iterdir())


def test_dst_exists_without_overwrite(tmp_path: Path, good_h5ad: Path, snapshot) -> None:
    dst = tmp_path / "out.zarr"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    code, out, err = run_cli("convert", good_h5ad, dst, "--block-size", "16")
    assert_one_line_error(code, out, err, f"DST {dst} exists: pass --overwrite to replace it")
    assert snapshot(tmp_path) == before


def test_overwrite_never_replaces_a_non_store_directory(
    tmp_path: Path, good_h5ad: Path, snapshot
) -> None:
    dst = tmp_path / "home"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    before = snapshot(tmp_path)
    code, out, err = run_cli("convert", good_h5ad, dst, "--overwrite")
    assert_one_line_error(code, out, err, "is a non-empty directory that is not a zarr store")
    assert snapshot(tmp_path) == before


def test_dst_is_src(tmp_path: Path, good_h5ad: Path, snapshot) -> None:
    before = snapshot(good_h5ad)
    code, out, err = run_cli("convert", good_h5ad, good_h5ad, "--overwrite")
    assert_one_line_error(code, out, err, "is SRC, inside it or contains it")
    assert snapshot(good_h5ad) == before


def test_dst_parent_missing(tmp_path: Path, good_h5ad: Path) -> None:
    dst = tmp_path / "no" / "such" / "out.zarr"
    code, out, err = run_cli("convert", good_h5ad, dst)
    assert_one_line_error(code, out, err, f"parent directory {dst.parent} does not exist")
    assert not (tmp_path / "no").exists()


def test_dst_under_a_regular_file(tmp_path: Path, good_h5ad: Path, snapshot) -> None:
    """Genuinely unwritable even for root: a path whose parent is a regular file."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = snapshot(tmp_path)
    code, out, err = run_cli("convert", good_h5ad, afile / "x.zarr")
    assert_one_line_error(code, out, err, f"{afile} is a file, not a directory")
    assert snapshot(tmp_path) == before


def test_dst_parent_not_writable(tmp_path: Path, good_h5ad: Path, chattr_immutable) -> None:
    """chmod does not stop root, so as root the parent is made immutable (chattr +i),
    which refuses writes to everyone; without chattr support the case is skipped."""
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() == 0:
        if not chattr_immutable(parent, True):
            pytest.skip("running as root and chattr +i is not supported here")
        undo = lambda: chattr_immutable(parent, False)  # noqa: E731
    else:
        parent.chmod(0o500)
        undo = lambda: parent.chmod(0o700)  # noqa: E731
    try:
        code, out, err = run_cli("convert", good_h5ad, parent / "out.zarr")
        listing = list(parent.iterdir())
    finally:
        undo()
    assert_one_line_error(code, out, err, f"cannot write in {parent}")
    assert "choose a writable DST" in err
    assert listing == []


def test_not_enough_disk_space(tmp_path: Path, good_h5ad: Path, monkeypatch) -> None:
    def tiny(path):
        return type("usage", (), {"total": 10**6, "used": 10**6 - 1000, "free": 1000})()

    monkeypatch.setattr(space.shutil, "disk_usage", tiny)
    dst = tmp_path / "out.zarr"
    code, out, err = run_cli("convert", good_h5ad, dst)
    assert_one_line_error(code, out, err, "not enough disk space: need ~")
    assert "have 0.0 MB; free space or choose another DST" in err
    assert not list(tmp_path.iterdir())


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def plain_and_gzip(tmp_path_factory, small_adata) -> tuple[Path, Path]:
    """One dataset written twice: uncompressed and gzip (a 2.7x smaller file)."""
    root = tmp_path_factory.mktemp("space")
    a = small_adata(3000, 400)
    a.write_h5ad(root / "plain.h5ad")
    a.write_h5ad(root / "gzip.h5ad", compression="gzip")
    return root / "plain.h5ad", root / "gzip.h5ad"


def _estimate(src: Path, codec: str) -> int:
    from sclayout.convert.source import Source, open_group

    with open_group(src) as root:
        return space.estimate_store_bytes(Source(root, src), codec)


@pytest.mark.parametrize("codec", ["blosc-lz4", "zstd", "none"])
def test_store_size_estimate_follows_the_values_and_codec_not_the_source_file(
    tmp_path: Path, plain_and_gzip, codec: str
) -> None:
    plain, gz = plain_and_gzip
    assert plain.stat().st_size > 2 * gz.stat().st_size
    est_plain, est_gz = _estimate(plain, codec), _estimate(gz, codec)
    assert abs(est_plain - est_gz) < 0.15 * est_plain  # the same values: the same store
    dst = tmp_path / "out.zarr"
    code, _, err = run_cli("convert", gz, dst, "--codec", codec, "--quiet")
    assert code == 0, err
    assert 0.7 * _du(dst) < est_gz < 1.6 * _du(dst)


def test_store_size_estimate_sees_the_codec_ratio(plain_and_gzip) -> None:
    plain, _ = plain_and_gzip
    raw = _estimate(plain, "none")
    assert _estimate(plain, "zstd") < 0.75 * raw  # small integer counts compress well
    # uncompressed: 3 bytes per stored value at least (counts below 256 stored as
    # uint8, column ids as uint16: docs/store-format.md, compact dtypes)
    import h5py

    with h5py.File(plain) as f:
        nnz = f["X/data"].shape[0]
    assert raw >= 3 * nnz


TS_NO_SPACE = (
    'RESOURCE_EXHAUSTED: Error writing local file "{path}/c/0": Failed writing: '
    '"{path}/c/0.__lock": Failed to write 3479808 bytes to file 3: No space left on '
    "device [os_error_code='28']"
)
"""What tensorstore raises (a ValueError) when a shard write hits a full disk."""


@pytest.mark.parametrize(
    "error",
    [
        lambda path: ValueError(TS_NO_SPACE.format(path=path)),
        lambda path: OSError(errno.ENOSPC, "No space left on device", path),
    ],
    ids=["tensorstore", "oserror"],
)
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_disk_full_mid_write_is_one_line_exit_2_and_leaves_nothing(
    tmp_path: Path, good_h5ad: Path, good_store: Path, monkeypatch, error, existing: bool, snapshot
) -> None:
    from sclayout.convert import write

    dst = tmp_path / "out.zarr"
    if existing:
        shutil.copytree(good_store, dst)
    before = snapshot(tmp_path)
    opener, _ = write.WRITERS["tensorstore"]

    def full(arr, start, values):
        raise error(str(tmp_path))

    monkeypatch.setitem(write.WRITERS, "tensorstore", (opener, full))
    args = ("convert", good_h5ad, dst, "--block-size", "16", "--overwrite", "--quiet")
    code, out, err = run_cli(*args)
    assert code == 2
    assert_one_line_error(code, out, err, f"no space left on {space.device_of(tmp_path)} ")
    assert re.search(
        rf"while writing {re.escape(str(dst))} \(needs about \d+\.\d MB\): free space or "
        "choose another DST",
        err,
    ), err
    assert snapshot(tmp_path) == before  # no temporary sibling; an old DST untouched


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 512 KB file system (tmpfs) under tmp_path; skips where mounting is not
    allowed (not root, no tmpfs)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_real_full_disk(small_fs: Path, plain_and_gzip, monkeypatch) -> None:
    plain, _ = plain_and_gzip  # a store of ~0.7 MB: more than the 512 KB
    dst = small_fs / "out.zarr"
    code, out, err = run_cli("convert", plain, dst, "--quiet")
    assert_one_line_error(code, out, err, "not enough disk space: need ~")  # the pre-check
    assert list(small_fs.iterdir()) == []
    # the pre-check passed, as when another process fills the disk after it
    convert_mod = importlib.import_module("sclayout.convert.convert")
    monkeypatch.setattr(convert_mod, "check_free_space", lambda dst, need: None)
    code, out, err = run_cli("convert", plain, dst, "--quiet")
    assert code == 2
    assert_one_line_error(code, out, err, f"no space left on {small_fs} while writing {dst}")
    assert list(small_fs.iterdir()) == []  # the temporary store removed


def test_real_process_exit_code_and_no_traceback(tmp_path: Path, bad_truncated) -> None:
    """The installed entry point, not just CliRunner: exit 2, one line on stderr."""
    exe = Path(sys.executable).parent / "sclayout"
    src = bad_truncated(tmp_path)
    r = subprocess.run(
        [str(exe), "convert", str(src), str(tmp_path / "out.zarr")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: SRC ")
    assert not (tmp_path / "out.zarr").exists()


# -- library level -------------------------------------------------------------------


def test_check_source_accepts_h5ad_and_zarr_v2_v3(tmp_path: Path, small_adata) -> None:
    import anndata as ad

    a = small_adata()
    a.write_h5ad(tmp_path / "a.h5ad")
    for fmt in (2, 3):
        with ad.settings.override(zarr_write_format=fmt):
            a.write_zarr(tmp_path / f"a{fmt}.zarr")
    for name in ("a.h5ad", "a2.zarr", "a3.zarr"):
        info = checks.inspect_source(tmp_path / name)
        assert (info.n_obs, info.n_vars, info.x_encoding) == (a.n_obs, a.n_vars, "csr_matrix")
        assert info.obs_columns == tuple(a.obs.columns)


def test_check_source_reads_no_rows(tmp_path: Path, monkeypatch, small_adata, write_h5ad) -> None:
    """Metadata only: reading any array's values goes through __getitem__ (h5py, zarr)."""
    import anndata as ad
    import h5py
    import zarr

    a = small_adata()
    paths = [write_h5ad(a, tmp_path / "a.h5ad")]
    for fmt in (2, 3):
        with ad.settings.override(zarr_write_format=fmt):
            a.write_zarr(tmp_path / f"a{fmt}.zarr")
        paths.append(tmp_path / f"a{fmt}.zarr")

    def forbidden(self, *args, **kwargs):
        raise AssertionError(f"check_source read values of {self.name}")

    for cls, names in (
        (h5py.Dataset, ("__getitem__", "read_direct")),
        (zarr.Array, ("__getitem__", "get_basic_selection", "get_orthogonal_selection")),
    ):
        for name in names:
            monkeypatch.setattr(cls, name, forbidden)
    for p in paths:
        check_source(p)


def test_check_destination_overwrite_replaces_only_stores(tmp_path: Path) -> None:
    store = tmp_path / "old.zarr"
    store.mkdir()
    (store / "zarr.json").write_text("{}")
    check_destination(store, overwrite=True)  # a zarr store may be replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    check_destination(empty, overwrite=True)
    afile = tmp_path / "f.h5ad"
    afile.write_text("x")
    with pytest.raises(InputError, match="exists and is not a zarr store"):
        check_destination(afile, overwrite=True)
    check_destination(tmp_path / "new.zarr", overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "f.h5ad", "old.zarr"]
