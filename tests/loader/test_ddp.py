"""DDP with 2 real processes (gloo, localhost): ranks are disjoint, have equal batch
counts (a collective per step never hangs), and together cover the epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest

# argv: store path, rank, world size, port. Each rank reads with rank/world_size taken
# from the initialised process group, and all-reduces once per minibatch as a
# training step would: unequal batch counts would pair mismatched collectives.

SCRIPT = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from loader import BlockDataset
path, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
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
dist.barrier()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ranks(stores, run_ranks):
    return [json.loads(out) for out in run_ranks(SCRIPT, stores["shuffled"])]


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
