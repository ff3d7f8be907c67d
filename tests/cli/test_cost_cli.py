"""``sclayout calibrate``, ``recommend`` and ``bench`` end to end on a small store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dask.utils import format_bytes

from loader.spec import LayoutSpec
from loader.store import open_layout
from sclayout.cost.profile import load_profile

HERE = str(Path(__file__).resolve().parents[2] / "benchmarks/results/presets/local-disk-here.json")
"""The profile measured on the project's VM (not shipped: benchmarks/results/presets/)."""

SMALL_SPACE = (
    "--block-sizes", "4,8,16", "--fetch-factors", "2,4,8", "--codecs", "blosc-lz4,zstd",
    "--worker-counts", "0", "--batch-size", "16",
)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_store):
    return shared_store


def test_recommend_spec_is_accepted_by_convert_and_the_dataset(data, tmp_path, run_cli):
    src, _ = data
    spec_path, plot = tmp_path / "spec.json", tmp_path / "front.png"
    r = run_cli(
        "recommend", src, "--label", "plate", "--profile", HERE,
        "--min-diversity", "0.9", "--spec-out", spec_path, "--plot", plot, "--json",
        *SMALL_SPACE,
    )  # fmt: skip
    assert r.exit_code == 0, r.output + r.stderr
    out = json.loads(r.stdout)
    spec = LayoutSpec.load(spec_path)
    assert spec.to_dict()["store"] == out["spec"]["store"]
    assert out["pick"]["diversity"] >= 0.9
    assert spec.predicted["cells_per_s"] == out["pick"]["cells_per_s"]
    ranked = out["ranked"]
    assert ranked[0] == {**out["pick"], "rank": 1}
    assert plot.stat().st_size < 300_000 and plot.read_bytes()[:4] == b"\x89PNG"

    from loader import BlockDataset
    from sclayout.convert.convert import convert

    manifest = convert(src, tmp_path / "picked.zarr", spec=spec_path)
    assert manifest.block_size == spec.store.block_size
    assert manifest.order.kind == spec.store.order.kind
    assert manifest.X.arrays["data"].codec == spec.store.codec
    ds = BlockDataset(tmp_path / "picked.zarr", spec=spec_path)
    assert (ds.batch_size, ds.fetch_factor) == (spec.loader.batch_size, spec.loader.fetch_factor)


def test_recommend_prints_a_ranked_table_and_the_reason(data, run_cli):
    src, _ = data
    r = run_cli("recommend", src, "--label", "plate", "--profile", "local-nvme", *SMALL_SPACE)
    assert r.exit_code == 0, r.stderr
    assert "profile: local-nvme (preset local-nvme)" in r.stdout
    assert "cells/s" in r.stdout and "divers." in r.stdout
    assert "pick: #1 — fastest predicted" in r.stdout


def test_recommend_predicts_for_a_given_core_count(data, run_cli):
    src, _ = data
    picks = {}
    for cores in ("2", "32"):
        args = ("recommend", src, "--label", "plate", "--profile", "local-nvme")
        r = run_cli(*args, *SMALL_SPACE, "--cores", cores, "--json", "--top", "1000")
        assert r.exit_code == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["profile_note"].endswith(f"predicted for {cores} cores")
        keys = ("block_size", "fetch_factor", "order", "codec", "csr_chunk_nnz", "workers")
        picks[cores] = {tuple(row[k] for k in keys): row for row in out["ranked"]}
    same = picks["2"].keys() & picks["32"].keys()
    assert same  # the same candidates, each at least as fast on 32 cores as on 2
    assert all(picks["32"][k]["cells_per_s"] >= picks["2"][k]["cells_per_s"] for k in same)
    assert any(picks["32"][k]["cells_per_s"] > picks["2"][k]["cells_per_s"] for k in same)


def test_recommend_on_a_store_recommends_loader_settings_and_judges_reconverting(data, run_cli):
    _, store = data
    r = run_cli(
        "recommend",
        store,
        "--label",
        "plate",
        "--profile",
        HERE,
        "--json",
        *SMALL_SPACE,
    )
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pick"]["block_size"] % open_layout(store).manifest.block_size == 0
    assert "re-converting would" in out["reconvert"]["verdict"]
    assert out["reconvert"]["gain"] > 0


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (("--min-diversity", "0"), ("--min-diversity=0.0: must be in (0, 1]",)),
        (("--min-diversity", "1.5"), ("--min-diversity=1.5: must be in (0, 1]",)),
        (
            ("--loader-memory", "1KB"),
            (f"--loader-memory={format_bytes(1000)}: too small", "smallest feasible budget is"),
        ),
        (
            ("--profile", "floppy"),
            ("profile preset 'floppy': unknown; known presets:", "local-nvme"),
        ),
        (("--label", "nope"), ("--label 'nope': no such obs column", "plate")),
        (("--block-sizes", "0,8"), ("--block-sizes='0,8'",)),
        (("--loader-memory", "10XB"), ("--loader-memory '10XB': not a size",)),
        (("--plot", "front.xyz"), ("--plot front.xyz: unknown image type '.xyz'",)),
        (("--spec-out", "no/such/dir/s.json"), ("--spec-out no/such/dir/s.json: folder",)),
        (
            ("--orders", "original", "--min-diversity", "1"),
            ("reaches it (best", "widen the search"),
        ),
    ],
    ids=["div-0", "div-1.5", "budget", "preset", "label", "block-sizes", "budget-unit",
         "plot-type", "spec-dir", "diversity-unreachable"],
)  # fmt: skip
def test_recommend_bad_input(data, args, parts, assert_one_line_error, run_cli):
    src, _ = data
    r = run_cli("recommend", src, "--profile", HERE, *SMALL_SPACE, "--label", "plate", *args)
    assert_one_line_error(r, *parts)


def test_the_smallest_feasible_budget_named_in_the_error_is_feasible(data, run_cli):
    """...and the old name of --loader-memory still works, with a note saying the new one."""
    import re

    src, _ = data
    args = (
        "recommend",
        src,
        "--profile",
        HERE,
        *SMALL_SPACE,
        "--min-diversity",
        "0.5",
    )
    err = run_cli(*args, "--loader-memory", "1KB").stderr
    budget = re.search(r"smallest feasible budget is (\d+MB)", err).group(1)
    r = run_cli(*args, "--memory-budget", budget)
    assert r.exit_code == 0
    assert r.stderr.splitlines() == [
        "note: recommend --memory-budget is deprecated; use --loader-memory"
    ]


def test_recommend_never_replaces_a_file_unasked(data, tmp_path, assert_one_line_error, run_cli):
    src, _ = data
    args = ("recommend", src, "--profile", HERE, *SMALL_SPACE, "--label", "plate")
    keep = tmp_path / "mine.json"
    keep.write_text("my notes")
    r = run_cli(*args, "--spec-out", keep, "--min-diversity", "0.5")
    assert_one_line_error(r, f"--spec-out {keep}: exists; pass --overwrite")
    assert keep.read_text() == "my notes"
    # the source itself, even with --overwrite
    r = run_cli(*args, "--spec-out", src, "--overwrite")
    assert_one_line_error(r, "is (inside) the input")
    assert Path(src).stat().st_size > 10_000
    # a plot that cannot be written: refused before the spec is written
    spec = tmp_path / "spec.json"
    r = run_cli(*args, "--spec-out", spec, "--plot", tmp_path / "nodir" / "f.png")
    assert_one_line_error(r, "--plot", "does not exist; create it first")
    assert not spec.exists()
    r = run_cli(*args, "--spec-out", keep, "--min-diversity", "0.5", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert json.loads(keep.read_text())["format"] == "sclayout-spec"
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temp left


def test_recommend_stratified_needs_a_label_and_a_source_must_be_anndata(
    data, tmp_path, assert_one_line_error, run_cli
):
    src, _ = data
    r = run_cli("recommend", src, "--profile", HERE, "--orders", "stratified")
    assert_one_line_error(r, "--orders stratified: needs --label COLUMN")
    (tmp_path / "notes.txt").write_text("hello")
    r = run_cli("recommend", tmp_path / "notes.txt", "--profile", HERE)
    assert_one_line_error(r, "is neither HDF5 (.h5ad) nor a zarr store")


@pytest.mark.parametrize(
    ("change", "part"),
    [
        ({"concurrency": [[1, "x"]]}, "concurrency="),
        ({"concurrency": [[1]]}, "concurrency="),
        ({"concurrency": [[1, float("nan")]]}, "concurrency="),
        ({"request_bytes": "abc"}, "request_bytes='abc'"),
        ({"codecs": []}, "incomplete or malformed"),
        ({"cores": float("inf")}, "cores=inf"),
    ],
    ids=["curve-str", "curve-short", "curve-nan", "request-bytes", "codecs-list", "cores-inf"],
)
def test_malformed_profile_is_a_one_line_error(
    data, tmp_path, change, part, assert_one_line_error, run_cli
):

    src, _ = data
    d = {**load_profile(HERE).to_dict(), **change}
    (tmp_path / "p.json").write_text(json.dumps(d))
    r = run_cli("recommend", src, "--profile", tmp_path / "p.json", *SMALL_SPACE)
    assert_one_line_error(r, part)


def test_recommend_searches_only_the_codecs_its_profile_measured(
    data, tmp_path, assert_one_line_error, run_cli
):
    """A profile calibrated before a codec existed: the default codec list skips the
    codec and says so; naming it with --codecs is a one-line error."""

    src, _ = data
    d = load_profile(HERE).to_dict()
    d["codecs"].pop("blosc-lz4hc", None)
    (tmp_path / "old.json").write_text(json.dumps(d))
    space = [a for a in SMALL_SPACE if a not in ("--codecs", "blosc-lz4,zstd")]
    r = run_cli("recommend", src, "--label", "plate", "--profile", tmp_path / "old.json", *space)
    assert r.exit_code == 0, r.stderr
    assert "not searched: blosc-lz4hc (recalibrate" in r.stdout
    args = ("recommend", src, "--label", "plate", *space, "--json", "--top", "1000")
    old = json.loads(run_cli(*args, "--profile", tmp_path / "old.json").stdout)
    new = json.loads(run_cli(*args, "--profile", HERE).stdout)
    assert "blosc-lz4hc" not in {row["codec"] for row in old["ranked"]}
    assert "blosc-lz4hc" in {row["codec"] for row in new["ranked"]}
    assert old["n_candidates"] < new["n_candidates"]
    d["codecs"] = {"gzip-9": d["codecs"]["gzip"]}  # knows none of the searched codecs
    (tmp_path / "none.json").write_text(json.dumps(d))
    r = run_cli("recommend", src, "--label", "plate", "--profile", tmp_path / "none.json", *space)
    assert_one_line_error(r, "measured none of the codecs searched", "sclayout calibrate")
    r = run_cli(
        "recommend", src, "--label", "plate", "--profile", tmp_path / "old.json", *space,
        "--codecs", "blosc-lz4hc",
    )  # fmt: skip
    assert_one_line_error(r, "codec='blosc-lz4hc': not in profile", "sclayout calibrate")


def test_unreadable_profile_file(data, tmp_path, assert_one_line_error, run_cli):
    src, _ = data
    (tmp_path / "bad.json").write_text("{oops")
    r = run_cli("recommend", src, "--profile", tmp_path / "bad.json", *SMALL_SPACE)
    assert_one_line_error(r, "is not valid JSON")


def test_bench_prints_measured_beside_predicted(data, run_cli):
    _, store = data
    r = run_cli(
        "bench",
        store,
        "--batch-size",
        "16",
        "--fetch-factor",
        "4",
        "--runs",
        "1",
        "--seconds",
        "0.5",
        "--label",
        "plate",
        "--profile",
        HERE,
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["measured_cells_per_s"] > 0 and out["predicted"]["cells_per_s"] > 0
    # a shuffled store: both the measurement and the prediction are random-like
    assert out["measured_diversity"] == pytest.approx(1.0, abs=0.1)
    assert out["predicted_diversity"] == pytest.approx(1.0, abs=0.05)
    # the loader's CPU per cell beside the model's, and the cores it kept busy
    assert out["settings"]["fetch_factor"] == 4 and out["measured_cpu_s_per_cell"] > 0
    cpu = out["predicted"]["cpu_s_per_cell"]
    assert out["cpu_relative_error"] == pytest.approx(cpu / out["measured_cpu_s_per_cell"] - 1)
    assert out["measured_cores"] > 0


def test_bench_reads_with_the_loaders_default_fetch_factor(data, run_cli):
    """Without --fetch-factor, bench measures and predicts what BlockDataset does."""
    from loader import BlockDataset

    _, store = data
    r = run_cli(
        "bench", store, "--batch-size", "16", "--runs", "1", "--seconds", "0.3",
        "--profile", HERE, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    default = BlockDataset(store, batch_size=16).fetch_factor
    assert json.loads(r.stdout)["settings"]["fetch_factor"] == default


@pytest.fixture
def smoke_quick(monkeypatch):
    """``--quick`` calibrations at the smoke plan's length: the same steps and output,
    hundredths of a second each (figures are not asserted)."""
    from sclayout.cost.calibrate import CalibrationPlan

    monkeypatch.setattr(CalibrationPlan, "quick", classmethod(lambda cls: cls.smoke()))


def test_calibrate_writes_a_profile(data, tmp_path, run_cli, smoke_quick):
    _, store = data
    r = run_cli("calibrate", store, "--out", tmp_path / "p.json", "--quick", "--json")
    assert r.exit_code == 0, r.stderr
    p = load_profile(tmp_path / "p.json")
    assert p.kind == "local" and [n for n, _ in p.concurrency] == [1, 2, 4, 8, 16, 32, 64]
    assert set(p.codecs) == {"blosc-lz4", "blosc-lz4hc", "blosc-zstd", "zstd", "gzip", "none"}
    out = json.loads(r.stdout)  # --json prints the profile just written
    assert out["out"] == str(tmp_path / "p.json")
    assert out["profile"] == json.loads((tmp_path / "p.json").read_text())


def test_calibrate_cpu_from_keeps_the_cpu_figures_of_a_preset(
    data, tmp_path, assert_one_line_error, run_cli
):

    _, store = data
    out = tmp_path / "p.json"
    r = run_cli("calibrate", store, "--out", out, "--quick", "--quiet", "--cpu-from", HERE)
    assert r.exit_code == 0, r.stderr
    p, preset = load_profile(out), load_profile(HERE)
    assert p.codecs == preset.codecs and p.cores == preset.cores
    assert p.densify_s_per_value == preset.densify_s_per_value
    assert p.latency_s != preset.latency_s  # the storage is this store's, measured now
    r = run_cli("calibrate", store, "--out", tmp_path / "q.json", "--cpu-from", "no-such-preset")
    assert_one_line_error(r, "no-such-preset")
    assert not (tmp_path / "q.json").exists()


def test_bench_times_a_dataset_of_one_minibatch_over_several_epochs(data, run_cli):
    _, store = data
    r = run_cli(
        "bench", store, "--batch-size", "100000", "--runs", "1", "--seconds", "0.3",
        "--profile", HERE, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)  # strict JSON: no NaN
    assert out["measured_cells_per_s"] > 0 and out["runs"][0]["batches"] >= 1


def test_calibrate_refuses_to_replace_a_file_before_measuring(
    data, tmp_path, assert_one_line_error, run_cli
):
    _, store = data
    keep = tmp_path / "p.json"
    keep.write_text("{}")
    r = run_cli("calibrate", store, "--out", keep, "--quick", "--quiet")
    assert_one_line_error(r, "exists; pass --overwrite")
    r = run_cli("calibrate", store, "--out", Path(store) / "zarr.json", "--overwrite")
    assert_one_line_error(r, "is (inside) the input")
    assert keep.read_text() == "{}"


def test_calibrate_bad_target(tmp_path, assert_one_line_error, run_cli):
    r = run_cli("calibrate", tmp_path / "nothing", "--out", tmp_path / "p.json")
    assert_one_line_error(r, "not a file, directory or http(s) URL")


def test_recommend_without_profile_calibrates_the_data_location_quickly(
    data, run_cli, smoke_quick, monkeypatch
):
    """The quick calibration times only the codecs --codecs asks to search."""
    import sclayout.cost.calibrate as calibrate_mod

    timed: list[tuple[str, ...]] = []
    real = calibrate_mod.measure_codecs

    def spy(*args, **kwargs):
        timed.append(tuple(kwargs["codecs"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "measure_codecs", spy)
    src, _ = data
    r = run_cli("recommend", src, "--label", "plate", *SMALL_SPACE, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert f"profile: quick calibration of {src}" in r.stdout
    assert timed == [("blosc-lz4", "zstd")]


def test_search_api_skips_default_codecs_an_old_profile_lacks(data):
    from dataclasses import replace

    from sclayout.cost.search import SearchSpace, measured_codecs, search
    from sclayout.cost.stats import read_dataset_stats

    src, _ = data
    prof = load_profile(HERE)
    old = replace(prof, codecs={k: v for k, v in prof.codecs.items() if k != "blosc-lz4hc"})
    space, missing = measured_codecs(SearchSpace(), old)
    assert missing == ("blosc-lz4hc",) and "blosc-lz4hc" not in space.codecs
    small = replace(space, block_sizes=(8,), fetch_factors=(4,), chunk_blocks=(1.0,))
    assert measured_codecs(small, old) == (small, ())  # a caller's own list is kept
    stats = read_dataset_stats(src, label="plate")
    got = search(stats, profile=old, batch_size=16)  # the default space: no error
    assert all(c.spec.store.codec != "blosc-lz4hc" for c in got.candidates)


def test_recommend_on_an_original_store_below_the_target_names_settings_and_conversion(
    data, tmp_path, make_store, run_cli
):
    """A store in source (sorted) order cannot reach the diversity target with any
    loader setting: recommend still prints the most diverse settings it has and the
    conversion that reaches the target, and exits 0."""
    src, _ = data
    store = tmp_path / "original.zarr"
    make_store(src, store, block_size=8, order="original", seed=3)
    args = ("recommend", store, "--label", "plate", "--profile", HERE)
    args += ("--min-diversity", "0.99", *SMALL_SPACE)
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["reconvert"]["meets_target"] is False
    assert out["pick"]["diversity"] == max(row["diversity"] for row in out["ranked"]) < 0.99
    assert out["reconvert"]["pick"]["diversity"] >= 0.99
    text = run_cli(*args)
    assert text.exit_code == 0, text.stderr
    assert "pick: #1 — no loader setting within the memory budget reaches diversity 0.99" in (
        text.stdout
    )
    assert "this store cannot reach diversity 0.99" in text.stdout
    assert "sclayout convert SRC DST --spec spec.json" in text.stdout
