"""The public API of ``loader``: the option groups of ``BlockDataset`` and ``__all__``.

Every flat keyword a user writes (``seed=3``) makes the same dataset as its field in
its option group (``sampling=Sampling(seed=3)``), giving both is a one-line error, and
a group checks its fields when it is made. ``loader.__all__`` and
``loader.advanced.__all__`` are exactly the lists docs/loader.md documents, every name
imports, and ``import loader`` stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import loader
import loader.advanced
from loader import BlockDataset, Output, Reading, Sampling, Selection
from loader.errors import InputError
from loader.options import FLAT, GROUPS, gather

DOC = Path(__file__).resolve().parents[2] / "docs" / "loader.md"


def _double(batch: dict[str, Any]) -> dict[str, Any]:
    batch["X"] = batch["X"] * 2
    return batch


# One case per flat keyword (more may ride along, all of the same group): the value
# differs from the default, so a keyword that did not arrive would show. "path2" reads
# the store twice as a list of inputs.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "strategy": ("path", {"strategy": "streaming"}),
    "seed": ("path", {"seed": 7}),
    "weights": (
        "path",
        {
            "strategy": "weighted",
            "weights": {"plate00": 1.0, "plate02": 3.0},
            "class_column": "plate",
        },
    ),
    "class_column": ("path", {"strategy": "class_balanced", "class_column": "cell_line"}),
    "replacement": (
        "path",
        {"strategy": "weighted", "weights": np.linspace(1, 2, 600), "replacement": False},
    ),
    "num_samples": (
        "path",
        {"strategy": "weighted", "weights": np.linspace(1, 2, 600), "num_samples": 200},
    ),
    "store_weights": ("path2", {"store_weights": [3, 1]}),
    "drop_last": ("path", {"drop_last": True}),
    "obs": ("path", {"obs": ("plate", "cell_line")}),
    "rows": ("path", {"rows": {"plate": "plate01"}}),
    "var_names": ("path", {"var_names": ["gene-3", "gene-1", "not-a-gene"]}),
    "extra": ("path", {"extra": ("layers/counts", "obsm/X_pca")}),
    "matrix": ("path", {"matrix": "layers/counts"}),
    "dtype": ("path", {"dtype": "float16"}),
    "transform": ("path", {"transform": _double}),
    "fetch_factor": ("path", {"fetch_factor": 2}),
    "block_size": ("path", {"block_size": 32}),
    "backend": ("path", {"backend": "zarr"}),
    "prefetch": ("path", {"prefetch": 0}),
    "prefetch_next_epoch": ("path", {"prefetch_next_epoch": False}),
    "cache_dir": ("bucket", {"cache_dir": "/tmp/shards"}),
    "cache_limit": ("bucket", {"cache_dir": "/tmp/shards", "cache_limit": "2GB"}),
}
"""A "bucket" case needs a remote store: tests/test_s3_cache.py reads one with the
keyword; here its options are compared, not its batches."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return bool(a == b)


def _fields(options: dict[str, Any]) -> dict[str, Any]:
    """``{group.field: value}`` of a dataset's :attr:`~BlockDataset.options`."""
    return {
        f"{key}.{f.name}": getattr(group, f.name)
        for key, group in options.items()
        for f in dataclasses.fields(group)
    }


def _epoch(ds: BlockDataset) -> list[dict[str, Any]]:
    """One epoch of ``ds`` as numpy arrays (dense X), the dataset closed after it."""
    out = []
    with ds:
        for batch in ds:
            row = {}
            for k, v in batch.items():
                if k == "obs":
                    row.update({f"obs.{c}": np.asarray(x) for c, x in v.items()})
                else:
                    v = v.to_dense() if getattr(v, "is_sparse_csr", False) else v
                    row[k] = v.toarray() if hasattr(v, "toarray") else np.asarray(v)
            out.append(row)
    return out


def test_every_flat_keyword_has_a_case():
    assert set(FLAT) == set(CASES)


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_keyword_is_the_field_of_its_group(name):
    key = FLAT[name]
    kw = CASES[name][1]
    flat = gather(kw, {}, "f")
    grouped = gather({}, {key: GROUPS[key](**kw)}, "f")
    assert _fields(flat).keys() == _fields(grouped).keys()
    assert all(_same(_fields(flat)[k], v) for k, v in _fields(grouped).items())
    assert not _same(getattr(flat[key], name), getattr(GROUPS[key](), name))


def test_flat_keywords_make_the_dataset_of_their_group(synth_store):
    """Same options, same batches, and the value arrived (it differs from the default's)."""
    default = BlockDataset(synth_store, batch_size=32)
    plain = _fields(default.options)
    default.close()
    for name, (kind, kw) in CASES.items():
        if kind == "bucket":
            continue
        path = [synth_store, synth_store] if kind == "path2" else synth_store
        key = FLAT[name]
        flat = BlockDataset(path, batch_size=32, **kw)
        grouped = BlockDataset(path, batch_size=32, **{key: GROUPS[key](**kw)})
        got, want = _fields(flat.options), _fields(grouped.options)
        assert all(_same(got[k], want[k]) for k in want), name
        assert not _same(got[f"{key}.{name}"], plain[f"{key}.{name}"]), name
        a, b = _epoch(flat), _epoch(grouped)
        assert len(a) == len(b) > 0, name
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), name


def test_a_pickled_dataset_carries_no_options(synth_store):
    """A worker's copy leaves the weights (as long as the data) behind."""
    import pickle

    w = np.linspace(1, 2, 600)
    ds = BlockDataset(synth_store, strategy="weighted", weights=w)
    assert ds.options["sampling"].weights is w
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.options == {} and copy.config.strategy == "weighted"
    ds.close()


def test_output_as_a_format_name_is_its_group(synth_store):
    flat = BlockDataset(synth_store, batch_size=32, output="csr", dtype="float16")
    grouped = BlockDataset(synth_store, batch_size=32, output=Output(format="csr", dtype="float16"))
    assert (flat.output, flat.dtype) == (grouped.output, grouped.dtype) == ("csr", "float16")
    a, b = _epoch(flat), _epoch(grouped)
    assert len(a) == len(b) > 0
    assert all(np.array_equal(x["X"], y["X"]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_keyword_and_its_group_together_is_one_line_error(name):
    """Refused before any store is opened (the path does not exist)."""
    key = FLAT[name]
    kw = CASES[name][1]
    with pytest.raises(InputError, match=rf"^{name}= and {key}=\w+\(\.\.\.\) together: ") as e:
        BlockDataset("/nonexistent.zarr", **{name: kw[name], key: GROUPS[key]()})
    assert "\n" not in str(e.value)


def test_an_unknown_keyword_names_the_likely_one():
    with pytest.raises(InputError, match=r"unexpected keyword argument 'fetchfactor' \(did you"):
        BlockDataset("/nonexistent.zarr", fetchfactor=4)


class _Wrong:
    def __repr__(self) -> str:
        return "<wrong>"


ANY_VALUE = {"weights", "rows", "var_names", "cache_dir", "cache_limit"}
"""Fields whose values are checked against the data, or by the reader's shard cache."""


@pytest.mark.parametrize(
    ("cls", "name"),
    [(cls, f.name) for cls in GROUPS.values() for f in dataclasses.fields(cls)],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_field_of_the_wrong_type_is_one_line_error(cls, name):
    if name in ANY_VALUE:
        assert typing.get_type_hints(cls)[name] is Any
        cls(**{name: _Wrong()})  # accepted here; BlockDataset checks it against the data
        return
    with pytest.raises(InputError, match=rf"^{name}=") as e:
        cls(**{name: _Wrong()})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda: Sampling(strategy="nope"), r"^strategy='nope': unknown; known: "),
        (lambda: Sampling(seed=-1), r"^seed=-1: must be a non-negative integer$"),
        (lambda: Sampling(num_samples=0), r"^num_samples=0: must be a positive integer$"),
        (
            lambda: Sampling(weights=[1.0], store_weights=[1, 2]),
            r"^store_weights= and weights= together: give one of them$",
        ),
        (lambda: Output(format="coo"), r"^output='coo': unknown; known: dense, csr$"),
        (lambda: Output(dtype="int8"), r"^dtype='int8': unknown; known: float32, "),
        (lambda: Reading(fetch_factor=0), r"^fetch_factor=0: must be a positive integer$"),
        (lambda: Reading(prefetch=-1), r"^prefetch=-1: must be an integer >= 0$"),
    ],
)
def test_a_group_checks_its_values_when_made(make, msg):
    with pytest.raises(InputError, match=msg) as e:
        make()
    assert "\n" not in str(e.value)


def test_groups_normalise_their_fields():
    assert Selection(obs="plate", extra="obsm/X_pca").obs == ("plate",)
    assert Selection(extra="obsm/X_pca").extra == ("obsm/X_pca",)
    assert Output(dtype=np.float16).dtype == "float16"
    assert Reading(fetch_factor="8", block_size=np.int64(32)) == Reading(8, 32)
    assert Sampling(replacement=np.bool_(False)).replacement is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        Sampling().seed = 1  # type: ignore[misc]


def _documented(section: str) -> list[list[str]]:
    """The first-column names of each table in ``section`` of docs/loader.md."""
    text = DOC.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    tables: list[list[str]] = []
    for line in text[start : end if end > 0 else None].splitlines():
        m = re.match(r"^\| `(\w+)` \|", line)
        if line.startswith("|---"):  # a table's header ends: its rows follow
            tables.append([])
        elif m:
            tables[-1].append(m.group(1))
    return tables


def test_all_is_exactly_the_documented_list(run_python):
    public, advanced = _documented("What `loader` exports")
    assert sorted(loader.__all__) == sorted(public)
    assert sorted(loader.advanced.__all__) == sorted(advanced)
    # in a fresh interpreter: importing loader loads no numpy, torch or loader module
    # beyond the small ones; then every name of both lists imports
    code = (
        "import json, sys\n"
        "import loader\n"
        "light = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'torch', 'loader'))\n"
        "from loader import *\n"
        "from loader.advanced import *\n"
        "import loader.advanced as A\n"
        "names = {n: getattr(loader, n) is not None for n in loader.__all__}\n"
        "names.update({n: getattr(A, n) is not None for n in A.__all__})\n"
        "print(json.dumps({'light': light, 'names': names}))\n"
    )
    out = json.loads(run_python(code, timeout=120).splitlines()[-1])
    assert out["light"] == ["loader", "loader.errors", "loader.options"]
    assert sorted(out["names"]) == sorted({*public, *advanced}) and all(out["names"].values())


def test_former_top_level_names_still_resolve():
    """Code written against the former, longer ``loader.__all__`` keeps working."""
    assert loader.plan_fetch is loader.advanced.plan_fetch
    assert loader.LayoutReader is loader.advanced.LayoutReader
    assert loader.InputError is InputError
    assert loader.sampler.SamplerConfig is loader.advanced.SamplerConfig
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loader.nope  # noqa: B018
