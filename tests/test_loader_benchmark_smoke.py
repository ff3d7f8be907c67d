"""benchmarks/loader.py in its tiny smoke mode: runs end to end and writes sane results.

Speed targets live in the benchmark script, never here (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks" / "loader.py"


@pytest.mark.slow
def test_loader_benchmark_quick(tmp_path, run_benchmark):
    run_benchmark(BENCH, "--quick", "--results", tmp_path)
    payload = json.loads((tmp_path / "loader.json").read_text())
    rows = payload["rows"]
    kinds = {(r["kind"], r["source"], r.get("output", "dense")) for r in rows}
    assert ("random", "h5ad", "dense") in kinds and ("h5ad", "h5ad", "dense") in kinds
    for order in ("original", "shuffled", "stratified"):
        for output in ("dense", "csr"):
            assert ("store", order, output) in kinds
    assert {r["regime"] for r in rows} == {"cold", "evicting"}
    for r in rows:
        assert r["cells_per_s"] > 0 and r["cells"] > 0
        assert 0 <= r["diversity"] <= 1.2
    # a shuffled store mixes plates like random sampling; the sorted h5ad does not
    shuffled = [r["diversity"] for r in rows if r["source"] == "shuffled"]
    assert min(shuffled) > 0.9
    assert payload["meta"]["quick"] is True
    md = (tmp_path / "loader.md").read_text()
    assert "benchmarks/loader.py --quick" in md and "| true random (h5ad) |" in md
    png = tmp_path / "loader.png"
    assert png.stat().st_size < 300_000


@pytest.mark.slow
def test_loader_benchmark_compares_codecs_panels_and_cores(tmp_path, run_benchmark):
    """``--codecs a,b``: one store per order and codec, each measured and labelled;
    ``--panel-genes``: the panel row once with random rows, once with random blocks;
    ``--cores-row 1``: the dataset row in a child pinned to one CPU, for each of
    ``--cores-outputs``, on ``--cores-spec``'s store and settings, and the memory copy
    control beside it. (The store rows are dense only: the quick run covers CSR.)"""
    spec = BENCH.parent / "specs" / "tahoe_like_200k.json"
    run_benchmark(
        BENCH, "--quick", "--results", tmp_path, "--orders", "shuffled", "--outputs", "dense",
        "--codecs", "blosc-lz4,blosc-lz4hc", "--workers", 0, "--regimes", "evicting",
        "--panel-genes", 20, "--cores-row", "1", "--cores-regimes", "warm",
        "--cores-outputs", "dense,csr", "--cores-spec", spec,
    )  # fmt: skip
    payload = json.loads((tmp_path / "loader.json").read_text())
    sources = {r["source"] for r in payload["rows"] if r["kind"] == "store"}
    assert sources == {"shuffled/blosc-lz4", "shuffled/blosc-lz4hc"}
    assert payload["meta"]["codecs"] == ["blosc-lz4", "blosc-lz4hc"]
    md = (tmp_path / "loader.md").read_text()
    assert "Stores: blosc-lz4, blosc-lz4hc" in md
    panel = [r for r in payload["rows"] if r.get("panel_genes")]
    assert sorted((r["source"], r["rows_by"]) for r in panel) == [
        (s, by) for s in ("shuffled/blosc-lz4", "shuffled/blosc-lz4hc") for by in ("blocks", "rows")
    ]
    assert md.count("20-gene panel, 50% random rows") == md.count("50% random whole blocks") == 2
    assert [c["output"] for c in payload["cores"]] == ["dense", "csr"]
    for core in payload["cores"]:
        assert (core["cores"], core["regime"], core["vs_one_core"]) == (1, "warm", 1.0)
        assert (core["source"], core["block_size"], core["fetch_factor"]) == (
            "spec tahoe_like_200k",
            256,
            64,
        )
        assert core["cells_per_s"] > 0 and core["diversity"] > 0.9
        assert core["copies_per_s"] > 0 and core["copies_vs_one_core"] == 1.0  # the control
    assert "| taskset -c | cache | output |" in md


def test_loader_benchmark_refuses_unknown_codecs(monkeypatch, capsys):
    """The command line's parser refuses the codec (in this process: no interpreter and
    torch to start for an argument error)."""
    import importlib.util
    import sys

    import pytest

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script edits sys.path
    monkeypatch.delenv("SCLAYOUT_TUNE_MALLOC", raising=False)  # _common sets it
    spec = importlib.util.spec_from_file_location("loader_bench_script", BENCH)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as bad:
        script._parse(["--quick", "--codecs", "lzma"])
    assert bad.value.code == 2 and "--codecs: unknown lzma; known:" in capsys.readouterr().err
