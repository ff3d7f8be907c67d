"""Run a worker's sampling plan against a reader: read-ahead, take, assemble.

The only I/O loop of the dataset. ``prefetch`` fetches are in flight while the current
one is consumed, so at most ``prefetch + 1`` fetches are held (a minibatch that takes
its last rows from the next fetch holds both, and then one fewer is in flight). Given a
:class:`Carry`, the read-ahead goes on past the plan's end into the next pass's plan,
so that the next epoch does not start with a read nobody overlapped.
While the loop runs, large arrays (a fetch's, a dense minibatch) reuse the memory of
dropped ones (:mod:`loader.engine.buffers`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from loader.assemble import CSRRows
from loader.engine import buffers
from loader.errors import LayoutError
from loader.sampler import Fetch, WorkerPlan

__all__ = ["Carry", "abandon", "run_plan"]


class Carry:
    """The first fetches of the pass expected next, submitted before this pass ended.

    ``next_plan`` computes that pass's plan; it is called once this pass has submitted
    all of its own fetches. ``fetches`` then holds the submitted ones, in fetch order,
    as ``(Fetch, pending, extras' pendings)``; :meth:`fetches_for` hands them over.
    """

    def __init__(self, next_plan: Callable[[], WorkerPlan], reader: Any) -> None:
        self._next_plan = next_plan
        self.reader = reader
        self.plan: WorkerPlan | None = None
        self.fetches: deque = deque()

    def next_plan(self) -> WorkerPlan:
        """The next pass's plan (computed on first use)."""
        if self.plan is None:
            self.plan = self._next_plan()
        return self.plan

    def fetches_for(self, plan: WorkerPlan, reader: Any) -> deque:
        """The carried fetches if ``plan`` (read by ``reader``) is the plan they began,
        else none (they are dropped)."""
        if self.plan is None or self.plan.key != plan.key or self.reader is not reader:
            return deque()
        return self.fetches

    def cancel(self) -> None:
        """Cancel the carried fetches (not to be read: a closed dataset, another epoch)."""
        abandon(self.fetches)


def run_plan(
    plan: WorkerPlan,
    reader: Any,
    *,
    skip: int = 0,
    output: str = "dense",
    obs: Sequence[str] = (),
    prefetch: int = 2,
    extras: Mapping[str, Any] | None = None,
    carried: Sequence[tuple] = (),
    ahead: Carry | None = None,
) -> Iterator[dict[str, Any]]:
    """Minibatches of ``plan`` from number ``skip`` on, as the reader's ``take`` gives them.

    Fetches before the one holding minibatch ``skip`` are never submitted. ``extras``:
    readers of more row-aligned elements on the same blocks, each fetched with the same
    blocks and order; a minibatch holds each one's rows under its name. ``carried``:
    the plan's first fetches, submitted by the pass before (``skip`` must be 0).
    ``ahead``: once every fetch of ``plan`` is submitted, the read-ahead submits the
    next plan's first fetches into it.
    """
    if carried and skip:
        raise ValueError("run_plan: carried fetches start the plan; skip must be 0")
    in_flight: deque = deque(carried)
    finished = False
    with buffers.reusing():  # fetch arrays and dense minibatches reuse dropped ones
        try:
            yield from _minibatches(
                plan, reader, skip, output, obs, prefetch, extras, in_flight, ahead
            )
            finished = True
        finally:
            if not finished:  # abandoned (closed, collected) or failed: nobody reads them
                abandon(in_flight)
                if ahead is not None:
                    abandon(ahead.fetches)


def abandon(fetches: deque) -> None:
    """Cancel the reads of ``fetches`` (``(Fetch, pending, extras' pendings)``) that
    have not started, and forget them: their memory and files go now, not when the
    last task would have finished."""
    while fetches:
        _, pending, more = fetches.popleft()
        for p in (pending, *more.values()):
            cancel = getattr(p, "cancel", None)
            if cancel is not None:
                cancel()


def _minibatches(
    plan: WorkerPlan,
    reader: Any,
    skip: int,
    output: str,
    obs: Sequence[str],
    prefetch: int,
    extras: Mapping[str, Any] | None,
    in_flight: deque,
    ahead: Carry | None,
) -> Iterator[dict[str, Any]]:
    """:func:`run_plan`'s loop; ``in_flight``: the submitted fetches, ``(Fetch,
    PendingFetch, extras' pendings)`` in fetch order, first the carried ones."""
    extras = dict(extras or {})
    lengths = plan.cfg.block_lengths
    ready: dict[int, tuple[Fetch, Any]] = {}
    next_k: int | None = len(in_flight) if in_flight else None
    later: deque = ahead.fetches if ahead is not None else deque()

    def submit(p: WorkerPlan, k: int) -> tuple:
        f = p.fetch(k)
        # the fetch in delivery order: minibatches are consecutive slices of it
        more = {e: r.submit(f.blocks, order=f.order) for e, r in extras.items()}
        return f, reader.submit(f.blocks, order=f.order), more

    n_fetches = plan.n_fetches

    def submit_more(k_from: int, *, at_least_one: bool = False) -> None:
        nonlocal next_k
        if next_k is None:
            next_k = k_from
        while next_k < n_fetches and (len(ready) + len(in_flight) < prefetch + 1 or at_least_one):
            in_flight.append(submit(plan, next_k))
            next_k += 1
            at_least_one = False
        if ahead is None or next_k < n_fetches:
            return
        while len(ready) + len(in_flight) + len(later) < prefetch + 1:
            then = ahead.next_plan()
            if len(later) >= then.n_fetches:
                break
            later.append(submit(then, len(later)))

    for parts in plan.batch_parts(skip):
        first = parts[0][0]
        for k in [k for k in ready if k < first]:
            del ready[k]
        submit_more(first)
        for k, _, _ in parts:
            while k not in ready:
                if not in_flight:
                    submit_more(k, at_least_one=True)
                f, pending, more = in_flight.popleft()
                got = pending.result()
                more = {e: p.result() for e, p in more.items()}
                for g in (got, *more.values()):
                    if g.n_rows != f.order.size:
                        raise LayoutError(
                            f"reader returned {g.n_rows} rows for a fetch of {f.order.size} "
                            f"from blocks holding {int(lengths[f.blocks].sum())}; "
                            "the store is inconsistent: reconvert it"
                        )
                ready[f.index] = (f, got, more)
        submit_more(first)  # keep the read-ahead full before taking rows
        pieces = []
        for k, a, b in parts:
            piece = _take(ready[k][1], a, b, output, obs)
            for e, g in ready[k][2].items():
                piece[e] = _take(g, a, b, output, ())["X"]
            pieces.append(piece)
        yield concat_batches(pieces)


def _take(got: Any, a: int, b: int, output: str, obs: Sequence[str]) -> dict[str, Any]:
    """Delivered rows ``a..b`` of a fetch: its ``take_slice`` where the reader's fetches
    have one (:class:`loader.store.Fetched`), else ``take`` of the positions."""
    fast = getattr(got, "take_slice", None)
    if fast is not None:
        return fast(a, b, output=output, obs=obs)
    return got.take(np.arange(a, b), output=output, obs=obs)


def concat_batches(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """One minibatch from the parts ``take`` returned (dense, scipy CSR or
    :class:`~loader.assemble.CSRRows` ``X``)."""
    if len(pieces) == 1:
        return pieces[0]
    Xs = [p["X"] for p in pieces]
    if isinstance(Xs[0], np.ndarray):
        X = np.concatenate(Xs)
    elif isinstance(Xs[0], CSRRows):
        X = CSRRows.stack(Xs)
    else:
        import scipy.sparse as sp

        X = sp.vstack(Xs, format="csr")
    out = {
        "X": X,
        "index": np.concatenate([p["index"] for p in pieces]),
        "obs": {c: np.concatenate([p["obs"][c] for p in pieces]) for c in pieces[0]["obs"]},
    }
    for e in pieces[0].keys() - out.keys():  # extra elements
        out[e] = concat_batches([{"X": p[e], "index": p["index"], "obs": {}} for p in pieces])["X"]
    return out
