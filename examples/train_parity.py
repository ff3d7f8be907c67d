"""Does block sampling train as well as true random sampling?

Trains one small classifier (an MLP on log1p-normalised counts) to predict a label
from expression, with four ways of drawing minibatches from the *same* label-sorted
training file, and scores each on a held-out split:

- ``random``       (a) true random rows: a fresh permutation of the training rows each
                   epoch, rows gathered from an in-memory copy.
- ``streaming``    (b) sequential streaming through the sorted file
                   (``BlockDataset(strategy="streaming")``).
- ``block_h5ad_plain`` (c0) ``BlockDataset(path)`` on the raw, sorted h5ad as a new user
                   writes it: defaults but the batch size and seed, no ``label=``; the
                   ``LowDiversityWarning`` it gives (it finds the column the file is
                   sorted by) is shown in its row.
- ``block_h5ad``   (c) ``BlockDataset`` block_shuffle on the raw, sorted h5ad.
- ``block_store``  (d) ``BlockDataset`` on a store written by ``sclayout convert`` with the
                   settings ``sclayout recommend`` picks (order, block size, fetch factor).

Datasets (``--datasets``, both by default when the real-data folder is present):

- ``pbmc``: real PBMC cells (SoupX pbmc4k, label = ``Annotation``, 5 cell types; the 20
  unassigned ``?`` cells are dropped). The *source cells* are split 80/20 per cell
  type before tiling; each side is tiled separately with ``sclayout.testing.datasets.tile_real``
  (binomial-thinning noise), so no held-out cell has a noisy copy in the training set.
  The training file is sorted by cell type on disk.
- ``tahoe``: the Tahoe-like synthetic set (``make_tahoe_like``); label = ``cell_line``,
  one whole plate is held out as the test split, the other plates are the training
  file, sorted by cell line.

Fair comparison: every scheme runs the same number of optimiser steps on full
minibatches of the same size, by default one epoch of the training file, so every
scheme except ``random`` (a permutation, also each row once) sees each training row
exactly once; only the order differs. Streaming over a label-sorted file therefore
sees the labels one after another and ends on the last one: that is the failure mode
block sampling is meant to avoid. (With fewer steps than an epoch, streaming would not
even see the later labels.)

Reported per scheme (mean ± sd over ``--seeds`` seeds): macro-F1 and accuracy on the
held-out split, the diversity ratio of the label over the training minibatches
(``sclayout.cost.diversity.diversity_ratio``; 1.0 = as diverse as random), end-to-end
training cells/s and wall time (warm page cache: the files fit in RAM here; cold-cache
throughput is in ``benchmarks/``). Outputs ``parity.md``, ``parity.json`` and
``parity.png`` in ``--out``.

Run::

    python examples/train_parity.py                       # full run, a few minutes on 2 cores
    python examples/train_parity.py --smoke --out /tmp/p  # tiny data, a few steps, < 30 s
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PBMC_FILE = "soupx_pbmc4k_half_2170x33694_counts.h5ad"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MEASURED_PROFILE = (
    Path(__file__).resolve().parents[1] / "benchmarks/results/presets/local-disk-here.json"
)
"""A profile measured on the project's VM (kept with the benchmarks, not in the wheel)."""
DEFAULT_CACHE = Path.home() / ".cache" / "sclayout-bench" / "parity"
TARGET_SUM = 1e4
"""Counts per cell after normalisation (the usual scanpy ``normalize_total`` target)."""


# ----------------------------------------------------------------------------- model
def log1p_normalise(x):
    """Scale each row of a count tensor to ``TARGET_SUM`` total, then ``log1p``."""
    import torch

    return torch.log1p(x * (TARGET_SUM / x.sum(dim=1, keepdim=True).clamp_min(1.0)))


def make_mlp(n_in: int, n_out: int, *, seed: int, hidden: int = 256, layernorm: bool = False):
    """A two-layer MLP, initialised from its own generator (no global RNG state).

    ``layernorm`` puts a LayerNorm before the ReLU (a robustness check: it keeps hidden
    units from dying). The last layer is always ``model[-1]``.
    """
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    # skip_init: nn.Linear's own initialisation would draw from the global generator
    first, last = (
        nn.utils.skip_init(nn.Linear, a, b) for a, b in ((n_in, hidden), (hidden, n_out))
    )
    norm = [nn.LayerNorm(hidden)] if layernorm else []
    model = nn.Sequential(first, *norm, nn.ReLU(), last)
    with torch.no_grad():
        for layer in (first, last):
            nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=g)
            bound = 1.0 / math.sqrt(layer.weight.shape[1])
            nn.init.uniform_(layer.bias, -bound, bound, generator=g)
    return model


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int) -> float:
    """Macro-averaged F1 over the classes present in ``y_true`` or ``y_pred``."""
    cm = np.bincount(y_true * n_classes + y_pred, minlength=n_classes**2).reshape(n_classes, -1)
    tp = np.diag(cm).astype(float)
    support, predicted = cm.sum(1), cm.sum(0)
    present = (support + predicted) > 0
    f1 = np.divide(2 * tp, support + predicted, out=np.zeros_like(tp), where=present)
    return float(f1[present].mean())


# ----------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Prepared:
    """A training file sorted by label, and the held-out split in memory."""

    name: str
    train_path: Path
    label: str
    classes: tuple[str, ...]
    train_y: np.ndarray  # canonical label code of every training row, in file order
    test_X: sp.csr_matrix
    test_y: np.ndarray
    split: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_vars(self) -> int:
        return int(self.test_X.shape[1])


def _split_and_write(adata, label: str, train_rows, test_rows, work: Path) -> tuple[Path, Path]:
    import anndata as ad

    paths = []
    for part, rows in (("train", train_rows), ("test", test_rows)):
        sub = adata[np.sort(rows)]
        out = ad.AnnData(X=sp.csr_matrix(sub.X, dtype=np.float32), obs=sub.obs[[label]].copy())
        out.var_names = sub.var_names
        out.obs[label] = out.obs[label].cat.remove_unused_categories()
        p = work / f"{part}_source.h5ad"
        out.write_h5ad(p)
        paths.append(p)
    return paths[0], paths[1]


def prepare_pbmc(work: Path, *, n_obs: int, n_vars: int, seed: int) -> Prepared:
    """Real PBMC cells, tiled to ``n_obs``; source cells split 80/20 before tiling."""
    import anndata as ad

    from sclayout.testing.datasets import tile_real

    label = "Annotation"
    a = ad.read_h5ad(SHARED_DATA / PBMC_FILE)
    a = a[a.obs[label].astype(str) != "?"].copy()
    a.obs[label] = a.obs[label].cat.remove_unused_categories()
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
    codes = a.obs[label].cat.codes.to_numpy()
    test_rows = np.concatenate(
        [
            rng.permutation(np.flatnonzero(codes == c))[: round(0.2 * (codes == c).sum())]
            for c in np.unique(codes)
        ]
    )
    train_rows = np.setdiff1d(np.arange(a.n_obs), test_rows)
    # Keep the n_vars genes detected in most training cells (chosen without the test cells).
    detected = np.asarray((a.X[train_rows] > 0).mean(axis=0)).ravel()
    a = a[:, np.sort(np.argsort(-detected, kind="stable")[:n_vars])].copy()
    train_src, test_src = _split_and_write(a, label, train_rows, test_rows, work)
    n_test = max(len(test_rows), n_obs // 10)
    # test_fraction=0: the held-out cells are already out (split above, stratified).
    tile_real(
        [train_src], work / "train.h5ad", n_obs=n_obs, label=label, seed=seed, test_fraction=0.0
    )
    tile_real(
        [test_src], work / "test.h5ad", n_obs=n_test, label=label, seed=seed + 1, test_fraction=0.0
    )
    split = (
        f"{len(test_rows)} of {a.n_obs} source cells (20% per cell type) held out before "
        f"tiling; train tiled to {n_obs:,} cells, test tiled to {n_test:,} noisy copies of "
        "the held-out cells only"
    )
    return _load(work / "train.h5ad", work / "test.h5ad", "pbmc", label, split)


def prepare_tahoe(work: Path, *, n_obs: int, n_vars: int, seed: int) -> Prepared:
    """Tahoe-like synthetic set; the last plate is held out, the rest sorted by label."""
    import anndata as ad

    from sclayout.testing.datasets import make_tahoe_like

    label, plate = "cell_line", "plate"
    make_tahoe_like(
        work / "raw.h5ad", n_obs=n_obs, n_vars=n_vars, seed=seed, nnz_per_cell=max(1, n_vars // 4)
    )
    a = ad.read_h5ad(work / "raw.h5ad")
    held = a.obs[plate].cat.categories[-1]
    is_test = (a.obs[plate] == held).to_numpy()
    train = a[~is_test]
    train = train[np.argsort(train.obs[label].cat.codes.to_numpy(), kind="stable")].copy()
    train.write_h5ad(work / "train.h5ad")
    a[is_test].copy().write_h5ad(work / "test.h5ad")
    split = f"plate {held!r} held out ({is_test.sum():,} cells); train = the other plates"
    return _load(work / "train.h5ad", work / "test.h5ad", "tahoe", label, split)


def _load(train: Path, test: Path, name: str, label: str, split: str) -> Prepared:
    import anndata as ad

    tr = ad.read_h5ad(train, backed="r")
    classes = tuple(str(c) for c in tr.obs[label].cat.categories)
    train_y = tr.obs[label].cat.codes.to_numpy().astype(np.int64)
    tr.file.close()
    te = ad.read_h5ad(test)
    test_cats = [str(c) for c in te.obs[label].cat.categories]
    test_y = remap(test_cats, classes)[te.obs[label].cat.codes.to_numpy()]
    return Prepared(name, train, label, classes, train_y, as_csr32(te.X), test_y, split)


def as_csr32(x: Any) -> sp.csr_matrix:
    """float32 CSR with int32 indices and indptr (when they fit).

    An h5ad may store ``indptr`` as int64 and ``indices`` as int32; scipy then casts
    the whole ``indices`` array to a common dtype on *every* row selection (measured:
    1.2 s per minibatch on 100,000 × 2,000), so the dtypes are unified once here.
    """
    x = sp.csr_matrix(x, dtype=np.float32)
    if x.nnz < np.iinfo(np.int32).max:
        x.indices = x.indices.astype(np.int32, copy=False)
        x.indptr = x.indptr.astype(np.int32, copy=False)
    return x


def remap(categories: list[str], classes: tuple[str, ...]) -> np.ndarray:
    """Array mapping a file's category codes to the canonical class codes."""
    pos = {c: i for i, c in enumerate(classes)}
    return np.array([pos[c] for c in categories], dtype=np.int64)


DATASETS: dict[str, Callable[..., Prepared]] = {"pbmc": prepare_pbmc, "tahoe": prepare_tahoe}


def prepare(name: str, work: Path, *, n_obs: int, n_vars: int) -> Prepared:
    """Build dataset ``name`` in ``work``, or reuse it if a previous run finished it."""
    done = work / "prepared.json"
    if done.exists():
        info = json.loads(done.read_text())
        print(f"== {name}: reusing {work}", flush=True)
        return _load(work / "train.h5ad", work / "test.h5ad", name, info["label"], info["split"])
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    print(f"== {name}: building {n_obs:,} cells x {n_vars} genes in {work}", flush=True)
    prep = DATASETS[name](work, n_obs=n_obs, n_vars=n_vars, seed=0)
    done.write_text(json.dumps({"label": prep.label, "split": prep.split}))  # written last
    return prep


# ----------------------------------------------------------------------------- sclayout CLI
def sclayout_cmd(*args: str) -> list[str]:
    """The ``sclayout`` command next to this interpreter (or through ``python -c``)."""
    exe = Path(sys.executable).parent / "sclayout"
    if exe.exists():
        return [str(exe), *args]
    return [sys.executable, "-c", "from sclayout.cli import main; main()", *args]


def run_cli(*args: str, echo: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``sclayout ARGS`` as a real subprocess, printing the command first."""
    if echo:
        print("$ sclayout " + " ".join(args), flush=True)
    res = subprocess.run(sclayout_cmd(*args), text=True, capture_output=True)
    if echo and res.stdout:
        print(res.stdout.rstrip(), flush=True)
    if res.returncode and check:
        raise RuntimeError(f"`sclayout {' '.join(args)}` failed ({res.returncode}): {res.stderr}")
    return res


SMOKE_SPACE = (
    "--block-sizes",
    "16,64,256",
    "--fetch-factors",
    "4,16",
    "--codecs",
    "blosc-lz4,none",
)
"""``recommend``'s search grid in a smoke run: a sample of the default grid, enough to
exercise the search without pricing all of it."""


def recommended_store(
    prep: Prepared,
    work: Path,
    *,
    batch_size: int,
    min_diversity: float,
    profile: str,
    space: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``sclayout recommend`` then ``sclayout convert --spec``; falls back loudly.

    ``space``: extra ``recommend`` options narrowing its search grid.
    """
    spec = work / "spec.json"
    store = work / "store.zarr"
    res = run_cli(
        "recommend",
        str(prep.train_path),
        "--batch-size",
        str(batch_size),
        "--label",
        prep.label,
        "--min-diversity",
        str(min_diversity),
        "--profile",
        profile,
        "--spec-out",
        str(spec),
        "--overwrite",  # a re-run replaces its own spec
        *space,
        check=False,
    )
    if res.returncode == 0 and spec.exists():
        source = "sclayout recommend"
    else:
        from loader.layout import RowOrder
        from loader.spec import LayoutSpec, LoaderSettings, StoreSpec

        banner = "!" * 78
        print(
            f"\n{banner}\n! sclayout recommend FAILED or is missing: {res.stderr.strip()[:200]}"
            f"\n! FALLING BACK to explicit settings (stratified by {prep.label}, block 16,"
            f" fetch 16)\n{banner}\n",
            flush=True,
        )
        LayoutSpec(
            store=StoreSpec(block_size=16, order=RowOrder("stratified", 0, (prep.label,))),
            loader=LoaderSettings(batch_size=batch_size, fetch_factor=16),
        ).save(spec)
        source = "FALLBACK: explicit settings (recommend unavailable)"
    run_cli("convert", str(prep.train_path), str(store), "--spec", str(spec), "--overwrite")
    return {
        "store": store,
        "spec": spec,
        "settings_source": source,
        "spec_json": json.loads(spec.read_text()),
    }


# ----------------------------------------------------------------------------- schemes
Batches = Iterator[tuple[Any, np.ndarray]]  # (float32 count tensor, canonical labels)
Scheme = tuple[Callable[[int], Batches], dict[str, Any]]  # (epoch -> batches, settings used)


def _random_rows(prep: Prepared, *, seed: int, batch_size: int, **_: Any) -> Scheme:
    import anndata as ad
    import torch

    X = as_csr32(ad.read_h5ad(prep.train_path).X)

    def epoch(e: int) -> Batches:
        perm = np.random.default_rng(np.random.SeedSequence([seed, e])).permutation(X.shape[0])
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            rows = perm[i : i + batch_size]
            yield torch.from_numpy(X[rows].toarray()), prep.train_y[rows]

    return epoch, {"source": "in-memory CSR", "sampling": "permutation per epoch"}


def _block_dataset(path: Path, prep: Prepared, *, label: bool = True, **kwargs: Any) -> Scheme:
    import warnings

    import torch

    from loader import BlockDataset
    from loader.diversity import LowDiversityWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LowDiversityWarning)
        if label:
            kwargs["label"] = prep.label
        ds = BlockDataset(path, obs=(prep.label,), output="dense", **kwargs)
    warned = [str(w.message) for w in caught if issubclass(w.category, LowDiversityWarning)]
    to_canonical = remap([str(c) for c in ds.categories[prep.label]], prep.classes)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)

    def epoch(e: int) -> Batches:
        ds.set_epoch(e)
        for batch in loader:
            yield batch["X"], to_canonical[batch["obs"][prep.label].numpy()]

    settings = {
        "path": Path(path).name,
        "strategy": ds.strategy,
        "block_size": ds.block_size,
        "fetch_factor": ds.fetch_factor,
        "batch_size": ds.batch_size,
        # what the dataset warned when made (low predicted diversity), shown in the report
        "warning": warned[0] if warned else None,
    }
    return epoch, settings


def _streaming(prep: Prepared, *, seed: int, batch_size: int, **_: Any) -> Scheme:
    return _block_dataset(
        prep.train_path, prep, batch_size=batch_size, seed=seed, strategy="streaming"
    )


def _block_h5ad_plain(prep: Prepared, *, seed: int, batch_size: int, **_: Any) -> Scheme:
    # every setting at its default and no label=: the dataset finds the sorted column
    return _block_dataset(prep.train_path, prep, label=False, batch_size=batch_size, seed=seed)


def _block_h5ad(prep: Prepared, *, seed: int, batch_size: int, **_: Any) -> Scheme:
    # the loader's defaults for a raw h5ad (block 64 rows, fetch factor 64)
    return _block_dataset(prep.train_path, prep, batch_size=batch_size, seed=seed)


SMALL_BLOCKS = (16, 64)
"""(c'): block size and fetch factor of scDataset's suggested setting (b16/f64): a fetch
of 4,096 rows from 256 blocks, so a minibatch mixes far more of a sorted file."""


def _block_h5ad_small(prep: Prepared, *, seed: int, batch_size: int, **_: Any) -> Scheme:
    block, fetch = SMALL_BLOCKS
    return _block_dataset(
        prep.train_path,
        prep,
        batch_size=batch_size,
        seed=seed,
        block_size=block,
        fetch_factor=fetch,
    )


def _block_store(prep: Prepared, *, seed: int, batch_size: int, store: dict, **_: Any) -> Scheme:
    return _block_dataset(
        store["store"], prep, batch_size=batch_size, seed=seed, spec=store["spec"]
    )


SCHEMES: dict[str, tuple[str, Callable[..., Scheme]]] = {
    "random": ("(a) true random rows (in memory)", _random_rows),
    "streaming": ("(b) sequential streaming, sorted h5ad", _streaming),
    "block_h5ad_plain": ("(c0) BlockDataset(path), raw h5ad, no label", _block_h5ad_plain),
    "block_h5ad": ("(c) BlockDataset block_shuffle, raw h5ad, defaults + label", _block_h5ad),
    "block_h5ad_small": (
        "(c') BlockDataset block_shuffle, raw h5ad, small blocks",
        _block_h5ad_small,
    ),
    "block_store": ("(d) BlockDataset, converted store (recommend)", _block_store),
}


# ----------------------------------------------------------------------------- train / eval
class Waited:
    """Wrap an iterable; ``seconds`` sums the time spent waiting for its items."""

    def __init__(self, iterable: Any) -> None:
        self._it = iter(iterable)
        self.seconds = 0.0

    def __iter__(self) -> Waited:
        return self

    def __next__(self) -> Any:
        t = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.seconds += time.perf_counter() - t


def train_one(
    prep: Prepared,
    epoch_fn,
    *,
    steps: int,
    seed: int,
    batch_size: int,
    lr: float,
    hidden: int,
    layernorm: bool = False,
    progress: bool,
    desc: str,
) -> dict[str, Any]:
    """Train for exactly ``steps`` full minibatches; return held-out scores and timings."""
    import torch
    from tqdm import tqdm

    from sclayout.cost.diversity import diversity_ratio

    model = make_mlp(prep.n_vars, len(prep.classes), seed=seed, hidden=hidden, layernorm=layernorm)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    seen: list[np.ndarray] = []
    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=False)
    t0, epoch, data_s = time.perf_counter(), 0, 0.0
    while len(seen) < steps:
        batches = Waited(epoch_fn(epoch))
        for X, y in batches:
            if len(y) != batch_size:  # a short last batch: skipped by every scheme alike
                continue
            loss = torch.nn.functional.cross_entropy(model(log1p_normalise(X)), torch.from_numpy(y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(y)
            bar.update()
            if len(seen) == steps:
                break
        data_s += batches.seconds
        epoch += 1
    wall = time.perf_counter() - t0
    bar.close()
    pred = predict(model, prep.test_X)
    return {
        "macro_f1": macro_f1(prep.test_y, pred, len(prep.classes)),
        "accuracy": float((pred == prep.test_y).mean()),
        "diversity": float(diversity_ratio(seen, prep.train_y, batch_size=batch_size)),
        "labels_seen": len(np.unique(np.concatenate(seen))),
        "dead_units": dead_units(model, prep.test_X),
        "cells_per_s": steps * batch_size / wall,
        "data_cells_per_s": steps * batch_size / data_s,
        "data_s": data_s,
        "wall_s": wall,
    }


def dead_units(model, X: sp.csr_matrix, n: int = 4096) -> float:
    """Fraction of hidden ReLU units inactive on all of the first ``n`` held-out cells.

    A network whose units all died predicts one constant class: the failure mode of
    minibatches whose label mix shifts abruptly (docs/benchmarks.md, "Training parity").
    """
    import torch

    with torch.no_grad():
        x = torch.from_numpy(X[:n].toarray().astype(np.float32))
        h = model[:-1](log1p_normalise(x))  # after the ReLU
    return float((h.max(dim=0).values <= 0).float().mean())


def predict(model, X: sp.csr_matrix, chunk: int = 4096) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, X.shape[0], chunk):
            x = torch.from_numpy(X[i : i + chunk].toarray().astype(np.float32))
            out.append(model(log1p_normalise(x)).argmax(1).numpy())
    return np.concatenate(out)


# ----------------------------------------------------------------------------- report
def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "macro_f1",
        "accuracy",
        "diversity",
        "dead_units",
        "cells_per_s",
        "data_cells_per_s",
        "wall_s",
    )
    return {
        k: {
            "mean": float(np.mean([r[k] for r in runs])),
            "sd": float(np.std([r[k] for r in runs], ddof=1)) if len(runs) > 1 else 0.0,
        }
        for k in keys
    }


def _sampling(settings: dict[str, Any]) -> str:
    if "block_size" not in settings:
        return "rows"
    if settings["strategy"] == "streaming":
        return "sequential"
    return f"{settings['block_size']} / {settings['fetch_factor']}"


def _warned(settings: dict[str, Any]) -> str:
    """The table's cell for a scheme's ``LowDiversityWarning``: its predicted diversity."""
    text = settings.get("warning")
    if not text:
        return "no"
    m = re.search(r"predicted diversity of (\S+) is ([0-9.]+)", text)
    return f"yes: {m.group(1)} {m.group(2)}" if m else "yes"


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"Command: `{cfg['command']}`  ",
        f"{cfg['seeds']} seeds, batch {cfg['batch_size']}, MLP {cfg['hidden']} hidden"
        f"{' with LayerNorm' if cfg.get('layernorm') else ''}, "
        f"Adam lr {cfg['lr']}, {cfg['threads']} torch threads; mean ± sd over seeds.",
        "",
        "| dataset | scheme | block / fetch | macro-F1 | accuracy | diversity | labels seen "
        "| dead units | loader cells/s | train cells/s | wall s | warned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ds in results["datasets"].values():
        for name, r in ds["schemes"].items():
            s = r["summary"]
            lines.append(
                f"| {ds['name']} | {SCHEMES[name][0]} | {_sampling(r['settings'])} | "
                f"{100 * s['macro_f1']['mean']:.1f} ± "
                f"{100 * s['macro_f1']['sd']:.1f} | {100 * s['accuracy']['mean']:.1f} ± "
                f"{100 * s['accuracy']['sd']:.1f} | {s['diversity']['mean']:.3f} | "
                f"{r['runs'][0]['labels_seen']}/{len(ds['classes'])} | "
                f"{100 * s['dead_units']['mean']:.0f}% | "
                f"{s['data_cells_per_s']['mean']:,.0f} | {s['cells_per_s']['mean']:,.0f} | "
                f"{s['wall_s']['mean']:.1f} | {_warned(r['settings'])} |"
            )
    lines.append("")
    for ds in results["datasets"].values():
        for name, r in ds["schemes"].items():
            if r["settings"].get("warning"):
                lines.append(
                    f"- {ds['name']}, {name}: BlockDataset warned: {r['settings']['warning']}"
                )
    for ds in results["datasets"].values():
        lines.append(
            f"- **{ds['name']}**: {ds['n_train']:,} training cells × {ds['n_vars']} genes, "
            f"{len(ds['classes'])} classes ({ds['label']}), {ds['steps']} steps "
            f"(= {ds['steps'] * cfg['batch_size'] / ds['n_train']:.2f} epochs); test: "
            f"{ds['split']}."
        )
        if "block_store" in ds["schemes"]:
            st = ds["store"]
            lines.append(
                f"  - (d) settings from {st['settings_source']}: `{json.dumps(st['spec'])}`"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["datasets"].values())
    metrics = (
        ("macro_f1", "held-out macro-F1"),
        ("diversity", "diversity ratio"),
        ("data_cells_per_s", "loader cells/s (log)"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    width = 0.8 / max(1, len(datasets))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for j, ds in enumerate(datasets):
            names = list(ds["schemes"])
            m = [ds["schemes"][n]["summary"][key]["mean"] for n in names]
            e = [ds["schemes"][n]["summary"][key]["sd"] for n in names]
            ax.bar(np.arange(len(names)) + j * width, m, width, yerr=e, label=ds["name"], capsize=2)
            ax.set_xticks(np.arange(len(names)) + width * (len(datasets) - 1) / 2)
            ax.set_xticklabels([SCHEMES[n][0].split()[0] for n in names])
        ax.set_title(title, fontsize=10)
        if key == "data_cells_per_s":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    caption = (
        "(a) random rows   (b) streaming   (c0) raw h5ad, BlockDataset(path)   "
        "(c) raw h5ad, block 64 / fetch 16   "
        "(c') raw h5ad, block 16 / fetch 64   (d) converted store, recommended"
    )
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def _args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``--smoke`` shrinks the data, the seeds and the steps."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    have_real = (SHARED_DATA / PBMC_FILE).exists()
    p.add_argument(
        "--datasets",
        nargs="+",
        choices=list(DATASETS),
        default=["pbmc", "tahoe"] if have_real else ["tahoe"],
    )
    p.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="default: one epoch of the train set")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layernorm", action="store_true", help="LayerNorm before the ReLU")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steadiest on a busy 2-core machine)",
    )
    p.add_argument("--pbmc-cells", type=int, default=100_000)
    p.add_argument("--tahoe-cells", type=int, default=60_000)
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--min-diversity", type=float, default=0.95)
    p.add_argument(
        "--profile",
        default=str(MEASURED_PROFILE),
        help="storage profile for recommend (preset or JSON; default: measured on this machine)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="datasets and stores")
    p.add_argument("--smoke", action="store_true", help="tiny data, a few steps (< 30 s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.pbmc_cells, args.tahoe_cells, args.genes = 1, 3000, 3000, 200
        args.steps = args.steps or 20
        if args.cache == DEFAULT_CACHE:
            args.cache = args.out / "cache"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    import torch

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "config": {
            "command": "python examples/train_parity.py " + " ".join(argv or sys.argv[1:]),
            "seeds": args.seeds,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "hidden": args.hidden,
            "layernorm": args.layernorm,
            "threads": torch.get_num_threads(),
            "min_diversity": args.min_diversity,
            "profile": args.profile,
            "machine": platform.platform(),
        },
        "datasets": {},
    }
    n_cells = {"pbmc": args.pbmc_cells, "tahoe": args.tahoe_cells}
    for name in args.datasets:
        results["datasets"][name] = _run_dataset(args, name, n_cells[name])

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parity.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (args.out / "parity.md").write_text(table)
    plot(results, args.out / "parity.png")
    print("\n" + table)
    print(f"wrote {args.out / 'parity.md'}, parity.json, parity.png")
    return results


def _run_dataset(args: argparse.Namespace, name: str, n_obs: int) -> dict[str, Any]:
    """Prepare one dataset (and its recommended store) and train every scheme on it."""
    work = args.cache / f"{name}-{n_obs}x{args.genes}"
    prep = prepare(name, work, n_obs=n_obs, n_vars=args.genes)
    steps = args.steps or len(prep.train_y) // args.batch_size
    entry: dict[str, Any] = {
        "name": name,
        "label": prep.label,
        "classes": list(prep.classes),
        "n_train": len(prep.train_y),
        "n_test": len(prep.test_y),
        "n_vars": prep.n_vars,
        "split": prep.split,
        "steps": steps,
        "schemes": {},
    }
    store = None
    if "block_store" in args.schemes:
        store = recommended_store(
            prep,
            work,
            batch_size=args.batch_size,
            min_diversity=args.min_diversity,
            profile=args.profile,
            space=SMOKE_SPACE if args.smoke else (),
        )
        entry["store"] = {
            "settings_source": store["settings_source"],
            "spec": {k: store["spec_json"][k] for k in ("store", "loader")},
        }
    for scheme in args.schemes:
        runs, settings = [], None
        for seed in range(args.seeds):
            r, settings = _train_scheme(args, prep, name, scheme, seed, steps, store)
            runs.append(r)
        entry["schemes"][scheme] = {
            "settings": settings,
            "runs": runs,
            "summary": summarise(runs),
        }
    return entry


def _train_scheme(
    args: argparse.Namespace,
    prep: Any,
    name: str,
    scheme: str,
    seed: int,
    steps: int,
    store: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train one seed of one scheme; return its figures and the scheme's settings."""
    epoch_fn, settings = SCHEMES[scheme][1](
        prep,
        seed=seed,
        batch_size=args.batch_size,
        store=store,
    )
    r = train_one(
        prep,
        epoch_fn,
        steps=steps,
        seed=seed,
        batch_size=args.batch_size,
        lr=args.lr,
        hidden=args.hidden,
        layernorm=args.layernorm,
        progress=not args.quiet,
        desc=f"{name} {scheme} s{seed}",
    )
    print(
        f"   {name:6s} {scheme:12s} seed {seed}: macro-F1 {r['macro_f1']:.3f}  "
        f"acc {r['accuracy']:.3f}  diversity {r['diversity']:.3f}  "
        f"{r['cells_per_s']:,.0f} cells/s  {r['wall_s']:.1f} s",
        flush=True,
    )
    return r, settings


if __name__ == "__main__":
    main()
