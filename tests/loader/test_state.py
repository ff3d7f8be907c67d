"""Resume in a fresh process: ``state_dict()`` mid-epoch, ``load_state_dict()`` in a new
interpreter yields exactly the remaining minibatches (same rows, same values, same
order), with 0 and 2 DataLoader workers, on a real store through the real reader."""

from __future__ import annotations

import hashlib
import json

import pytest

from loader import BlockDataset
from loader import sampler as S

# Runs in a fresh interpreter. argv: store path, JSON job. The job names dataset
# settings, num_workers, and either an epoch + number of batches to take, or a state
# to resume from. DataLoader workers are forked: this process has read no data before
# they start, which is the case the loader documents as fork-safe.
SCRIPT = r"""
import hashlib, itertools, json, sys
import torch
from loader import BlockDataLoader, BlockDataset
results = []
for job in json.loads(sys.argv[1]):
    ds = BlockDataset(job["path"], **job["ds"])
    if job.get("state"):
        ds.load_state_dict(job["state"])
    else:
        ds.set_epoch(job["epoch"])
    w = job["num_workers"]
    it = BlockDataLoader(ds, num_workers=w, multiprocessing_context="fork") if w else ds
    take = job.get("take")
    out = []
    for b in (itertools.islice(it, take) if take is not None else it):
        X = b["X"].to_dense() if b["X"].layout == torch.sparse_csr else b["X"]
        out.append([b["index"].tolist(), hashlib.sha1(X.numpy().tobytes()).hexdigest()])
    results.append({"batches": out, "state": ds.state_dict()})
print(json.dumps(results))
"""

DS = {"batch_size": 12, "fetch_factor": 2, "seed": 7}


@pytest.fixture(scope="module")
def digest(as_numpy):
    """A batch's row ids and a hash of its values."""

    def digest(batch) -> list:
        X = as_numpy(batch["X"])
        return [batch["index"].tolist(), hashlib.sha1(X.tobytes()).hexdigest()]

    return digest


@pytest.fixture(scope="module")
def expected(digest):
    """The full epoch in DataLoader order, computed in this process (no workers)."""

    def expected(path: str, ds_kw: dict, epoch: int, num_workers: int) -> list:
        ds = BlockDataset(path, **ds_kw)
        ds.set_epoch(epoch)
        streams = [[digest(b) for b in ds._batches(w, num_workers)] for w in range(num_workers)]
        return [streams[w][j] for w, j in S.interleave([len(s) for s in streams])]

    return expected


@pytest.fixture(scope="module")
def run_jobs(run_python):
    """Run jobs in one fresh interpreter (each: path, ds settings, num_workers, and
    epoch + take, or a state to resume from)."""

    def run_jobs(*jobs: dict) -> list[dict]:
        return json.loads(run_python(SCRIPT, json.dumps(list(jobs))))

    return run_jobs


CASES = {"w0-dense": (0, "dense", 5), "w2-csr": (2, "csr", 7)}


@pytest.mark.slow
def test_resume_in_fresh_process(stores, digest, expected, run_jobs):
    """Case w0: state taken in this process; case w2: taken in a fresh interpreter
    with 2 DataLoader workers. Both resumed together in another fresh interpreter."""
    path = stores["shuffled"]
    plans = {}
    for name, (workers, output, take) in CASES.items():
        ds_kw = {**DS, "output": output}
        full = expected(path, ds_kw, epoch=1, num_workers=max(1, workers))
        plans[name] = (workers, ds_kw, take, full)
    workers, ds_kw, take, _ = plans["w0-dense"]
    ds = BlockDataset(path, **ds_kw)
    ds.set_epoch(1)
    it = iter(ds)
    heads = {"w0-dense": ([digest(next(it)) for _ in range(take)], ds.state_dict())}
    workers, ds_kw, take, _ = plans["w2-csr"]
    (first,) = run_jobs(dict(path=path, ds=ds_kw, epoch=1, num_workers=workers, take=take))
    heads["w2-csr"] = (first["batches"], first["state"])
    # Worker job first: tensorstore aborts a fork once this process has read with it.
    names = ["w2-csr", "w0-dense"]
    resumed = run_jobs(
        *[
            dict(path=path, ds=plans[n][1], state=heads[n][1], num_workers=plans[n][0])
            for n in names
        ]
    )
    for name, second in zip(names, resumed, strict=True):
        workers, _, take, full = plans[name]
        head, state = heads[name]
        assert state["consumed"] == take and state["epoch"] == 1, name
        assert state["num_workers"] == max(1, workers), name
        assert head == full[:take], name
        assert second["batches"] == full[take:], name  # same rows, values and order
        assert second["state"]["consumed"] == len(full), name


def test_resume_needs_the_same_workers(stores):
    ds = BlockDataset(stores["original"], **DS)
    state = {**ds.state_dict(), "consumed": 3, "num_workers": 2}
    ds.load_state_dict(state)
    with pytest.raises(Exception, match=r"state was saved with num_workers=2"):
        next(iter(ds))
