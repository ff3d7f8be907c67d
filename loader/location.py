"""Where a store lives and what it is.

A local path or an ``http(s)://`` URL; an HDF5 (.h5ad) file or not.

A module of its own because the backends, the direct shard reader, the reader and the
converter's checks all ask it, and none of them may import another for it.
"""

from __future__ import annotations

import os

__all__ = ["HDF5_SIGNATURE", "is_hdf5", "is_url"]

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The HDF5 superblock signature; it sits at byte 0, or at 512, 1024, 2048, ... when
the file has a user block (HDF5 file format specification, section II.A)."""
_USER_BLOCK_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)


def is_url(location: str) -> bool:
    """Whether ``location`` is an ``http(s)://`` URL (else a local path)."""
    return location.startswith(("http://", "https://"))


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` carries the HDF5 signature.

    ``OSError`` if it cannot be read.
    """
    with open(path, "rb") as fh:
        for offset in _USER_BLOCK_OFFSETS:
            fh.seek(offset)
            if fh.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
    return False
