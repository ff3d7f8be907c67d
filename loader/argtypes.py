"""Argument type checks for the public entry points of ``loader`` and ``sclayout``.

:func:`typechecked` wraps an entry point so that an argument of the wrong type (say
``BlockDataset(path, obs=5)``) raises :class:`~loader.errors.InputError` naming the
argument, its value and the accepted types, before any work starts, instead of a raw
``TypeError`` from deep inside. The entry point's own annotations are the statement
of what it accepts, so the check and the signature cannot drift apart. Values (ranges,
names) are still checked by the entry point itself.
"""

from __future__ import annotations

import collections.abc as abc
import dataclasses
import functools
import inspect
import numbers
import os
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from loader.errors import InputError

__all__ = ["check_fields", "typechecked"]

F = TypeVar("F", bound=Callable[..., Any])

_Check = tuple[Callable[[Any], bool], str]
"""A predicate on a value and the words that describe what it accepts."""

_SEQUENCES = (abc.Sequence, abc.Iterable, abc.Collection, list, tuple)


def _check_for(hint: Any) -> _Check | None:
    """Return the check of one annotation, or ``None`` when it accepts anything."""
    if hint is Any or hint is object or isinstance(hint, TypeVar):
        return None
    if hint is None or hint is type(None):
        return (lambda v: v is None), "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        parts = [_check_for(a) for a in args]
        if any(p is None for p in parts):
            return None
        checks = [p for p in parts if p is not None]
        # None is the default of such arguments: the words name what a value must be
        words = " or ".join(d for _, d in checks if d != "None")
        return (lambda v: any(c(v) for c, _ in checks)), words
    if origin is typing.Literal:
        return (lambda v: any(v == a for a in args)), "one of " + ", ".join(map(repr, args))
    if hint is bool:
        return (lambda v: isinstance(v, bool | np.bool_)), "True or False"
    if hint is int:
        return (lambda v: isinstance(v, numbers.Integral)), "an integer"
    if hint is float:
        return (lambda v: isinstance(v, numbers.Real)), "a number"
    if hint is str:
        return (lambda v: isinstance(v, str)), "a string"
    if hint is os.PathLike or origin is os.PathLike:
        return (lambda v: isinstance(v, os.PathLike)), "a path"
    if origin in _SEQUENCES or hint in _SEQUENCES:
        kind = origin or hint
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        # items are checked for names only: a list of 10^8 weights is not walked
        item = _check_for(str) if args and args[0] is str and not fixed else None
        words = "a sequence" if item is None else "a sequence of strings"

        def seq(v: Any, kind: Any = kind, item: _Check | None = item) -> bool:
            if isinstance(v, np.ndarray):
                return True
            return isinstance(v, kind) and (item is None or all(map(item[0], v)))

        return seq, words
    if origin is not None and isinstance(origin, type):
        return (lambda v: isinstance(v, origin)), f"a {origin.__name__}"
    if origin is abc.Callable or hint is abc.Callable:
        return callable, "a callable"
    if isinstance(hint, type):
        try:
            isinstance(None, hint)
        except TypeError:  # a Protocol or TypedDict: duck-typed, checked by use
            return None
        return (lambda v: isinstance(v, hint)), f"a {hint.__name__}"
    return None


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Return the resolved annotations of ``fn``; one that cannot be resolved is not checked."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # a name imported for type checkers only: resolve one by one
        out = {}
        for name, ann in getattr(fn, "__annotations__", {}).items():
            try:
                out[name] = eval(ann, fn.__globals__) if isinstance(ann, str) else ann
            except Exception:
                continue
        return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _apply(name: str, value: Any, check: _Check) -> None:
    if not check[0](value):
        raise InputError(f"{name}={_short(value)}: must be {check[1]}")


def typechecked(fn: F | None = None, *, own_checks: tuple[str, ...] = ()) -> Any:
    """Check the types of ``fn``'s arguments against its annotations on every call.

    ``own_checks`` names arguments the function validates itself, more leniently than
    their annotation says (block sizes also come as ``"64"`` or ``64.0``). An unknown
    keyword or a missing argument is an :class:`InputError` too. Use as ``@typechecked``
    or ``@typechecked(own_checks=(...))``.
    """
    if fn is None:
        return functools.partial(typechecked, own_checks=own_checks)
    sig = inspect.signature(fn)
    checks: dict[str, _Check] | None = None
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal checks
        if checks is None:  # resolved on first call: annotations may name later classes
            hints = _hints(fn)
            checks = {}
            for p in sig.parameters.values():
                if p.kind in skip or p.name not in hints or p.name in own_checks:
                    continue
                c = _check_for(hints[p.name])
                if c is not None:
                    checks[p.name] = c
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise InputError(f"{fn.__qualname__}: {e}; see help({fn.__qualname__})") from None
        for name, value in bound.arguments.items():
            if name in checks:
                _apply(name, value, checks[name])
        return fn(*args, **kwargs)

    return typing.cast(F, wrapper)


_FIELD_CHECKS: dict[type, dict[str, _Check]] = {}
"""The checks of each class :func:`check_fields` has seen, resolved once."""


def check_fields(obj: Any, *, own_checks: tuple[str, ...] = ()) -> None:
    """Check the fields of the dataclass instance ``obj`` against their annotations.

    The option objects of ``loader.options`` call it from ``__post_init__``, so that a
    field of the wrong type is the same one-line :class:`InputError` (``seed='a': must
    be an integer``) as the keyword of that name. ``own_checks`` as in :func:`typechecked`.
    """
    cls = type(obj)
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = {}
        for name in (f.name for f in dataclasses.fields(cls)):
            c = None if name in own_checks else _check_for(hints.get(name, Any))
            if c is not None:
                checks[name] = c
        _FIELD_CHECKS[cls] = checks
    for name, check in checks.items():
        _apply(name, getattr(obj, name), check)
