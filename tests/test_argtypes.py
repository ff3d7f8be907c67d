"""Every public argument of the wrong type raises InputError naming the argument.

The entry points are enumerated from the packages' ``__all__``: each is either in
``CALLS`` (with a valid call to start from) or in ``EXEMPT`` with the reason, so a new
public name cannot be forgotten. For every parameter of every entry point the test
replaces that one argument by a value of a type nothing accepts.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

import loader
import loader.advanced
import sclayout.convert
import sclayout.cost
from loader.errors import InputError


class _Wrong:
    """A type no public argument accepts."""

    def __repr__(self) -> str:
        return "<wrong>"


class _Ctx:
    """What the calls below are built from: the session's shared source and store."""

    def __init__(self, store: tuple[Path, Path], factory: pytest.TempPathFactory) -> None:
        self.store = store
        self.factory = factory

    def getbasetemp(self) -> Path:
        return self.factory.getbasetemp()


@pytest.fixture
def ctx(shared_store, tmp_path_factory) -> _Ctx:
    return _Ctx(shared_store, tmp_path_factory)


def _store(tmp):
    return tmp.store


def _manifest(tmp):
    r = loader.open_layout(_store(tmp)[1])
    return r.manifest, r.block_pointer


def _stats(tmp):
    return sclayout.cost.read_dataset_stats(_store(tmp)[1])


def _profile(_tmp):
    return sclayout.cost.get_preset(sclayout.cost.list_presets()[0])


def _settings():
    from loader.spec import LoaderSettings

    return LoaderSettings(batch_size=16, fetch_factor=4)


def _store_spec():
    from loader.spec import StoreSpec

    return StoreSpec(block_size=8)


NAMED_AS = {("parse_memory_budget", "value"): "memory_budget"}
"""Errors that name an argument as the user passes it (the option it parses)."""


def _no_kwargs(_tmp):
    return {}


# name -> (callable, positional args, keyword args, {parameter: extra keyword args
# needed to reach that parameter's check}); args are built lazily from tmp_path_factory
CALLS = {
    "BlockDataset": (
        lambda: loader.BlockDataset,
        lambda t: [str(_store(t)[1])],
        lambda t: {},
        {"weights": {"strategy": "weighted"}},
    ),
    "open_layout": (lambda: loader.open_layout, lambda t: [str(_store(t)[1])], _no_kwargs, {}),
    "plan_fetch": (
        lambda: loader.advanced.plan_fetch,
        lambda t: [np.array([0])],
        lambda t: dict(zip(("manifest", "block_pointer"), _manifest(t), strict=True)),
        {},
    ),
    "get_backend": (lambda: loader.advanced.get_backend, lambda t: ["tensorstore"], _no_kwargs, {}),
    "register_backend": (
        lambda: loader.advanced.register_backend,
        lambda t: ["x-test", lambda location, **kw: None],
        _no_kwargs,
        {},
    ),
    "register_strategy": (
        lambda: loader.advanced.register_strategy,
        lambda t: [loader.sampler.get_strategy("streaming")],
        _no_kwargs,
        {},
    ),
    "convert": (
        lambda: sclayout.convert.convert,
        lambda t: [str(_store(t)[0]), str(t.getbasetemp() / "never.zarr")],
        _no_kwargs,
        {},
    ),
    "get_codec": (lambda: sclayout.convert.get_codec, lambda t: ["blosc-lz4"], _no_kwargs, {}),
    "get_order": (lambda: sclayout.convert.get_order, lambda t: ["original"], _no_kwargs, {}),
    "parse_memory_budget": (
        lambda: sclayout.convert.parse_memory_budget,
        lambda t: ["2GB"],
        _no_kwargs,
        {},
    ),
    "verify": (
        lambda: import_module("sclayout.checks.verify").verify,
        lambda t: [str(p) for p in _store(t)],
        _no_kwargs,
        {},
    ),
    "inspect_store": (
        lambda: import_module("sclayout.checks.inspect").inspect_store,
        lambda t: [str(_store(t)[1])],
        _no_kwargs,
        {},
    ),
    "calibrate": (
        lambda: import_module("sclayout.cost.calibrate").calibrate,
        lambda t: [str(_store(t)[1])],
        _no_kwargs,
        {},
    ),
    "expected_distinct_blocks": (
        lambda: sclayout.cost.expected_distinct_blocks,
        lambda t: [16, 4, 8],
        _no_kwargs,
        {},
    ),
    "get_preset": (
        lambda: sclayout.cost.get_preset,
        lambda t: [sclayout.cost.list_presets()[0]],
        _no_kwargs,
        {},
    ),
    "load_profile": (lambda: sclayout.cost.load_profile, lambda t: ["p.json"], _no_kwargs, {}),
    "resolve_profile": (
        lambda: sclayout.cost.resolve_profile,
        lambda t: [sclayout.cost.list_presets()[0]],
        _no_kwargs,
        {},
    ),
    "predict": (
        lambda: sclayout.cost.predict,
        lambda t: list(_manifest(t)),
        lambda t: {"settings": _settings(), "profile": _profile(t)},
        {},
    ),
    "predict_diversity": (
        lambda: sclayout.cost.predict_diversity,
        lambda t: [],
        lambda t: {"batch_size": 16, "fetch_factor": 4, "block_size": 8, "order": "shuffled"},
        {},
    ),
    "read_dataset_stats": (
        lambda: sclayout.cost.read_dataset_stats,
        lambda t: [str(_store(t)[1])],
        _no_kwargs,
        {},
    ),
    "search": (
        lambda: sclayout.cost.search,
        lambda t: [_stats(t)],
        lambda t: {"profile": _profile(t)},
        {},
    ),
    "search_loader": (
        lambda: sclayout.cost.search_loader,
        lambda t: [_stats(t)],
        lambda t: {"profile": _profile(t)},
        {},
    ),
    "simulate_diversity": (
        lambda: sclayout.cost.simulate_diversity,
        lambda t: [np.zeros(64, dtype=np.int64)],
        lambda t: {"batch_size": 16, "fetch_factor": 4, "block_size": 8},
        {},
    ),
    "virtual_layout": (
        lambda: sclayout.cost.virtual_layout,
        lambda t: [np.full(64, 3, dtype=np.int64)],
        lambda t: {"n_vars": 20, "spec": _store_spec()},
        {},
    ),
}

EXEMPT = {
    "LayoutReader": "made by open_layout (checked there)",
    "Fetched": "a result, made by the library",
    "PendingFetch": "a result, made by the library",
    "BlockDataLoader": "a torch DataLoader: its own dataset check; the rest are torch's",
    "worker_context": "no arguments",
    "strategies": "no arguments",
    "list_presets": "no arguments",
}


def _made_by_the_library(obj: object) -> bool:
    """Errors, data classes and typed records: raised or built by the library, or
    validated where they are loaded."""
    return inspect.isclass(obj) and (
        issubclass(obj, BaseException)
        or dataclasses.is_dataclass(obj)
        or issubclass(obj, tuple)  # NamedTuple
        or typing.is_typeddict(obj)
    )


def _public() -> dict[str, object]:
    out = {}
    for mod in (loader, loader.advanced, sclayout.convert, sclayout.cost):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not name.isupper() and not _made_by_the_library(obj):
                out[name] = obj
    return out


BEHIND_COMMANDS = {"verify", "inspect_store", "calibrate"}
"""Library functions of the CLI commands, public through their modules."""


def test_every_public_callable_is_covered_or_exempt():
    names = set(_public())
    assert names - set(CALLS) - set(EXEMPT) == set(), "add it to CALLS (or EXEMPT, with why)"
    assert set(CALLS) <= names | BEHIND_COMMANDS


def _cases():
    for name, (get, *_rest) in CALLS.items():
        fn = get()
        target = fn.__init__ if inspect.isclass(fn) else fn
        for p in inspect.signature(target).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            yield pytest.param(name, p.name, id=f"{name}-{p.name}")


@pytest.mark.parametrize(("entry", "param"), list(_cases()))
def test_a_wrong_type_raises_input_error_naming_the_argument(entry, param, ctx):
    get, args_of, kwargs_of, extra = CALLS[entry]
    fn = get()
    args, kwargs = list(args_of(ctx)), dict(kwargs_of(ctx))
    kwargs.update(extra.get(param, {}))
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = [p for p in inspect.signature(target).parameters if p != "self"]
    if params.index(param) < len(args):
        args[params.index(param)] = _Wrong()
    else:
        kwargs[param] = _Wrong()
    named = NAMED_AS.get((entry, param), param)
    with pytest.raises(InputError, match=rf"^{named}=") as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_block_dataset_obs_of_the_wrong_type(shared_store):
    store = shared_store[1]
    with pytest.raises(InputError, match=r"^obs=5: must be a sequence of strings$"):
        loader.BlockDataset(store, obs=5)
    with pytest.raises(InputError, match=r"^obs=\[5\]: must be a sequence of strings"):
        loader.BlockDataset(store, obs=[5])
    with pytest.raises(InputError, match=r"BlockDataset.__init__: got an unexpected keyword"):
        loader.BlockDataset(store, batchsize=8)


def test_right_types_still_pass(shared_store):
    store = Path(shared_store[1])  # a Path, numpy integers, a numpy bool
    ds = loader.BlockDataset(store, batch_size=np.int64(8), drop_last=np.bool_(True), obs="plate")
    assert ds.batch_size == 8 and ds.obs == ("plate",)
