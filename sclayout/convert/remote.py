"""Writing a layout store into an object store (``s3://``, ``gs://``) through tensorstore.

An object store has no rename, so ``convert`` cannot write a temporary sibling and move
it into place. Instead the small elements are written with anndata into a local staging
folder, the big arrays' shards are written straight to the bucket by the conversion
tasks (wherever they run), and the staged files are uploaded at the end, the root
``zarr.json`` (which carries the manifest) last: until it is there, readers see no
store at DST (docs/object-stores.md).

``--overwrite`` of a store there writes the new store whole under a new generation
prefix (``DST/g-<id>/``, a complete store of its own), then switches DST to it with one
write of DST's root ``zarr.json`` (the new manifest plus the attribute
:data:`loader.location.STORE_PREFIX_ATTR` naming the prefix), and only then deletes the
old objects: a conversion stopped at any point leaves the old store readable.
"""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loader.backends import http_context_spec, remote_concurrency_spec, ts_kvstore
from loader.errors import InputError
from loader.location import STORE_PREFIX_ATTR

__all__ = [
    "new_generation_prefix",
    "remote_store_state",
    "switch_store",
    "upload_tree",
]

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


def new_generation_prefix(url: str) -> str:
    """Return a fresh URL under DST ``url`` to write a replacing store into (``url/g-<id>``)."""
    return f"{url.rstrip('/')}/g-{uuid.uuid4().hex[:16]}"


def switch_store(url: str, new: str) -> None:
    """Make DST ``url`` the complete store written at ``new`` (under it), then delete the old.

    One write switches: DST's root ``zarr.json`` becomes the new store's with
    :data:`~loader.location.STORE_PREFIX_ATTR` naming the prefix, which readers follow.
    Every other object under DST (the old store, leftovers of stopped conversions) is
    deleted after it.
    """
    import tensorstore as ts

    sub = new.rstrip("/")[len(url.rstrip("/")) + 1 :]
    try:
        kv = _kvstore(url)
        root = json.loads(bytes(kv.read(f"{sub}/{ROOT_KEY}").result().value))
        root.setdefault("attributes", {})[STORE_PREFIX_ATTR] = sub
        kv.write(ROOT_KEY, json.dumps(root, indent=2).encode()).result()
        kept = sorted([(ROOT_KEY, ROOT_KEY + "\0"), (sub + "/", sub + "0")])
        gaps = [("", kept[0][0]), (kept[0][1], kept[1][0]), (kept[1][1], "")]  # "": no end
        for low, high in gaps:
            kv.delete_range(ts.KvStore.KeyRange(low, high)).result()
    except ValueError as e:
        raise _failed(url, "switching to the new store", e) from None


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
