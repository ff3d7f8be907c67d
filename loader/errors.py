"""One exception hierarchy for ``loader`` and ``sclayout``.

Every error a user can cause is a :class:`SclayoutError` whose message names the
problem and the fix on one line; the CLI prints it without a traceback and exits
non-zero. Anything else escaping is a bug.
"""

from __future__ import annotations

__all__ = [
    "FormatVersionError",
    "InputError",
    "LayoutError",
    "NotALayoutStoreError",
    "ReadError",
    "SclayoutError",
    "SpecError",
    "StoreChangedError",
    "TooManyFilesError",
    "too_many_files",
]


class SclayoutError(Exception):
    """Base class of every error raised on purpose by sclayout or loader."""

    exit_code: int = 2


class InputError(SclayoutError, ValueError):
    """A bad argument or a bad input file (missing, unreadable, not AnnData, ...)."""


class SpecError(InputError):
    """A layout spec, a profile or loader settings that do not validate."""


class LayoutError(SclayoutError):
    """A layout store that is incomplete, inconsistent or otherwise unusable."""


class NotALayoutStoreError(LayoutError):
    """The path exists but is not a (complete) sclayout layout store."""


class ReadError(SclayoutError):
    """A read from a store failed while loading.

    For example a server that stopped answering, a file removed or truncated under a
    running loader.
    """


class FormatVersionError(LayoutError):
    """A manifest written by a newer (or unknown) version of the format."""


class StoreChangedError(LayoutError):
    """The store was replaced (reconverted, moved, deleted) while a job read it.

    Reading on would mix batches of two different stores: the job must restart.
    """


class TooManyFilesError(ReadError):
    """The process may open no more files (its descriptor limit, ``ulimit -n``)."""


def too_many_files(error: OSError) -> TooManyFilesError | None:
    """Return the one-line error of an ``open`` refused for want of descriptors.

    That is ``EMFILE`` or ``ENFILE``; the error names the limit and the fix. Any other
    error gives ``None``.
    """
    import errno

    if error.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        limit = "unknown"
    return TooManyFilesError(
        f"cannot open more files (the limit is {limit}, ulimit -n): close datasets you "
        "no longer use (BlockDataset.close()) or raise the limit"
    )
