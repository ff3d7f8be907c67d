"""Codec registry: a codec name -> the zarr v3 compressor list of an array.

Only codecs that both zarr-python and tensorstore read are registered (blosc with
lz4/lz4hc/zstd and byte- or bit-shuffle, zstd, gzip, or none), so a layout store opens
with either backend.

``blosc-lz4`` (the default) is the cheapest to write. ``blosc-lz4hc`` writes the same
LZ4 format with a slower, better match search: on count data the decoder then has
fewer, longer matches to copy. ``benchmarks/codecs.py`` (the five real datasets of
``../shared/data`` and the Tahoe-like set, 2026-12-04): against blosc-lz4, lz4hc
decodes in 0.66× the CPU time, stores 0.76× the bytes and encodes 11.7× slower
(the whole ``convert`` of the 200k-cell benchmark set took 2.5× as long in a dev run:
10.4 s → 26.1 s). Pick it for a
store that is read for many epochs (``sclayout recommend`` prices it with the decode
figures of its profile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from loader.argtypes import typechecked
from loader.errors import SpecError

__all__ = ["CODECS", "get_codec", "register_codec"]

CodecFactory = Callable[[], tuple[Any, ...]]
"""Returns the ``compressors`` tuple for ``zarr.create_array`` (may be empty)."""

CODECS: dict[str, CodecFactory] = {}

BLOSC_CLEVEL = 5
"""blosc compression level: the blosc default, and the level behind DESIGN §3's
measured lz4 figures (ratio 2.24 at 3.5–3.9 µs/cell decode)."""
ZSTD_LEVEL = 3
"""zstd's own default level (good ratio, fast enough to decode at loader speed)."""
GZIP_LEVEL = 5
"""Middle gzip level; gzip is here for compatibility, not speed."""


@typechecked
def register_codec(name: str, factory: CodecFactory) -> None:
    """Register ``factory`` under ``name`` (replaces an existing entry)."""
    CODECS[name] = factory


@typechecked
def get_codec(name: str) -> tuple[Any, ...]:
    """The zarr v3 compressors for codec ``name``.

    Raises
    ------
    SpecError
        If ``name`` is not registered; the message lists the known names.
    """
    try:
        factory = CODECS[name]
    except KeyError:
        raise SpecError(f"codec={name!r}: unknown; known: {', '.join(sorted(CODECS))}") from None
    return factory()


def _blosc(cname: str, shuffle: str) -> CodecFactory:
    return lambda: (BloscCodec(cname=cname, clevel=BLOSC_CLEVEL, shuffle=shuffle),)


for _cname in ("lz4", "lz4hc", "zstd"):
    register_codec(f"blosc-{_cname}", _blosc(_cname, "shuffle"))
    register_codec(f"blosc-{_cname}-bitshuffle", _blosc(_cname, "bitshuffle"))
register_codec("zstd", lambda: (ZstdCodec(level=ZSTD_LEVEL),))
register_codec("gzip", lambda: (GzipCodec(level=GZIP_LEVEL),))
register_codec("none", lambda: ())
