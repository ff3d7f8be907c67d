"""Writing a layout store into an object store (``s3://``, ``gs://``) through tensorstore.

An object store has no rename, so ``convert`` cannot write a temporary sibling and move
it into place. Instead the small elements are written with anndata into a local staging
folder, the big arrays' shards are written straight to the bucket by the conversion
tasks (wherever they run), and the staged files are uploaded at the end, the root
``zarr.json`` (which carries the manifest) last: until it is there, readers see no
store at DST (docs/object-stores.md).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loader.backends import http_context_spec, remote_concurrency_spec, ts_kvstore
from loader.errors import InputError

__all__ = ["delete_store", "download_tree", "remote_store_state", "upload_tree"]

UPLOAD_IN_FLIGHT = 64
"""Objects uploaded at once (the loader's remote concurrency)."""
ROOT_KEY = "zarr.json"


def _kvstore(url: str) -> Any:
    import tensorstore as ts

    context = ts.Context({**http_context_spec(), **remote_concurrency_spec(UPLOAD_IN_FLIGHT)})
    return ts.KvStore.open(ts_kvstore(url, ""), context=context).result()


def _fix(url: str) -> str:
    return (
        "check the bucket exists and the credentials and endpoint "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION; "
        "https://github.com/sclayout/sclayout/blob/main/docs/object-stores.md)"
        if url.startswith("s3://")
        else "check the bucket exists and GOOGLE_APPLICATION_CREDENTIALS"
    )


def _failed(url: str, what: str, e: Exception) -> InputError:
    cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    return InputError(f"DST {url}: {what} failed ({cause}); {_fix(url)}")


def remote_store_state(url: str) -> str:
    """Return what DST ``url`` holds: ``"store"``, ``"partial"`` or ``"empty"``.

    ``"partial"``: objects but no root ``zarr.json`` (an interrupted conversion).
    Also proves the bucket answers: :class:`InputError` (naming the variables to
    check) when it cannot be read.
    """
    try:
        kv = _kvstore(url)
        if kv.read(ROOT_KEY).result().state == "value":
            return "store"
        return "partial" if kv.list().result() else "empty"
    except ValueError as e:
        raise _failed(url, "reading", e) from None


def delete_store(url: str) -> None:
    """Delete every object under DST ``url``'s prefix, the root ``zarr.json`` first."""
    import tensorstore as ts

    try:
        kv = _kvstore(url)
        kv.delete_range(ts.KvStore.KeyRange(ROOT_KEY, ROOT_KEY + "\0")).result()
        kv.delete_range(ts.KvStore.KeyRange()).result()
    except ValueError as e:
        raise _failed(url, "deleting the old store", e) from None


def upload_tree(local: str | os.PathLike[str], url: str, *, under: str = "") -> int:
    """Upload the files below ``local/under`` to the same keys under ``url``.

    The root ``zarr.json`` is written last, once every other object is there (the
    manifest marks the store complete). Returns the number of objects written.
    """
    root = Path(local)
    keys = sorted(p.relative_to(root).as_posix() for p in (root / under).rglob("*") if p.is_file())
    last = [k for k in keys if k == ROOT_KEY]
    rest = [k for k in keys if k != ROOT_KEY]
    try:
        kv = _kvstore(url)
        for group in (rest, last):
            for i in range(0, len(group), UPLOAD_IN_FLIGHT):
                pending: list[Future] = [
                    kv.write(k, (root / k).read_bytes()) for k in group[i : i + UPLOAD_IN_FLIGHT]
                ]
                for f in pending:
                    f.result()
    except ValueError as e:
        raise _failed(url, "writing", e) from None
    return len(keys)


def download_tree(url: str, local: str | os.PathLike[str]) -> int:
    """Copy every object under ``url``'s prefix into folder ``local``; return their number.

    For the checks that walk a store's files (``verify``, ``inspect``): they read every
    object anyway, and then read the copy as a local store.
    """
    root = Path(local)
    try:
        kv = _kvstore(url)
        keys = sorted(k.decode() for k in kv.list().result())
        for i in range(0, len(keys), UPLOAD_IN_FLIGHT):
            group = keys[i : i + UPLOAD_IN_FLIGHT]
            for key, f in [(k, kv.read(k)) for k in group]:
                dest = root / key
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(f.result().value)
    except ValueError as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{url}: reading failed ({cause}); {_fix(url)}") from None
    return len(keys)
