"""The parity example and the demo, in their smoke modes (as a user runs them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SCHEMES = (
    "random",
    "streaming",
    "block_h5ad_plain",
    "block_h5ad",
    "block_h5ad_small",
    "block_store",
)


def _module():
    """examples/train_parity.py imported as a module (examples/ is not a package)."""
    if "train_parity" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_parity", EXAMPLES / "train_parity.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_parity"] = mod  # dataclasses look their module up here
        spec.loader.exec_module(mod)
    return sys.modules["train_parity"]


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.parametrize(
    ("y_true", "y_pred", "expected"),
    [
        ([0, 1, 2, 2], [0, 1, 2, 2], 1.0),
        # class 0: P 1/2 R 1 F 2/3; class 1: P 1 R 1/2 F 2/3; class 2: F 1
        ([0, 1, 1, 2], [0, 0, 1, 2], (2 / 3 + 2 / 3 + 1) / 3),
        # a class predicted but absent from y_true counts, with F1 0 (sklearn's convention)
        ([0, 0], [0, 1], (2 / 3 + 0) / 2),
    ],
    ids=["perfect", "mixed", "predicted-only-class"],
)
def test_macro_f1(y_true, y_pred, expected):
    got = _module().macro_f1(np.array(y_true), np.array(y_pred), 3)
    assert got == pytest.approx(expected)


def test_log1p_normalise_scales_rows_to_target():
    import torch

    mod = _module()
    x = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [10.0, 0.0, 10.0]])
    y = mod.log1p_normalise(x)
    assert torch.allclose(
        torch.expm1(y).sum(1), torch.tensor([mod.TARGET_SUM, 0.0, mod.TARGET_SUM])
    )
    assert torch.allclose(torch.expm1(y[0]), torch.tensor([2500.0, 7500.0, 0.0]))


def test_mlp_init_is_seeded_without_global_state():
    import torch

    mod = _module()
    before = torch.random.get_rng_state()
    a, b, c = (mod.make_mlp(5, 3, seed=s) for s in (1, 1, 2))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a[0].weight, b[0].weight)
    assert not torch.equal(a[0].weight, c[0].weight)


@pytest.mark.slow
def test_train_parity_smoke(tmp_path):
    _run("train_parity.py", "--smoke", "--quiet", "--out", str(tmp_path), timeout=600)
    results = json.loads((tmp_path / "parity.json").read_text())
    expected = ["pbmc", "tahoe"] if SHARED_DATA.is_dir() else ["tahoe"]
    assert list(results["datasets"]) == expected
    for ds in results["datasets"].values():
        assert list(ds["schemes"]) == list(SCHEMES)
        assert ds["store"]["settings_source"] == "sclayout recommend"
        for scheme in ds["schemes"].values():
            (run,) = scheme["runs"]
            assert 0.0 <= run["macro_f1"] <= 1.0 and 0.0 <= run["accuracy"] <= 1.0
            assert run["cells_per_s"] > 0
        div = {k: v["runs"][0]["diversity"] for k, v in ds["schemes"].items()}
        # streaming a label-sorted file: a minibatch holds one or two labels
        assert div["streaming"] < 0.5
        assert div["random"] > 0.9 and div["block_store"] > 0.9
    table = (tmp_path / "parity.md").read_text()
    assert table.count("| (d) BlockDataset") == len(expected)
    for ds in results["datasets"].values():
        # the recommended store is diverse enough: no warning; one given is reported
        assert ds["schemes"]["block_store"]["settings"]["warning"] is None
        for name, scheme in ds["schemes"].items():
            if scheme["settings"].get("warning"):
                assert "predicted diversity" in scheme["settings"]["warning"]
                assert f"{ds['name']}, {name}: BlockDataset warned: " in table
    # BlockDataset(path) on the label-sorted tahoe file finds the sorted column itself;
    # it warns if its defaults mix too few blocks for it, and its row says either way
    plain = results["datasets"]["tahoe"]["schemes"]["block_h5ad_plain"]
    row = next(r for r in table.splitlines() if r.startswith("| tahoe | (c0) "))
    warning = plain["settings"]["warning"]
    if warning is None:
        assert plain["runs"][0]["diversity"] > 0.85 and row.endswith(" | no |")
    else:
        assert "predicted diversity of 'cell_line'" in warning
        assert row.endswith(" | yes: 'cell_line' " + warning.split(" is ")[1][:4] + " |")
    png = tmp_path / "parity.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000


@pytest.mark.slow
def test_demo_smoke(tmp_path):
    res = _run("demo.py", "--smoke", "--out", str(tmp_path), timeout=600)
    for command in ("recommend", "convert", "verify", "inspect", "bench"):
        assert f"$ sclayout {command} " in res.stdout
    # the summary sets the loader's measured speed (bench, the prediction's regime) beside
    # the recommended spec's prediction, with their ratio
    bench = json.loads((tmp_path / "bench.json").read_text())
    predicted = json.loads((tmp_path / "spec.json").read_text())["predicted"]["cells_per_s"]
    measured = bench["measured_cells_per_s"]
    assert measured > 0 and bench["profile"] == "local-disk-here"
    assert f"predicted {predicted:,.0f} cells/s, measured {measured:,.0f} cells/s" in res.stdout
    assert f"measured / predicted = {measured / predicted:.2f}" in res.stdout
    train = json.loads((tmp_path / "train.json").read_text())
    assert train["steps"] == 20 and train["cells"] == 20 * 64
    # the recommended store's minibatches are far more diverse than the sorted source's
    assert train["diversity"] > 0.9 > 0.5 > train["sequential_diversity"]
    assert (tmp_path / "store.zarr").is_dir() and (tmp_path / "spec.json").is_file()
