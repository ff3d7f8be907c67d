"""The torch classes: :class:`TorchBlockDataset` and :class:`BlockDataLoader`.

Defined when torch imports (``loader.BlockDataset`` and ``loader.BlockDataLoader``
name them then); without torch this module defines neither and ``loader`` hands out the
numpy :class:`loader.dataset.BlockDataset`. ``import loader`` does not import this
module: the first use of either name does.
"""

from __future__ import annotations

import functools
import traceback
import warnings
from collections import deque
from typing import Any

from loader._workers import GROUP_KEY, GROUP_SLOTS, to_torch, unpack_group, worker_context
from loader.dataset import BlockDataset
from loader.errors import InputError, LayoutError, SclayoutError
from loader.store import LayoutReader

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data._utils import pin_memory as torch_pinning
except ImportError:  # torch is an extra: loader works without it (numpy batches)
    torch = None

__all__ = ["BlockDataLoader", "TorchBlockDataset", "worker_error"]


def worker_error(e: SclayoutError) -> SclayoutError:
    """The error a DataLoader worker raised, with its own one-line message: torch
    re-raises it in the main process as ``Caught X in DataLoader worker process N``
    followed by the worker's traceback."""
    text = str(e)
    if not text.startswith("Caught "):
        return e
    last = text.rstrip().splitlines()[-1]
    return type(e)(last.split(f"{type(e).__name__}: ", 1)[-1])


def _release_worker_frames(e: BaseException) -> None:
    """Clear the locals of the frames in ``e``'s traceback.

    torch re-raises a worker's error from frames that hold both the error and the
    DataLoader iterator, a cycle: left alone, the iterator and its idle workers live
    until the garbage collector breaks it, and by then the collector has closed the
    iterator's queues, so its shutdown waits torch's status-check timeout per worker.
    Cleared, the iterator is freed when the loader drops it and its workers exit then.
    """
    traceback.clear_frames(e.__traceback__)


def _accelerator_available() -> bool:
    """Whether torch has an accelerator to pin memory for (as torch's DataLoader checks)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def _check_picklable(transform: Any) -> None:
    """Refuse a transform that cannot travel to spawned DataLoader workers."""
    import pickle

    try:
        pickle.dumps(transform)
    except Exception as e:
        raise InputError(
            f"transform={transform!r} cannot be pickled for DataLoader workers ({e}); "
            "define it at module level (not a lambda or a local function), or use num_workers=0"
        ) from None


if torch is not None:

    class TorchBlockDataset(BlockDataset, IterableDataset):
        """:class:`BlockDataset` as a torch ``IterableDataset`` (batches of tensors)."""

        def _pipeline_output(self, reader: Any) -> str:
            # a store's CSR minibatches become tensors straight from their arrays, with
            # no scipy matrix between (other readers, extra elements' too, give dense
            # or CSR only)
            if self.output == "csr" and isinstance(reader, LayoutReader) and not self.extra:
                return "rows"
            return self.output

        def _convert(self, batch: dict[str, Any]) -> dict[str, Any]:
            return self._apply_hooks(to_torch(self._numpy_batch(batch)))

        def dataloader(self, **kwargs: Any) -> BlockDataLoader:
            """A :class:`BlockDataLoader` over this dataset.

            ``num_workers`` defaults to the spec's (0 without a spec).
            """
            kwargs.setdefault("num_workers", self._spec_num_workers)
            return BlockDataLoader(self, **kwargs)

    class BlockDataLoader(DataLoader):
        """A ``DataLoader`` for a :class:`BlockDataset` that counts delivered batches.

        It passes ``batch_size=None`` (the dataset batches), starts workers with
        :func:`loader.worker_context` (spawn) unless given another context (tensorstore
        aborts a worker forked after the parent read data), and reports every
        delivered minibatch to the dataset so that ``ds.state_dict()`` is exact with
        ``num_workers > 0``.

        ``collate_fn`` and ``pin_memory`` are applied in the main process to each
        minibatch as it is handed out (workers send groups of minibatches, which torch
        would otherwise collate and pin instead): ``collate_fn`` receives the minibatch
        dict, and pinning happens when torch has an accelerator to pin for, as in torch.
        """

        def __init__(self, dataset: BlockDataset, **kwargs: Any) -> None:
            if not isinstance(dataset, BlockDataset):
                raise InputError("BlockDataLoader: dataset must be a loader.BlockDataset")
            if kwargs.get("batch_size") is not None:
                raise InputError(
                    "BlockDataLoader: batch_size is the dataset's; pass it to BlockDataset"
                )
            kwargs["batch_size"] = None
            # applied here to each delivered minibatch (see the class docstring)
            self._collate = kwargs.pop("collate_fn", None)
            pin = bool(kwargs.pop("pin_memory", False))
            self._pin_device = kwargs.pop("pin_memory_device", "")
            self._pin = pin and _accelerator_available()
            if pin and not self._pin:
                warnings.warn(
                    "BlockDataLoader: pin_memory=True but torch has no accelerator to pin "
                    "for; minibatches are not pinned",
                    UserWarning,
                    stacklevel=2,
                )
            if kwargs.get("num_workers", 0) > 0 and dataset.transform is not None:
                _check_picklable(dataset.transform)
            if kwargs.get("in_order") is False:
                raise InputError(
                    "BlockDataLoader: in_order=False makes the order depend on timing; "
                    "drop it (state_dict needs the round-robin order)"
                )
            if kwargs.get("num_workers", 0) > 0 and kwargs.get("multiprocessing_context") in (
                None,
                "spawn",
            ):
                kwargs["multiprocessing_context"] = worker_context()
            super().__init__(dataset, **kwargs)

        def state_dict(self) -> dict[str, Any]:
            """The dataset's :meth:`~BlockDataset.state_dict` (so trainers that save a
            stateful loader, such as Lightning, resume it exactly)."""
            return self.dataset.state_dict()

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """The dataset's :meth:`~BlockDataset.load_state_dict`."""
            self.dataset.load_state_dict(state)

        def __iter__(self):
            if self._collate is None and not self._pin:
                return self._minibatches()
            return self._finished(self._minibatches())

        def _finished(self, batches):
            """``collate_fn`` then pinning, on each minibatch handed out."""
            for batch in batches:
                if self._collate is not None:
                    batch = self._collate(batch)
                if self._pin:
                    batch = torch_pinning.pin_memory(batch, self._pin_device)
                yield batch

        def _minibatches(self):
            if self.num_workers == 0:  # the dataset counts in this process
                yield from self._in_process()
                return
            ds = self.dataset
            remaining = ds.begin_pass(self.num_workers)
            if ds.transform is not None or ds.extra:
                yield from self._one_by_one(remaining)
            else:
                yield from self._grouped(remaining)

        def _in_process(self):
            """Minibatches of a loader without workers."""
            if self.timeout:
                yield from super().__iter__()
                return
            # what torch's single-process iterator does with the dataset's
            # batches (already tensors: default_convert keeps them), without
            # its per-batch profiler scope and conversion walk, which cost the
            # consumer's thread more than the loop's own Python. Like torch, draw
            # the epoch's base seed, so seeded runs draw the same random numbers.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            yield from iter(self.dataset)

        def _one_by_one(self, remaining: list[int]):
            """Minibatches from the workers one by one, in torch's round-robin order.

            A transform runs in the workers on finished minibatches, and extra elements
            do not fit a group's buffer.
            """
            ds = self.dataset
            got = 0
            try:
                for batch in super().__iter__():
                    ds.count_delivered()
                    got += 1
                    yield batch
            except SclayoutError as e:  # torch put the worker's traceback in it
                _release_worker_frames(e)  # torch's iterator is freed here
                raise worker_error(e) from None
            except Exception as e:  # e.g. a user's transform, re-raised by torch
                _release_worker_frames(e)
                raise
            if got != sum(remaining):
                raise LayoutError(
                    f"BlockDataLoader: the workers delivered {got} minibatches of the "
                    f"{sum(remaining)} planned; the store or the dataset changed"
                )
            ds.end_pass()

        def _grouped(self, remaining: list[int]):
            """Minibatches from groups the workers send (dataset.WORKER_GROUP_BATCHES).

            They are dealt out in the order a DataLoader gives single minibatches:
            round-robin over the workers that still have some.
            """
            ds, n = self.dataset, self.num_workers
            ds.group_workers = True
            try:
                items = super().__iter__()  # starts (and pickles to) the workers
            finally:
                ds.group_workers = False
            queues: list[deque] = [deque() for _ in range(n)]
            # the last buffers of each worker stay referenced here, so that torch
            # maps a reused one from its cache instead of mapping it anew
            held = [deque(maxlen=GROUP_SLOTS + 1) for _ in range(n)]
            p = 0
            while any(remaining):
                while not remaining[p]:
                    p = (p + 1) % n
                while not queues[p]:
                    try:
                        item = next(items, None)
                    except SclayoutError as e:  # torch put the worker's traceback in it
                        _release_worker_frames(e)
                        del items  # torch's iterator is freed, its workers exit
                        raise worker_error(e) from None
                    except Exception as e:  # any other error a worker raised
                        _release_worker_frames(e)
                        del items
                        raise
                    if item is None or not isinstance(item, dict) or GROUP_KEY not in item:
                        raise LayoutError(
                            f"BlockDataLoader: worker {p} stopped {remaining[p]} "
                            "minibatch(es) early; the store or the dataset changed "
                            "during the epoch"
                        )
                    w = item[GROUP_KEY]
                    held[w].append(item["buf"])
                    done = functools.partial(ds.release_group, w, item["seq"])
                    queues[w].extend(unpack_group(item, output=ds.output, done=done))
                batch = ds.apply_dtype(queues[p].popleft()())
                remaining[p] -= 1
                ds.count_delivered()
                yield batch
                p = (p + 1) % n
            for _ in items:
                raise LayoutError("BlockDataLoader: a worker yielded more minibatches than planned")
            ds.end_pass()
