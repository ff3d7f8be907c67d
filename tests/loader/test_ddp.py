"""DDP with 2 real processes (gloo, localhost): ranks are disjoint, have equal batch
counts (a collective per step never hangs), and together cover the epoch; a store
replaced between epochs is refused by every rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# argv: store path, a copy of it, another source, rank, world size, port. Each rank
# reads with rank/world_size taken from the initialised process group, and all-reduces
# once per minibatch as a training step would: unequal batch counts would pair
# mismatched collectives. Then each rank reads an epoch of the copy, rank 0 converts
# the other source over it (--overwrite), and each rank tries the next epoch.

SCRIPT = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from loader import BlockDataset
path, copy, other = sys.argv[1:4]
rank, world, port = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=90))
configs = {
    "keep": dict(batch_size=16, fetch_factor=2),
    "drop_last": dict(batch_size=16, fetch_factor=2, drop_last=True),
    "streaming": dict(batch_size=10, fetch_factor=3, strategy="streaming"),
}
out = {}
for name, kw in configs.items():
    ds = BlockDataset(path, seed=4, **kw)
    assert (ds.rank, ds.world_size) == (rank, world)
    ds.set_epoch(2)
    batches = []
    for b in ds:
        step = torch.ones(1)
        dist.all_reduce(step)
        assert step.item() == world
        batches.append(b["index"].tolist())
    out[name] = {"batches": batches, "len": len(ds)}
from loader.errors import StoreChangedError
ds = BlockDataset(copy, batch_size=16, seed=4)
first = [b["index"].tolist() for b in ds]
dist.barrier()
if rank == 0:
    from sclayout.convert import convert
    convert(other, copy, block_size=8, overwrite=True)
dist.barrier()
try:
    second, error = [b["index"].tolist() for b in ds], None
except StoreChangedError as e:
    second, error = [], str(e)
out["replaced"] = {"first": first, "second": second, "error": error}
dist.barrier()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def replaced(stores, tmp_path_factory, make_adata) -> dict[str, str]:
    """A copy of the shuffled store for the ranks to read, and another source (the
    same shape, other values) that rank 0 converts over it."""
    import shutil

    root = tmp_path_factory.mktemp("ddp_replaced")
    copy, other = root / "copy.zarr", root / "other.h5ad"
    shutil.copytree(stores["shuffled"], copy)
    n_obs, n_vars = stores["truth"]["h5ad"]["X"].shape
    make_adata(n_obs, n_vars, density=0.3, layers=False, obsm=False, uns=False, seed=12).write_h5ad(
        other
    )
    return {"copy": str(copy), "other": str(other)}


@pytest.fixture(scope="module")
def ranks(stores, replaced, run_ranks):
    outs = run_ranks(SCRIPT, stores["shuffled"], replaced["copy"], replaced["other"])
    return [json.loads(out) for out in outs]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["keep", "drop_last", "streaming"])
def test_ranks_disjoint_equal_and_complete(ranks, config, check_epoch, stores_n_obs):
    batch = 10 if config == "streaming" else 16
    drop_last = config == "drop_last"
    per_rank = [[np.asarray(b) for b in r[config]["batches"]] for r in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == ranks[0][config]["len"]
    assert ranks[1][config]["len"] == ranks[0][config]["len"]
    for batches in per_rank:
        check_epoch(
            [{"index": b} for b in batches],
            n_obs=stores_n_obs,
            batch_size=batch,
            drop_last=drop_last,
            exact=False,
        )
    a, b = (np.concatenate(r) for r in per_rank)
    if drop_last:  # disjoint; only the remainder is missing
        assert not set(a.tolist()) & set(b.tolist())
        assert a.size == b.size == ((stores_n_obs // 2) // batch) * batch
    else:  # every row; the odd row out is padded by repeating the epoch's first row
        assert set(a.tolist()) | set(b.tolist()) == set(range(stores_n_obs))
        assert a.size == b.size == (stores_n_obs + 1) // 2
        assert len(set(a.tolist()) & set(b.tolist())) == 1


def _generation(store: str | Path) -> str:
    from loader.store import read_manifest

    return read_manifest(str(store)).generation


@pytest.mark.slow
def test_every_rank_refuses_a_store_replaced_between_epochs(ranks, stores, replaced, stores_n_obs):
    """Each rank read a whole epoch of the old store, then refuses the next one."""
    was, now = _generation(stores["shuffled"]), _generation(replaced["copy"])
    assert was != now
    first = sorted(i for r in ranks for b in r["replaced"]["first"] for i in b)
    assert set(first) == set(range(stores_n_obs))
    for r in ranks:
        assert r["replaced"]["second"] == []
        assert r["replaced"]["error"] == (
            f"store {Path(replaced['copy']).resolve()} was replaced while this job read it "
            f"(generation {was} at start, now {now}): restart the job to read the new store"
        )
