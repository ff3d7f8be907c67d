"""``sclayout inspect``: what a layout store is made of, from its manifest and files.

:func:`inspect_store` returns plain JSON-ready data (``sclayout inspect --json``);
:func:`render_inspect` turns it into the human report. Nothing is decompressed: sizes
come from the file system, uncompressed sizes from shapes and dtypes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from loader.argtypes import typechecked
from loader.layout import MANIFEST_KEY, Manifest
from sclayout.checks.place import BucketPlace, Place, open_place
from sclayout.checks.verify import codec_name
from sclayout.checks.verify_store import open_store_root

__all__ = ["inspect_store", "render_inspect"]


def _open(place: Place) -> tuple[Any, Manifest]:
    root = open_store_root(place, hint="convert one with `sclayout convert SRC DST`")
    return root, Manifest.from_dict(root.attrs.get(MANIFEST_KEY))


@typechecked
def inspect_store(dst: str | os.PathLike[str], *, progress: bool = False) -> dict[str, Any]:
    """Describe the layout store at ``dst``: a folder, or an ``s3://``/``gs://`` URL.

    A bucket's store is read in place: its metadata and every shard index (one ranged
    GET each; ``progress`` shows a bar over the arrays), no chunk. Its listing carries
    no object sizes, so the elements other than the matrices have no stored size there
    (``None``).

    Returns
    -------
    dict
        ``block_size``, ``n_blocks``, ``order``, ``n_obs``, ``n_vars``, ``matrices``
        (per matrix: encoding, nnz and, per array, shape, dtype, chunks, shards, codec,
        stored and uncompressed bytes, compression ratio, files), ``files``,
        ``total_bytes``, ``other`` (files and bytes of everything else: obs, var, obsm,
        uns, metadata), ``bytes_per_cell``, ``source`` (the fingerprint) and the
        manifest's ``format``/``version``/``tool_version``/``created``,
        ``chunk_checksum``, ``missing_chunks`` (one line per array with an absent chunk,
        checked from the shard indexes and chunk files; a version-1 store may omit chunks
        equal to the fill value, so only absent arrays and shards count there) and
        ``warnings`` (the damage and a store without chunk checksums).

    Raises
    ------
    NotALayoutStoreError
        If ``dst`` is not a zarr store with a sclayout manifest.
    """
    place = open_place(dst)
    root, manifest = _open(place)
    names = tqdm(manifest.matrices, desc="inspect", unit="matrix", disable=not progress)
    matrices = {name: _describe_matrix(root, place, manifest.matrices[name]) for name in names}
    missing = _missing_chunks(place, manifest)
    warnings = [f"damaged: {line}; restore the store or reconvert it" for line in missing]
    if manifest.chunk_checksum is None:
        warnings.append(
            f"no chunk checksums (format version {manifest.version}): damage inside a chunk "
            "is found only by `sclayout verify SRC DST`; reconvert to add them"
        )
    in_matrices = [a for m in matrices.values() for a in m["arrays"].values()]
    if isinstance(place, BucketPlace):
        files, total = len(place.store.keys()), None
        other_bytes = None
    else:
        files, total = place.tree_bytes("")
        other_bytes = total - sum(a.get("stored_bytes") or 0 for a in in_matrices)
    other = {
        "files": files - sum(a.get("files", 0) for a in in_matrices),
        "stored_bytes": other_bytes,
    }
    return {
        "path": place.shown,
        "format": manifest.format,
        "version": manifest.version,
        "tool_version": manifest.tool_version,
        "created": manifest.created,
        "generation": manifest.generation,
        "n_obs": manifest.n_obs,
        "n_vars": manifest.n_vars,
        "block_size": manifest.block_size,
        "n_blocks": manifest.n_blocks,
        "order": manifest.order.to_dict(),
        "matrices": matrices,
        "files": files,
        "total_bytes": total,
        "other": other,
        "bytes_per_cell": round(total / manifest.n_obs, 1) if manifest.n_obs and total else None,
        "source": dict(manifest.source),
        "chunk_checksum": manifest.chunk_checksum,
        "missing_chunks": missing,
        "warnings": warnings,
        "sources": [
            {k: e.get(k) for k in ("name", "row0", "n_obs", "n_vars", "genes_present")}
            | {"path": e.get("fingerprint", {}).get("path")}
            for e in manifest.sources
        ],
        "genes": dict(manifest.genes),
        "notes": list(manifest.notes),
    }


def _describe_matrix(root: Any, place: Place, m: Any) -> dict[str, Any]:
    """Return one matrix's entry of the report: its manifest entry and, per array, its files."""
    arrays = {}
    for part, a in m.arrays.items():
        entry: dict[str, Any] = {
            "path": a.path,
            "shape": list(a.shape),
            "dtype": a.dtype,
            "chunks": list(a.chunks),
            "shards": None if a.shards is None else list(a.shards),
            "codec": a.codec,
        }
        if a.path in root:
            arr = root[a.path]
            entry["codec"] = codec_name(arr)
            files, stored = place.tree_bytes(a.path)
            raw = int(np.prod(arr.shape, dtype=np.int64)) * np.dtype(arr.dtype).itemsize
            entry.update(
                files=files,
                stored_bytes=stored,
                uncompressed_bytes=raw,
                ratio=round(raw / stored, 3) if stored else None,
            )
        arrays[part] = entry
    stored = sum(e.get("stored_bytes") or 0 for e in arrays.values())
    raw = sum(e.get("uncompressed_bytes", 0) for e in arrays.values())
    return {
        "encoding": m.encoding,
        "shape": list(m.shape),
        "dtype": m.dtype,
        "nnz": int(m.nnz),
        "block_pointer": m.block_pointer,
        "stored_bytes": stored,
        "uncompressed_bytes": raw,
        "ratio": round(raw / stored, 3) if stored else None,
        "arrays": arrays,
    }


def _missing_chunks(place: Place, manifest: Manifest) -> list[str]:
    """Return one line per array the manifest names that is absent or lacks a chunk."""
    missing = []
    named = [a.path for m in manifest.matrices.values() for a in m.arrays.values()]
    named += [m.block_pointer for m in manifest.matrices.values() if m.block_pointer]
    for array_path in [*named, manifest.source_index]:
        if not place.has(array_path):
            gone: str | None = "the array"
        elif manifest.all_chunks_stored:
            gone = place.missing(array_path)
        else:
            gone = None
        if gone is not None:
            missing.append(f"{array_path}: {gone} is missing")
    return missing


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"  # pragma: no cover


def _tuple(v: list[int] | None) -> str:
    return "-" if v is None else "x".join(str(int(x)) for x in v)


def render_inspect(info: dict[str, Any]) -> str:
    """Return the human-readable report of :func:`inspect_store`'s result."""
    order = info["order"]
    order_text = order["kind"]
    if order.get("seed") is not None:
        order_text += f", seed {order['seed']}"
    if order.get("columns"):
        order_text += f", by {', '.join(order['columns'])}"
    created = f", {info['created']}" if info["created"] else ""
    created += f", generation {info['generation']}" if info.get("generation") else ""
    lines = [
        f"layout store {info['path']}  ({info['format']} v{info['version']}, "
        f"written by sclayout {info['tool_version']}{created})",
        f"  cells x genes   {info['n_obs']:,} x {info['n_vars']:,}",
        f"  blocks          {info['n_blocks']:,} of {info['block_size']:,} rows",
        f"  order           {order_text}",
        f"  files           {info['files']:,}, {_size(info['total_bytes'])} "
        f"({_size(info['bytes_per_cell'])} per cell)",
    ]
    header = (
        f"  {'array':<24} {'shape':>16} {'dtype':>8} {'chunks':>12} {'shards':>12} "
        f"{'codec':>20} {'stored':>10} {'raw':>10} {'ratio':>6} {'files':>6}"
    )
    lines += ["", header]
    for name, m in info["matrices"].items():
        lines.append(f"  {name} ({m['encoding']}, nnz {m['nnz']:,}, ratio {m['ratio'] or '-'})")
        for a in m["arrays"].values():
            lines.append(
                f"    {a['path']:<22} {_tuple(a['shape']):>16} {a['dtype']:>8} "
                f"{_tuple(a['chunks']):>12} {_tuple(a['shards']):>12} {a['codec']:>20} "
                f"{_size(a.get('stored_bytes')):>10} {_size(a.get('uncompressed_bytes')):>10} "
                f"{a.get('ratio') or '-':>6} {a.get('files', '-'):>6}"
            )
    other = info["other"]
    lines.append(
        f"  {'other elements (obs, var, obsm, uns, metadata)':<47} "
        f"{_size(other['stored_bytes']):>60} {'':>17} {other['files']:>6}"
    )
    genes = info.get("genes") or {}
    if len(info.get("sources", [])) > 1 or genes.get("join") not in (None, "same"):
        lines += ["", f"  genes           {info['n_vars']:,} ({genes.get('join')})"]
        lines.append(f"  {'source':<24} {'first row':>10} {'cells':>10} {'genes':>8} {'kept':>8}")
        for e in info["sources"]:
            lines.append(
                f"  {e['name']:<24} {e['row0']:>10,} {e['n_obs']:>10,} {e['n_vars']:>8,} "
                f"{e['genes_present']:>8,}"
            )
        for col, n in sorted(genes.get("var_conflicts", {}).items()):
            lines.append(f"  var conflict    {col}: {n:,} genes given different values")
    for note in info.get("notes", []):
        lines.append(f"  note            {note}")
    if info.get("warnings"):
        lines += [""] + [f"  warning: {w}" for w in info["warnings"]]
    if info["source"]:
        lines += ["", "  source fingerprint"]
        lines += [f"    {k}: {v}" for k, v in sorted(info["source"].items())]
    return "\n".join(lines)
