"""The codecs of a layout store: a codec name -> the zarr v3 compressor list of an array.

Only codecs that both zarr-python and tensorstore read are offered (blosc with
lz4/lz4hc/zstd and byte- or bit-shuffle, zstd, gzip, or none), so a layout store opens
with either backend.

``blosc-lz4`` (the default) is the cheapest to write. ``blosc-lz4hc`` writes the same
LZ4 format with a slower, better match search: on count data the decoder then has
fewer, longer matches to copy: it decodes with less CPU and stores fewer bytes, but
encodes several times slower (``benchmarks/codecs.py``, docs/benchmarks.md). Pick it
for a store that is read for many epochs (``sclayout recommend`` prices it with the decode
figures of its profile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from loader.argtypes import typechecked
from loader.errors import SpecError

__all__ = ["CODECS", "get_codec"]

CodecFactory = Callable[[], tuple[Any, ...]]
"""Returns the ``compressors`` tuple for ``zarr.create_array`` (may be empty)."""

BLOSC_CLEVEL = 5
"""blosc compression level: blosc's own default, a good ratio at loader decode speed."""
ZSTD_LEVEL = 3
"""zstd's own default level (good ratio, fast enough to decode at loader speed)."""
GZIP_LEVEL = 5
"""Middle gzip level; gzip is here for compatibility, not speed."""


@typechecked
def get_codec(name: str) -> tuple[Any, ...]:
    """Return the zarr v3 compressors for codec ``name``.

    Raises
    ------
    SpecError
        If ``name`` is not one of :data:`CODECS`; the message lists the known names.
    """
    try:
        factory = CODECS[name]
    except KeyError:
        raise SpecError(f"codec={name!r}: unknown; known: {', '.join(sorted(CODECS))}") from None
    return factory()


def _blosc(cname: str, shuffle: str) -> CodecFactory:
    return lambda: (BloscCodec(cname=cname, clevel=BLOSC_CLEVEL, shuffle=shuffle),)


CODECS: dict[str, CodecFactory] = {
    **{f"blosc-{c}": _blosc(c, "shuffle") for c in ("lz4", "lz4hc", "zstd")},
    **{f"blosc-{c}-bitshuffle": _blosc(c, "bitshuffle") for c in ("lz4", "lz4hc", "zstd")},
    "zstd": lambda: (ZstdCodec(level=ZSTD_LEVEL),),
    "gzip": lambda: (GzipCodec(level=GZIP_LEVEL),),
    "none": lambda: (),
}
"""The codecs ``sclayout convert`` writes (all read by zarr-python and tensorstore)."""
