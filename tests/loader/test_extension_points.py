"""The two documented extension points of ``loader``: a custom sampling strategy
(:func:`loader.advanced.register_strategy`) and a custom read backend
(:func:`loader.advanced.register_backend`), each registered here from outside the
package and used through the public API."""

from __future__ import annotations

import importlib
from typing import ClassVar

import numpy as np
import pytest
import zarr

import loader
from loader import advanced, backends
from loader.errors import InputError
from loader.strategies import Segments, Strategy

# the module (``loader.advanced.strategies`` is the function listing the names)
strategies = importlib.import_module("loader.strategies")


@pytest.fixture
def clean_registries(monkeypatch):
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(strategies, "_STRATEGIES", dict(strategies._STRATEGIES))
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))


def _reverse_blocks(cfg, rng) -> Segments:
    order = np.arange(cfg.n_blocks, dtype=np.int64)[::-1].copy()
    lengths = cfg.block_lengths[order]
    return Segments(order, np.zeros_like(lengths), lengths)


def test_a_custom_strategy_samples_through_block_dataset(clean_registries, synth_store):
    advanced.register_strategy(
        Strategy("reverse", _reverse_blocks, lambda cfg: cfg.n_obs, shuffle_rows=False)
    )
    assert "reverse" in advanced.strategies()
    ds = loader.BlockDataset(synth_store, batch_size=16, fetch_factor=1, strategy="reverse")
    rows = np.concatenate([np.asarray(b["index"]) for b in ds])
    reader = loader.open_layout(synth_store)
    starts = np.r_[0, np.cumsum(reader.block_lengths())]
    last_block_first = np.concatenate(
        [np.arange(starts[b], starts[b + 1]) for b in range(len(starts) - 2, -1, -1)]
    )
    assert np.array_equal(rows, np.asarray(reader.source_index())[last_block_first])


def test_an_unknown_strategy_names_the_registered_ones(clean_registries):
    advanced.register_strategy(Strategy("mine", _reverse_blocks, lambda cfg: cfg.n_obs))
    with pytest.raises(InputError, match=r"strategy='nope': unknown; known: .*\bmine\b"):
        strategies.get_strategy("nope")


class _PendingNow:
    def __init__(self, out: dict[str, np.ndarray]) -> None:
        self.out = out

    def result(self) -> dict[str, np.ndarray]:
        return self.out


class PlainZarrBackend:
    """Reads each range with zarr-python, one after the other (a minimal backend)."""

    kinds = ("store",)
    requests: ClassVar[list[set[str]]] = []

    def __init__(self, location: str, **options) -> None:
        self.location = location

    def _array(self, path: str):
        return zarr.open_array(f"{self.location}/{path}", mode="r")

    def submit(self, request):
        type(self).requests.append(set(request))
        out = {}
        for key, (path, ranges) in request.items():
            arr = self._array(path)
            out[key] = np.concatenate([arr[int(a) : int(b)] for a, b in ranges])
        return _PendingNow(out)

    def read_array(self, path: str) -> np.ndarray:
        return self._array(path)[...]


def test_a_custom_backend_reads_a_store(clean_registries, synth_store, synth_adata):
    advanced.register_backend("plain-zarr", PlainZarrBackend)
    assert advanced.get_backend("plain-zarr") is PlainZarrBackend
    PlainZarrBackend.requests = []
    reader = loader.open_layout(synth_store, backend="plain-zarr")
    fetched = reader.submit(np.arange(reader.n_blocks)).result()
    batch = fetched.take(np.arange(fetched.n_rows))
    assert PlainZarrBackend.requests  # the fetch went through the custom backend
    truth = synth_adata.X[np.asarray(batch["index"])]
    truth = truth.toarray() if hasattr(truth, "toarray") else np.asarray(truth)
    np.testing.assert_array_equal(batch["X"], truth)
    assert np.array_equal(np.sort(batch["index"]), np.arange(synth_adata.n_obs))


def test_a_backend_that_cannot_read_the_kind_is_refused(clean_registries, synth_store):
    class H5Only(PlainZarrBackend):
        kinds = ("h5ad",)

    advanced.register_backend("h5-only", H5Only)
    with pytest.raises(InputError, match=r"backend='h5-only' cannot read store sources"):
        loader.open_layout(synth_store, backend="h5-only")
