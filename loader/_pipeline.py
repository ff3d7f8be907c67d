"""Run a worker's sampling plan against a reader: read-ahead, take, assemble.

The only I/O loop of the dataset. ``prefetch`` fetches are in flight while the current
one is consumed, so at most ``prefetch + 1`` fetches are held (a minibatch that takes
its last rows from the next fetch holds both, and then one fewer is in flight).

With ``ahead``, the loop runs on a thread of its own that cuts, densifies and converts
minibatches before they are asked for, so the thread that trains only receives them
(docs/design.md, "Read-ahead").
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from loader import _buffers as buffers
from loader.errors import LayoutError
from loader.sampler import Fetch, WorkerPlan

__all__ = ["ahead_depth", "run_plan"]

AHEAD_BATCHES = 4
"""Most minibatches the batch thread finishes ahead of the consumer: enough to ride
over the wait for the next fetch, few enough to hold little memory."""
AHEAD_BYTES = 64 << 20
"""Bytes of finished minibatches the batch thread may hold; large dense minibatches
get fewer than :data:`AHEAD_BATCHES` ahead, never fewer than one."""
_POLL_S = 0.1
"""How often a batch thread with a full queue checks whether its consumer left."""


def run_plan(
    plan: WorkerPlan,
    reader: Any,
    *,
    skip: int = 0,
    output: str = "dense",
    obs: Sequence[str] = (),
    prefetch: int = 2,
    extras: Mapping[str, Any] | None = None,
    ahead: int = 0,
    finish: Callable[[dict[str, Any]], Any] | None = None,
) -> Iterator[Any]:
    """Minibatches of ``plan`` from number ``skip`` on, as the reader's ``take`` gives them.

    Fetches before the one holding minibatch ``skip`` are never submitted. ``extras``:
    readers of more row-aligned elements on the same blocks, each fetched with the same
    blocks and order; a minibatch holds each one's rows under its name. ``finish``, if
    given, is applied to each minibatch. With ``ahead`` > 0, a thread runs the loop and
    ``finish`` up to ``ahead`` minibatches before they are asked for; its errors are
    raised here, where the minibatch would have been.
    """
    if ahead <= 0:
        return _finished(_minibatches(plan, reader, skip, output, obs, prefetch, extras), finish)
    return _ahead(
        lambda: _finished(_minibatches(plan, reader, skip, output, obs, prefetch, extras), finish),
        ahead,
    )


def ahead_depth(batch_bytes: int) -> int:
    """Minibatches of ``batch_bytes`` each to finish ahead (:data:`AHEAD_BATCHES` at most,
    :data:`AHEAD_BYTES` in all, at least one)."""
    return max(1, min(AHEAD_BATCHES, AHEAD_BYTES // max(1, int(batch_bytes))))


def _finished(batches: Iterator[dict[str, Any]], finish: Callable | None) -> Iterator[Any]:
    """``finish`` of each minibatch, large buffers reused meanwhile."""
    with buffers.reusing():
        try:
            for batch in batches:
                yield batch if finish is None else finish(batch)
        finally:
            batches.close()  # type: ignore[attr-defined]


def _ahead(make: Callable[[], Iterator[Any]], depth: int) -> Iterator[Any]:
    """Iterate ``make()`` on a thread of its own, at most ``depth`` items ahead.

    The iterator is made, run and closed on that thread. Leaving early (``close()``, an
    error in the consumer, garbage collection) stops the thread at its next item.
    """
    items: queue.Queue = queue.Queue(maxsize=depth)
    left = threading.Event()

    def put(item: tuple[bool, Any]) -> bool:
        while not left.is_set():
            try:
                items.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            it = make()
            try:
                for item in it:
                    if not put((True, item)):
                        return
            finally:
                it.close()  # type: ignore[attr-defined]
        except BaseException as e:  # raised again on the consumer's side
            put((False, e))
            return
        put((False, None))

    thread = threading.Thread(target=run, name="sclayout-batches", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = items.get()
            if ok:
                yield item
            elif item is None:
                return
            else:
                raise item
    finally:
        left.set()


def _minibatches(
    plan: WorkerPlan,
    reader: Any,
    skip: int,
    output: str,
    obs: Sequence[str],
    prefetch: int,
    extras: Mapping[str, Any] | None,
) -> Iterator[dict[str, Any]]:
    """:func:`run_plan`'s loop, on the thread that iterates it."""
    extras = dict(extras or {})
    lengths = plan.cfg.block_lengths
    in_flight: deque = deque()  # (Fetch, PendingFetch), in fetch order
    ready: dict[int, tuple[Fetch, Any]] = {}
    next_k: int | None = None

    def submit_more(k_from: int, *, at_least_one: bool = False) -> None:
        nonlocal next_k
        if next_k is None:
            next_k = k_from
        while next_k < plan.n_fetches and (
            len(ready) + len(in_flight) < prefetch + 1 or at_least_one
        ):
            f = plan.fetch(next_k)
            # the fetch in delivery order: minibatches are consecutive slices of it
            more = {e: r.submit(f.blocks, order=f.order) for e, r in extras.items()}
            in_flight.append((f, reader.submit(f.blocks, order=f.order), more))
            next_k += 1
            at_least_one = False

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
    """One minibatch from the parts ``take`` returned (dense or scipy CSR ``X``)."""
    if len(pieces) == 1:
        return pieces[0]
    Xs = [p["X"] for p in pieces]
    if isinstance(Xs[0], np.ndarray):
        X = np.concatenate(Xs)
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
