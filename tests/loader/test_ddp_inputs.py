"""The new inputs and hooks under DDP (2 ranks, gloo, localhost): a list of stores with
a gene panel and a rows mask, and a store with extra elements, a transform and float16.
Ranks are disjoint, have equal batch counts, cover the subset, and values equal the
source."""

from __future__ import annotations

import json

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

SCRIPT = r"""
import datetime, json, sys
import numpy as np
import torch, torch.distributed as dist
from loader import BlockDataset

def halve(batch):
    return {**batch, "X": batch["X"] / 2}

job, results = json.loads(sys.argv[1]), sys.argv[2]
rank, world, port = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=90))
out = {}
for name, kw in job.items():
    if "rows" in kw:
        kw["rows"] = np.asarray(kw["rows"], dtype=bool)
    if kw.pop("halve", False):
        kw["transform"] = halve
    ds = BlockDataset(kw.pop("path"), **kw)
    assert (ds.rank, ds.world_size) == (rank, world)
    batches = []
    for b in ds:
        step = torch.ones(1)
        dist.all_reduce(step)
        batches.append({k: (v.float().tolist() if k != "index" else v.tolist())
                        for k, v in b.items() if k != "obs"})
    out[name] = {"batches": batches, "len": len(ds)}
dist.barrier()
dist.destroy_process_group()
with open(f"{results}/{rank}.json", "w") as f:  # hundreds of KB: a file, not a pipe
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def ranks(stores, stores_n_obs, synth_store, run_ranks, tmp_path_factory):
    mask = np.random.default_rng(0).random(2 * stores_n_obs) < 0.6
    genes = [f"gene-{j}" for j in (3, 0, 11)] + ["absent"]
    job = {
        "list-panel-rows": dict(
            path=[stores["original"], stores["shuffled"]],
            var_names=genes,
            rows=mask.tolist(),
            batch_size=8,
            fetch_factor=2,
            seed=3,
        ),
        "extra-transform-dtype": dict(
            path=str(synth_store),
            extra=["obsm/X_pca"],
            halve=True,
            dtype="float16",
            batch_size=16,
            drop_last=True,
        ),
    }
    results = tmp_path_factory.mktemp("ranks")
    run_ranks(SCRIPT, json.dumps(job), str(results))
    outs = [json.loads((results / f"{r}.json").read_text()) for r in range(2)]
    return outs, mask, stores


def _rows(out, name):
    return [np.concatenate([b["index"] for b in r[name]["batches"]]) for r in out]


@pytest.mark.slow
def test_list_panel_rows_under_ddp(ranks, stores_n_obs):
    out, mask, stores = ranks
    a, b = _rows(out, "list-panel-rows")
    assert len(out[0]["list-panel-rows"]["batches"]) == len(out[1]["list-panel-rows"]["batches"])
    want = set(np.flatnonzero(mask).tolist())
    assert set(a.tolist()) | set(b.tolist()) == want
    assert len(set(a.tolist()) & set(b.tolist())) == (len(want) % 2)  # one padded row if odd
    X = ad.read_h5ad(stores["h5ad"]).X
    X = X.toarray() if sp.issparse(X) else X
    truth = np.concatenate([X[:, [3, 0, 11]], np.zeros((stores_n_obs, 1))], axis=1)
    for r in out:
        for batch in r["list-panel-rows"]["batches"]:
            i = np.asarray(batch["index"])
            assert np.allclose(np.asarray(batch["X"]), truth[i % stores_n_obs])


@pytest.mark.slow
def test_extra_transform_dtype_under_ddp(ranks, synth_adata):
    out, _, _ = ranks
    a, b = _rows(out, "extra-transform-dtype")
    n = synth_adata.n_obs
    assert a.size == b.size == (n // 2 // 16) * 16 and not set(a.tolist()) & set(b.tolist())
    X = synth_adata.X.toarray()
    for r in out:
        for batch in r["extra-transform-dtype"]["batches"]:
            i = np.asarray(batch["index"])
            want = (X[i].astype(np.float32).astype(np.float16) / 2).astype(np.float32)
            assert np.array_equal(np.asarray(batch["X"], dtype=np.float32), want)
            pca = synth_adata.obsm["X_pca"][i].astype(np.float32)
            assert np.array_equal(np.asarray(batch["obsm/X_pca"], dtype=np.float32), pca)
