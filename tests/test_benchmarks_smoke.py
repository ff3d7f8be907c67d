"""Benchmarks in their tiny smoke mode: they run end to end and write sane results.

Speed targets live in the benchmark scripts, never here (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.mark.slow  # three conversions in child processes: ~30 s
def test_convert_benchmark_quick(tmp_path, run_benchmark):
    run_benchmark(
        BENCH / "convert.py", "--quick", "--results", tmp_path / "results",
        "--work", tmp_path / "stores",
    )  # fmt: skip
    payload = json.loads((tmp_path / "results" / "convert.json").read_text())
    summary = {s["order"]: s for s in payload["summary"]}
    assert sorted(summary) == ["original", "shuffled", "stratified"]
    for order, s in summary.items():
        assert s["order_recorded"] == order
        assert s["source_mb_s"] > 0 and s["seconds"] > 0
        assert 0 < s["peak_rss"] < 2**32
        assert s["output_bytes"] > 0 and s["files"] > 0
        assert s["runs"] == 1
    assert payload["meta"]["quick"] is True
    md = (tmp_path / "results" / "convert.md").read_text()
    assert "| stratified |" in md and "benchmarks/convert.py --quick" in md
    assert not (tmp_path / "stores" / "original").exists()  # stores removed unless --keep


@pytest.mark.slow  # a small dataset, seven stores, a quick calibration
def test_costmodel_benchmark_smoke(tmp_path, run_benchmark):
    import os

    env = {**os.environ, "SCLAYOUT_BENCH_DIR": str(tmp_path / "cache")}
    run_benchmark(
        BENCH / "costmodel.py", "--smoke", "--profiles", "local", "--no-pick",
        "--out", tmp_path / "results", env=env,
    )  # fmt: skip
    doc = json.loads((tmp_path / "results" / "costmodel-smoke.json").read_text())
    # one configuration per store, and one with workers
    stores = [r["store"] for r in doc["rows"] if r["workers"] == 0]
    assert len(stores) == len(set(stores)) >= 7
    assert sum(r["workers"] > 0 for r in doc["rows"]) == 1
    for r in doc["rows"]:
        assert r["predicted"] > 0 and r["measured"] > 0
        assert r["rel_error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
    assert doc["summary"]["local"]["n"] == len(doc["rows"])
    assert (tmp_path / "results" / "costmodel-profile-local-smoke.json").exists()
    # predicted again from the stored calibrations (--repredict), by the same model: the
    # same figures (in this process: a second run of the script costs its start-up)
    import importlib.util

    spec = importlib.util.spec_from_file_location("costmodel_script", BENCH / "costmodel.py")
    script = importlib.util.module_from_spec(spec)
    again = json.loads(json.dumps(doc))
    for r in again["rows"]:
        r["predicted"] = 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, spec.name, script)  # its dataclasses look it up there
        mp.setattr(sys, "path", list(sys.path))  # the script edits sys.path
        spec.loader.exec_module(script)
        mp.setenv("SCLAYOUT_BENCH_DIR", env["SCLAYOUT_BENCH_DIR"])
        script.repredict(again, smoke=True)
    assert [r["predicted"] for r in again["rows"]] == pytest.approx(
        [r["predicted"] for r in doc["rows"]], rel=1e-9
    )


def test_fetch_size_benchmark_writes_a_row_per_regime_and_fetch(
    tmp_path_factory, tmp_path, run_benchmark, shared_store
):

    _, store = shared_store
    run_benchmark(
        BENCH / "fetch_size.py", "--store", store, "--fetch-factors", "1,2",
        "--regimes", "warm,cold", "--rounds", 1, "--seconds", 0.2, "--out", tmp_path,
        timeout=300,
    )  # fmt: skip
    rows = json.loads((tmp_path / "fetch_size.json").read_text())
    assert sorted((r["regime"], r["fetch_factor"]) for r in rows) == [
        ("cold", 1), ("cold", 2), ("warm", 1), ("warm", 2)
    ]  # fmt: skip
    for r in rows:
        # the smoke store is below SMALL_ARRAY_BYTES: the loader holds it in memory, and
        # the model prices it so (no reads), as it does for any small local array
        assert r["cells_per_s"] > 0 and r["model_planned_read_kb_per_cell"] == 0
    assert "| cold | 2 |" in (tmp_path / "fetch_size.md").read_text()


def test_codecs_benchmark_on_a_small_file(
    tmp_path, run_benchmark, tiny_tahoe_like, monkeypatch, capsys
):
    src = tiny_tahoe_like(tmp_path / "s.h5ad", n_obs=300, n_vars=200, nnz_per_cell=20)
    run_benchmark(
        BENCH / "codecs.py", "--source", src, "--codecs", "blosc-lz4,blosc-lz4hc,none",
        "--cells", 200, "--repeat", 1, "--results", tmp_path, timeout=300,
    )  # fmt: skip
    payload = json.loads((tmp_path / "codecs.json").read_text())
    rows = {r["codec"]: r for r in payload["rows"]}
    assert set(rows) == {"blosc-lz4", "blosc-lz4hc", "none"}
    assert rows["none"]["bytes_per_value"] == 8.0  # float32 value + int32 column id
    for r in rows.values():
        assert r["cells"] == 200 and r["decode_us_per_1k"] >= 0
    assert rows["blosc-lz4"]["bytes_per_value"] < 8.0  # counts compress
    assert "| s.h5ad | blosc-lz4hc |" in (tmp_path / "codecs.md").read_text()
    # an unknown codec: the command line's error (its parser, here: no interpreter to start)
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        _script("codecs", monkeypatch)._parse(["--codecs", "lzma"])
    assert bad.value.code == 2 and "--codecs: unknown lzma; known:" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_loader_threads_benchmark_on_a_small_store(tmp_path, run_benchmark, tiny_tahoe_like):
    from sclayout.convert import convert

    src = tiny_tahoe_like(tmp_path / "s.h5ad", n_obs=2000, n_vars=300, nnz_per_cell=30)
    store = tmp_path / "s.zarr"
    convert(src, store, block_size=16, order="shuffled", seed=0)
    from loader.engine.config import decode_threads

    run_benchmark(
        BENCH / "loader_threads.py", "--store", store, "--block-size", 16,
        "--fetch-factor", 2, "--runs", 1, "--whole-array-bytes", 0, "--results", tmp_path,
        timeout=300, env={**os.environ, "SCLAYOUT_DECODE": "threads"},
    )  # fmt: skip
    payload = json.loads((tmp_path / "loader_threads.json").read_text())
    assert set(payload["summary"]) == {"full", "no-scatter"}
    run = payload["runs"]["full"][0]
    assert run["cells"] > 1900  # one epoch of 2,000 rows, less the untimed first batch
    assert {"consumer (main)", "decode"} <= set(run["roles"])
    assert run["roles"]["decode"]["threads"] == decode_threads()  # one per core
    assert "| full | consumer (main) | 1 |" in (tmp_path / "loader_threads.md").read_text()
    # CSR output from the page cache: no dense scatter to leave out, so one pass
    run_benchmark(
        BENCH / "loader_threads.py", "--store", store, "--block-size", 16,
        "--fetch-factor", 2, "--runs", 1, "--whole-array-bytes", 0, "--results", tmp_path,
        "--output", "csr", "--cache", "warm", "--name", "csr_warm", timeout=300,
    )  # fmt: skip
    payload = json.loads((tmp_path / "csr_warm.json").read_text())
    assert set(payload["summary"]) == {"full"}
    assert payload["runs"]["full"][0]["cells"] > 1900
    assert ", csr, one epoch in the page cache," in (tmp_path / "csr_warm.md").read_text()


@pytest.mark.slow  # one tiny set, one conversion in a child process, two loader runs: ~8 s
def test_scale_table_reuses_its_sets_and_kept_stores(tmp_path, run_benchmark):
    work, results = tmp_path / "work", tmp_path / "results"
    args = [
        BENCH / "convert.py", "--scale", "2000", "--scale-nnz", "10", "--orders", "original",
        "--load-seconds", "0.1", "--work", work, "--results", results, "--keep",
    ]  # fmt: skip
    run_benchmark(*args)
    (src,) = (work / "data").glob("*.h5ad")
    store = work / "stores" / "2000" / "original" / "store.zarr"
    made = (src.stat().st_mtime_ns, (store / "zarr.json").stat().st_mtime_ns)
    first = json.loads((results / "convert-scale.json").read_text())["runs"][0]
    assert first["store_reused"] is False and first["load_cells"] > 0
    assert first["load_cpu_us_per_cell"] > 0 and first["epochs"] >= 1

    out = run_benchmark(*args)
    again = json.loads((results / "convert-scale.json").read_text())["runs"][0]
    assert (src.stat().st_mtime_ns, (store / "zarr.json").stat().st_mtime_ns) == made
    assert again["store_reused"] is True and "(kept store)" in out
    assert again["seconds"] == first["seconds"] and again["load_cells"] > 0
    assert "†" in (results / "convert-scale.md").read_text()


def test_the_benchmarks_specs_load():
    """The layout specs the benchmarks run (``peers.py --spec``) are valid specs."""
    from loader.spec import LayoutSpec

    specs = sorted((BENCH / "specs").glob("*.json"))
    assert specs
    for path in specs:
        spec = LayoutSpec.load(path)
        assert spec.store is not None and spec.loader is not None


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_soak_benchmark_samples_the_training_tree_and_sees_it_exit(
    tmp_path, run_benchmark, tiny_tahoe_like
):
    """The script end to end, in the training process alone (workers would cost a
    process start per epoch of this tiny store; the 30-minute run has them)."""
    from sclayout.convert import convert

    src = tiny_tahoe_like(tmp_path / "s.h5ad", n_obs=1000, n_vars=100, nnz_per_cell=10)
    store = tmp_path / "s.zarr"
    convert(src, store, block_size=16, order="shuffled", seed=0)
    out = run_benchmark(
        BENCH / "soak.py", "--store", store, "--minutes", 0.05, "--sample-seconds", 1,
        "--num-workers", 0, "--json", tmp_path / "r" / "soak.json", timeout=120,
    )  # fmt: skip
    payload = json.loads((tmp_path / "r" / "soak.json").read_text())
    samples = payload["samples"]
    assert len(samples) == 3  # 3 s, one sample a second
    for s in samples:
        assert s["pss_mib"] > 0 and s["threads"] >= 1
        assert s["fds"] >= s["fds_main"] >= 3
        assert s["children"] == len(s["pids"]) - 1 and s["pids"][0] != os.getpid()
    assert 0 < samples[0]["cells"] <= samples[1]["cells"] <= samples[2]["cells"]
    assert samples[-1]["epochs"] >= 1  # 1,000 cells take far less than 3 s
    assert set(payload["verdicts"]) == {"pss_mib", "fds", "fds_main", "threads", "children"}
    # told to stop, the training process and its whole tree exit by themselves
    e = payload["exit"]
    assert e["exited"] and e["returncode"] == 0 and e["left_running"] == []
    assert e["loop_stopped_s"] <= e["exit_s"] <= e["tree_gone_s"]
    md = (tmp_path / "r" / "soak.md").read_text()
    assert "| minute | epochs done | cells/s | tree PSS MiB | fds (tree) |" in md
    assert "- exit: loop stopped" in md and "its whole tree gone after" in md
    assert "- threads:" in md and md.strip() in out


@pytest.fixture
def soak_script(monkeypatch):
    """benchmarks/soak.py as a module (its sys.path and environment edits undone after)."""
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("SCLAYOUT_TUNE_MALLOC", raising=False)  # _common sets it
    spec = importlib.util.spec_from_file_location("soak_script", BENCH / "soak.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _soak_sample(epochs, threads, *, steady=True, pss=100.0):
    return {"epochs": epochs, "steady": steady, "pss_mib": pss, "fds": 10, "fds_main": 5,
            "threads": threads, "children": 2}  # fmt: skip


def test_soak_verdicts_compare_the_first_and_last_quarters_after_the_first_epoch(soak_script):
    verdicts = soak_script.verdicts
    # an epoch-0 sample and an unsteady one are left out; a thread of jitter is flat
    jitter = [_soak_sample(0, 10), _soak_sample(2, 99, steady=False)]
    jitter += [_soak_sample(e, t) for e, t in enumerate([34, 35, 34, 35, 34, 34, 35, 34], 1)]
    v = verdicts(jitter)["threads"]
    assert (v["samples"], v["window"], v["head"], v["tail"]) == (8, 2, 34.5, 34.5)
    assert v["flat"] is True and v["first"] == 34 and v["max_growth"] == pytest.approx(1 / 69)
    # one thread more each sample: a leak
    leak = verdicts([_soak_sample(e, 29 + e) for e in range(1, 9)])["threads"]
    assert (leak["head"], leak["tail"], leak["flat"]) == (30.5, 36.5, False)
    # the bound is 2 %, inclusive
    two = [_soak_sample(1, 1, pss=100.0), _soak_sample(2, 1, pss=102.0)]
    assert verdicts(two)["pss_mib"]["flat"] is True
    two[1]["pss_mib"] = 102.1
    assert verdicts(two)["pss_mib"]["flat"] is False
    assert verdicts(two[:1])["fds"]["flat"] is None


def test_soak_kills_a_training_process_that_does_not_exit(soak_script, tmp_path):
    status = soak_script.status_file(tmp_path / "status", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        e = soak_script.stop_child(proc, status, [proc.pid], timeout=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert status[soak_script.STOP] == 1  # it was told to stop
    assert e["exited"] is False and e["exit_s"] is None and e["loop_stopped_s"] is None
    assert proc.returncode == -9
    line = soak_script.exit_line(e)
    assert "did not exit within 0.5 s of the stop request" in line and "killed" in line


def _script(name: str, monkeypatch):
    """A benchmark script as a module (its sys.path and environment edits undone after)."""
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("SCLAYOUT_TUNE_MALLOC", raising=False)  # _common sets it
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCH / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_peers_sclayout_window_runs_epoch_after_epoch_until_its_time(
    tmp_path, monkeypatch, tiny_tahoe_like
):
    """A window is not cut at the end of a pass: on a store read many times over in
    the window's time, it lasts its seconds, spans several passes, and its rate is the
    cells it counted over its length. The conversion keeps its time and size."""
    peers = _script("peers", monkeypatch)
    src = tiny_tahoe_like(tmp_path / "s.h5ad", n_obs=600, n_vars=50, nnz_per_cell=5)
    doc = json.loads(peers.SPEC.read_text())
    doc["store"].update(block_size=16, csr_chunk_nnz=None)
    doc["loader"].update(fetch_factor=2)
    (tmp_path / "spec.json").write_text(json.dumps(doc))
    layout = peers.LayoutSpec.load(tmp_path / "spec.json")
    store = peers.spec_store(src, tmp_path, layout)
    record = json.loads(peers._record_path(store).read_text())
    assert record["convert_s"] > 0 and record["store_bytes"] > 0
    labels = peers._labels(src)
    run = peers._sclayout_run(
        store, labels, spec=layout, output="csr", workers=0, seconds=1.0, seed=0, warmup_s=0.1
    )
    assert run["window_s"] >= 1.0 and run["passes"] > 2
    assert run["cells_per_s"] == pytest.approx(run["cells"] / run["window_s"])
    assert 0.5 < run["diversity"] <= 1.05


def test_peer_window_spans_epochs_and_keeps_the_delivered_rows(tmp_path, monkeypatch):
    """peer_window.py's window over a loader of short epochs: it lasts its seconds
    across epochs, counts every row, and saves the full minibatches' source rows."""
    import time
    import types

    pw = _script("peer_window", monkeypatch)

    class NoEvictor:
        def __init__(self, path, period):
            pass

        def stop(self):
            return 0

    bl = types.SimpleNamespace(
        evict=lambda p: None, resident_fraction=lambda p: 0.0, Evictor=NoEvictor,
        EVICT_PERIOD=0.5,
    )  # fmt: skip

    def epoch():  # 3 minibatches of 64 rows and one of 10, then the epoch ends
        for lo in range(0, 202, 64):
            time.sleep(0.005)
            ids = np.arange(lo, min(lo + 64, 202))
            yield ids.size, ids

    import numpy as np

    args = pw._parse(["random", "x", "--harness", str(tmp_path), "--seconds", "0.4"])
    args.warmup_s, args.ids_out = 0.05, str(tmp_path / "ids.npy")
    rec = pw.window(bl, pw._epochs(epoch), "x", args)
    assert rec["window_s"] >= 0.4 and rec["cells"] > 3 * 202
    ids = np.load(tmp_path / "ids.npy")
    assert ids.shape == (ids.shape[0], 64) and ids.shape[0] >= 9
    assert set(np.unique(ids)) <= set(range(192))
    csr = pw._csr_collate(
        [{"indices": np.array([1, 4], np.int32), "data": np.ones(2, np.float32), "row": 7},
         {"indices": np.array([2], np.int32), "data": np.ones(1, np.float32), "row": 3}]
    )  # fmt: skip
    assert csr["indptr"].tolist() == [0, 2, 3] and csr["indices"].tolist() == [1, 4, 2]
    assert csr["row"].tolist() == [7, 3]


def test_open_large_builds_a_store_the_loader_reads_row_by_row(tmp_path, monkeypatch):
    """``open_large.py``'s synthetic store (built in this process, 3,000 rows): every
    source row read once, with the nnz its ``indptr`` says and the obs codes it wrote."""
    import importlib.util

    import numpy as np

    from loader import BlockDataset

    spec = importlib.util.spec_from_file_location("open_large_script", BENCH / "open_large.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script edits sys.path
    spec.loader.exec_module(script)
    n, store = 3000, tmp_path / "syn.zarr"
    script.build(store, n)
    row_of = np.empty(n, dtype=np.int64)  # store row of each source row
    row_of[(script.STEP * np.arange(n) + 7) % n] = np.arange(n)
    ds = BlockDataset(store, batch_size=64, obs=("cell_line", "drug"), output="csr")
    src, nnz, lines, drugs = [], [], [], []
    for batch in ds:
        src.append(batch["index"].numpy())
        nnz.append(np.diff(batch["X"].crow_indices().numpy()))
        lines.append(batch["obs"]["cell_line"].numpy())
        drugs.append(batch["obs"]["drug"].numpy())
    src = np.concatenate(src)
    assert np.array_equal(np.sort(src), np.arange(n))
    rows, every = row_of[src], script.EVERY
    assert np.array_equal(np.concatenate(nnz), (rows % every == 0).astype(np.int32))
    assert np.array_equal(np.concatenate(lines), (rows * 7919) % 50)
    assert np.array_equal(np.concatenate(drugs), (rows * 7919) % 380)
