"""The temporary siblings of a conversion's DST, and tidying those a killed one left.

A local conversion writes into ``.DST.sclayout-tmp-PID`` next to DST and renames it
into place; ``--overwrite`` first moves the old DST aside to ``.DST.sclayout-old-PID``.
Both names are hidden (``ls`` shows neither). A conversion killed by SIGKILL cannot
remove them, so every ``sclayout`` command given a DST runs :func:`clean_stale` first,
and says what it removed (or put back) on stderr. ``loader`` never deletes anything.

A sibling belongs to a conversion still running if its process holds the ``flock``
the conversion takes on the folder (:func:`hold`: on its temporary store, and on the old
DST while it is aside; the kernel drops it when the process dies, even by SIGKILL, and
it holds across hosts sharing the file system), or if the PID in its name is alive on
this host (a conversion that has not taken the lock yet, or a file system without
locks). Such a sibling is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

__all__ = ["OLD_TAG", "TMP_TAG", "clean_stale", "hold", "sibling"]

TMP_TAG = "sclayout-tmp"
OLD_TAG = "sclayout-old"


def sibling(dst: Path, tag: str, pid: int | None = None) -> Path:
    """Return the hidden sibling of ``dst`` with ``tag`` for process ``pid`` (this one)."""
    return dst.parent / f".{dst.name}.{tag}-{os.getpid() if pid is None else pid}"


def hold(folder: Path) -> int:
    """Take an exclusive ``flock`` on ``folder`` and return its descriptor.

    Close the descriptor to release the lock (or let the process end).
    """
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_if_stale(path: Path) -> int | None:
    """Return a descriptor locking ``path`` if no running conversion owns it, else ``None``."""
    pid = path.name.rsplit("-", 1)[-1]
    if not pid.isdigit():
        return None
    try:
        fd = hold(path)
    except OSError:  # locked: its conversion runs (or not a folder we may lock)
        return None
    if int(pid) != os.getpid() and _pid_alive(int(pid)):
        os.close(fd)
        return None
    return fd


def clean_stale(dst: str | os.PathLike[str]) -> list[str]:
    """Tidy the siblings of ``dst`` left by conversions that were killed.

    Remove a temporary store; put an aside (the old DST moved out of the way by
    ``--overwrite``) back in place when DST is missing, i.e. when the kill came
    between the two renames, and remove it otherwise. Returns one line per thing
    done, to show the user. Does nothing for a URL.
    """
    text = os.fspath(dst)
    if "://" in text:
        return []
    dst = Path(os.path.abspath(text))
    done: list[str] = []
    for tag in (TMP_TAG, OLD_TAG):
        found: list[Path] = []
        with contextlib.suppress(OSError):  # an unreadable parent: nothing to tidy
            found = sorted(dst.parent.glob(f".{dst.name}.{tag}-*"))
        for p in found:
            fd = _take_if_stale(p)
            if fd is None:
                continue
            try:
                if tag == OLD_TAG and not dst.exists() and not dst.is_symlink():
                    os.rename(p, dst)
                    done.append(
                        f"put {p.name} back as {dst.name}: a conversion that was killed had "
                        "moved it aside"
                    )
                    continue
                shutil.rmtree(p, ignore_errors=True)
            finally:
                os.close(fd)
            if p.exists():
                done.append(
                    f"could not remove {p.name}, left by a conversion that was killed; "
                    "remove it by hand"
                )
            else:
                done.append(f"removed {p.name} left by a conversion that was killed")
    return done
