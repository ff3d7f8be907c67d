"""Cheap checks that run before ``convert`` writes anything.

:func:`check_source` looks at a source's metadata only (a few bytes and the
attributes of its top-level elements, never a row of data), so it costs the same for
10^3 and 10^8 cells. :func:`check_destination` makes sure the store can be written
where asked without destroying anything. Both raise :class:`~loader.errors.InputError`
with a one-line message that names the problem and the fix; the CLI prints it and
exits non-zero, before the destination is touched.

Decisions recorded here (and in docs/quickstart.md, "When the input is wrong"):

- An empty dataset (0 cells or 0 genes) is **refused**: a layout store exists to be
  sampled by blocks, and one with no rows or no columns has nothing to sample.
- Files written by anndata < 0.7 (no ``encoding-type`` metadata: ``obs`` as an HDF5
  compound dataset, sparse X tagged ``h5sparse_format``) are converted when the
  installed anndata reads them: their small tables through anndata, X streamed as
  any other. Zarr stores of that age are refused with the command that rewrites them.
- Values are never judged: NaN or negative counts are converted as they are (verify
  compares NaN equal to NaN).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader.errors import InputError
from loader.location import is_hdf5

__all__ = [
    "MATRIX_ENCODINGS",
    "SourceInfo",
    "check_destination",
    "check_obs_columns",
    "check_source",
    "explain_read_errors",
    "inspect_source",
]


MATRIX_ENCODINGS = ("csr_matrix", "csc_matrix", "array")
"""Encodings of X, layers and raw/X that the converter streams by rows."""

_FALLBACK_ENCODINGS: Mapping[str, tuple[str, ...]] = {
    "anndata": ("0.1.0",),
    "array": ("0.2.0",),
    "awkward-array": ("0.1.0",),
    "bytes": ("0.2.0",),
    "categorical": ("0.2.0",),
    "csc_matrix": ("0.1.0",),
    "csr_matrix": ("0.1.0",),
    "dataframe": ("0.1.0", "0.2.0"),
    "dict": ("0.1.0",),
    "null": ("0.1.0",),
    "nullable-boolean": ("0.1.0",),
    "nullable-integer": ("0.1.0",),
    "nullable-string-array": ("0.1.0",),
    "numeric-scalar": ("0.2.0",),
    "raw": ("0.1.0",),
    "rec-array": ("0.2.0",),
    "string": ("0.2.0",),
    "string-array": ("0.2.0",),
}
"""Encodings anndata 0.12 reads; used only if anndata's own registry is not reachable."""

_FOREIGN_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("matrix", "row_attrs"),
        "it looks like a loom file: anndata.io.read_loom(SRC).write_h5ad(NEW)",
    ),
    (("matrix",), "it looks like a 10x .h5 file: scanpy.read_10x_h5(SRC).write_h5ad(NEW)"),
)
_SUFFIX_HINTS: Mapping[str, str] = {
    ".csv": "anndata.io.read_csv(SRC).write_h5ad(NEW)",
    ".tsv": "anndata.io.read_text(SRC).write_h5ad(NEW)",
    ".txt": "anndata.io.read_text(SRC).write_h5ad(NEW)",
    ".mtx": "anndata.io.read_mtx(SRC).write_h5ad(NEW)",
    ".loom": "anndata.io.read_loom(SRC).write_h5ad(NEW)",
    ".rds": "save it from R as .h5ad (e.g. zellkonverter or SeuratDisk)",
}


def _known_encodings() -> Mapping[str, tuple[str, ...]]:
    """Return the encoding types and versions the installed anndata reads (its I/O registry)."""
    try:
        from anndata._io.specs.registry import _REGISTRY
    except ImportError:  # pragma: no cover - anndata moved its private registry
        return _FALLBACK_ENCODINGS
    known: dict[str, set[str]] = {}
    for key in _REGISTRY.read:
        spec = key[1]
        if spec.encoding_type:
            known.setdefault(spec.encoding_type, set()).add(spec.encoding_version)
    return {k: tuple(sorted(v)) for k, v in known.items()} or _FALLBACK_ENCODINGS


# --------------------------------------------------------------------------- source


def _fail(msg: str) -> InputError:
    return InputError(msg)


def _source_kind(path: Path) -> str:
    """``"hdf5"`` or ``"zarr"``; raise for anything else."""
    if not path.exists():
        if path.is_symlink():
            raise _fail(f"SRC {path} is a broken symlink: point it at an .h5ad file or zarr store")
        raise _fail(f"SRC {path} does not exist: check the path")
    if path.is_dir():
        if _is_zarr_dir(path):
            return "zarr"
        raise _fail(
            f"SRC {path} is a directory but not a zarr store (no zarr.json or .zgroup): "
            "pass an .h5ad file or an AnnData zarr store"
        )
    try:
        if is_hdf5(path):
            return "hdf5"
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as e:
        raise _fail(f"cannot read SRC {path} ({e.strerror}): check its permissions") from None
    size = path.stat().st_size
    if size == 0:
        raise _fail(f"SRC {path} is an empty file (0 bytes): copy or download it again")
    if head == b"PK\x03\x04":
        raise _fail(f"SRC {path} is a zip file: unzip the zarr store and pass its directory")
    hint = _SUFFIX_HINTS.get(path.suffix.lower())
    fix = f"convert it first: {hint}" if hint else "pass an .h5ad file or an AnnData zarr store"
    if path.suffix.lower() == ".h5ad":
        fix = "the file is damaged (no HDF5 signature): copy or download it again"
    raise _fail(f"SRC {path} is neither HDF5 (.h5ad) nor a zarr store: {fix}")


def _open_hdf5(path: Path):
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise _fail(
            f"SRC {path} is a damaged HDF5 file ({_one_line(e)}): it is truncated or corrupt; "
            "copy or download it again"
        ) from None


def _open_zarr(path: Path):
    import zarr

    try:
        return zarr.open_group(str(path), mode="r")
    except Exception as e:  # zarr raises many types for bad metadata JSON
        raise _fail(
            f"SRC {path} is a damaged zarr store ({type(e).__name__}: {_one_line(e)}): "
            "copy it again or rewrite it with anndata"
        ) from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _is_group(node: Any) -> bool:
    return hasattr(node, "keys") and not hasattr(node, "dtype")


def _encoding(node: Any) -> tuple[str | None, str | None]:
    a = node.attrs
    et = a.get("encoding-type")
    ev = a.get("encoding-version")
    if isinstance(et, bytes):
        et = et.decode()
    if isinstance(ev, bytes):
        ev = ev.decode()
    return (None if et is None else str(et)), (None if ev is None else str(ev))


@dataclass(frozen=True)
class SourceInfo:
    """What :func:`inspect_source` learnt from SRC's metadata."""

    kind: str
    """``"hdf5"`` or ``"zarr"``."""
    n_obs: int
    n_vars: int
    x_encoding: str
    """``csr_matrix``, ``csc_matrix`` or ``array``."""
    obs_columns: tuple[str, ...]
    legacy: bool = False
    """Written by anndata < 0.7 (read through anndata; see :func:`_inspect_legacy`)."""


def _legacy(path: Path, what: str) -> InputError:
    return _fail(
        f"SRC {path} uses the anndata < 0.7 layout ({what}), which sclayout does not read: "
        "rewrite it with a current anndata: anndata.read_h5ad(SRC).write_h5ad(NEW)"
    )


def _check_encodings(path: Path, root: Any, known: Mapping[str, tuple[str, ...]]) -> None:
    """Every element with an encoding-type must be one anndata reads (attributes only)."""

    def visit(name: str, node: Any) -> None:
        et, ev = _encoding(node)
        if et is not None:
            if et not in known:
                raise _fail(
                    f"SRC {path}: element {name} has unsupported encoding-type {et!r} (anndata "
                    f"reads: {', '.join(sorted(known))}); rewrite the element "
                    "with a current anndata"
                )
            if ev is not None and ev not in known[et]:
                raise _fail(
                    f"SRC {path}: element {name} has encoding {et!r} version {ev!r}, newer than "
                    f"this anndata reads ({', '.join(known[et])}): upgrade anndata "
                    "(`pip install -U anndata`)"
                )
        if _is_group(node) and et not in _LEAF_GROUPS:
            for key in node.keys():
                visit(f"{name}/{key}", node[key])

    for key in root.keys():
        visit(key, root[key])


_LEAF_GROUPS = frozenset(
    {
        "csr_matrix",
        "csc_matrix",
        "categorical",
        "nullable-integer",
        "nullable-boolean",
        "nullable-string-array",
        "awkward-array",
    }
)
"""Groups whose children are parts of one element: no need to look inside."""


def _n_rows(node: Any, *, name: str, path: Path) -> int:
    """Row count of a dataframe group (from its index array's shape: metadata only)."""
    a = node.attrs
    index_key = a.get("_index")
    if isinstance(index_key, bytes):
        index_key = index_key.decode()
    if index_key is None or str(index_key) not in node:
        raise _fail(
            f"SRC {path}: {name} has no index array: the file is damaged or not AnnData; "
            "rewrite it with anndata"
        )
    return int(node[str(index_key)].shape[0])


def _matrix_shape(node: Any, *, name: str, path: Path) -> tuple[int, int]:
    et, _ = _encoding(node)
    if _is_group(node):
        if et is None and "h5sparse_format" in node.attrs:
            raise _legacy(path, f"{name} tagged h5sparse_format")
        if et not in MATRIX_ENCODINGS:
            raise _fail(
                f"SRC {path}: {name} has encoding {et!r}, which sclayout cannot convert "
                f"(supported: {', '.join(MATRIX_ENCODINGS)}); store it as a CSR, CSC or dense "
                "matrix with anndata"
            )
        shape = node.attrs.get("shape")
        if shape is None or len(shape) != 2:
            raise _fail(
                f"SRC {path}: {name} ({et}) has no 2-d shape attribute: the file is damaged; "
                "rewrite it with anndata"
            )
        for part in ("data", "indices", "indptr"):
            if part not in node:
                raise _fail(
                    f"SRC {path}: {name} ({et}) lacks {part!r}: the file is damaged; "
                    "rewrite it with anndata"
                )
        return int(shape[0]), int(shape[1])
    if et not in (None, "array"):
        raise _fail(
            f"SRC {path}: {name} has encoding {et!r}, which sclayout cannot convert "
            f"(supported: {', '.join(MATRIX_ENCODINGS)}); store it as a CSR, CSC or dense "
            "matrix with anndata"
        )
    if len(node.shape) != 2:
        raise _fail(
            f"SRC {path}: {name} is {len(node.shape)}-d, a matrix must be 2-d: "
            "rewrite it with anndata"
        )
    if node.dtype.names is not None or node.dtype.kind not in "biuf":
        raise _fail(
            f"SRC {path}: {name} has dtype {node.dtype}, sclayout converts numeric matrices only; "
            "store it as numbers with anndata"
        )
    return int(node.shape[0]), int(node.shape[1])


def inspect_source(src: str | os.PathLike[str]) -> SourceInfo:
    """Validate SRC from metadata only and return its kind, shape and obs columns.

    Parameters
    ----------
    src
        Path of an ``.h5ad`` file or an AnnData zarr store (v2 or v3).

    Raises
    ------
    InputError
        With a one-line message for every reason the converter could not read SRC.
    """
    path = Path(src)
    kind = _source_kind(path)
    root = _open_hdf5(path) if kind == "hdf5" else _open_zarr(path)
    try:
        return _inspect_root(path, kind, root)
    except InputError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
        raise _fail(
            f"SRC {path} is damaged: reading its metadata failed ({_one_line(e)}); "
            "copy or download it again"
        ) from None
    finally:
        if kind == "hdf5":
            root.close()


def _inspect_root(path: Path, kind: str, root: Any) -> SourceInfo:
    fmt = "HDF5" if kind == "hdf5" else "zarr"
    et, _ = _encoding(root)
    if et is not None and et != "anndata":
        raise _fail(
            f"SRC {path} is a {fmt} {et!r} element, not an AnnData object: "
            "pass the file anndata wrote with write_h5ad / write_zarr"
        )
    keys = set(root.keys())
    if not {"obs", "var"} <= keys:
        hint = "write it with anndata (adata.write_h5ad / adata.write_zarr)"
        for needed, text in _FOREIGN_HINTS:
            if set(needed) <= keys:
                hint = text
                break
        missing = sorted({"obs", "var"} - keys)
        raise _fail(f"SRC {path} is {fmt} but not AnnData (no {', '.join(missing)}): {hint}")
    obs, var = root["obs"], root["var"]
    for name, node in (("obs", obs), ("var", var)):
        if not _is_group(node):
            return _inspect_legacy(path, kind, f"{name} stored as a compound dataset")
        net, _ = _encoding(node)
        if net is None:
            return _inspect_legacy(path, kind, f"{name} has no encoding-type")
        if net != "dataframe":
            raise _fail(
                f"SRC {path}: {name} has encoding {net!r}, expected 'dataframe': "
                "the file is not AnnData; rewrite it with anndata"
            )
    _check_encodings(path, root, _known_encodings())
    n_obs = _n_rows(obs, name="obs", path=path)
    n_vars = _n_rows(var, name="var", path=path)
    if "X" not in keys:
        raise _fail(
            f"SRC {path} has no X matrix: sclayout lays out X; set adata.X "
            "(e.g. adata.X = adata.layers['counts']) and save again"
        )
    x_shape = _matrix_shape(root["X"], name="X", path=path)
    if x_shape != (n_obs, n_vars):
        raise _fail(
            f"SRC {path}: X is {x_shape[0]}x{x_shape[1]} but obs has {n_obs} rows and var "
            f"{n_vars}: the file is inconsistent; rewrite it with anndata"
        )
    if n_obs == 0 or n_vars == 0:
        raise _fail(
            f"SRC {path} is empty ({n_obs} cells x {n_vars} genes): a layout store needs at "
            "least one cell and one gene; nothing to convert"
        )
    if "layers" in keys and _is_group(root["layers"]):
        for lname in root["layers"].keys():
            shape = _matrix_shape(root["layers"][lname], name=f"layers/{lname}", path=path)
            if shape != (n_obs, n_vars):
                raise _fail(
                    f"SRC {path}: layers/{lname} is {shape[0]}x{shape[1]}, X is "
                    f"{n_obs}x{n_vars}: the file is inconsistent; rewrite it with anndata"
                )
    if "raw" in keys and _is_group(root["raw"]) and "X" in root["raw"]:
        shape = _matrix_shape(root["raw"]["X"], name="raw/X", path=path)
        if shape[0] != n_obs:
            raise _fail(
                f"SRC {path}: raw/X has {shape[0]} rows, X has {n_obs}: the file is "
                "inconsistent; rewrite it with anndata"
            )
    x_enc = _encoding(root["X"])[0] or "array"
    columns = obs.attrs.get("column-order", [])
    return SourceInfo(
        kind=kind,
        n_obs=n_obs,
        n_vars=n_vars,
        x_encoding=x_enc,
        obs_columns=tuple(c.decode() if isinstance(c, bytes) else str(c) for c in columns),
    )


def _inspect_legacy(path: Path, kind: str, what: str) -> SourceInfo:
    """Check a file in the anndata < 0.7 layout.

    It is accepted when the installed anndata reads it (backed, so X stays on disk); its
    small tables are then read through anndata.
    """
    import anndata as ad

    if kind != "hdf5":
        raise _legacy(path, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adata = ad.read_h5ad(path, backed="r")
    except Exception as e:  # anndata raises many types on files it cannot read
        raise _fail(
            f"SRC {path} uses the anndata < 0.7 layout ({what}) and anndata cannot read it "
            f"({type(e).__name__}: {_one_line(e)}): the file is damaged or not AnnData"
        ) from None
    try:
        n_obs, n_vars = adata.shape
        x = adata.file["X"]
        x_enc = "array" if hasattr(x, "dtype") else f"{_attr_str(x, 'h5sparse_format')}_matrix"
        columns = tuple(str(c) for c in adata.obs.columns)
    finally:
        adata.file.close()
    if x_enc not in MATRIX_ENCODINGS:
        raise _fail(f"SRC {path}: X has legacy encoding {x_enc!r}, which sclayout cannot convert")
    if n_obs == 0 or n_vars == 0:
        raise _fail(
            f"SRC {path} is empty ({n_obs} cells x {n_vars} genes): a layout store needs at "
            "least one cell and one gene; nothing to convert"
        )
    return SourceInfo(
        kind=kind, n_obs=n_obs, n_vars=n_vars, x_encoding=x_enc, obs_columns=columns, legacy=True
    )


def _attr_str(node: Any, key: str) -> str:
    v = node.attrs.get(key, "")
    return v.decode() if isinstance(v, bytes) else str(v)


def check_source(src: str | os.PathLike[str]) -> None:
    """Raise :class:`InputError` unless SRC is an AnnData file sclayout can convert.

    Metadata only: the cost does not grow with the number of cells. See the module
    docstring for the decisions (empty datasets are refused).
    """
    inspect_source(src)


def check_obs_columns(
    src: str | os.PathLike[str],
    columns: tuple[str, ...] | list[str],
    *,
    info: SourceInfo | None = None,
) -> None:
    """Raise :class:`InputError` if an ``--by`` column is not in SRC's obs (metadata only).

    ``info``: SRC's :func:`inspect_source` result if the caller has it (not read again).
    """
    if not columns:
        return
    available = (info or inspect_source(src)).obs_columns
    missing = [c for c in columns if c not in available]
    if missing:
        listed = ", ".join(available) if available else "(obs has no columns)"
        raise _fail(f"--by {missing[0]!r}: no such obs column in {src}; available: {listed}")


@contextlib.contextmanager
def explain_read_errors(
    src: str | os.PathLike[str],
    *,
    what: str = "data",
    errors: tuple[type[BaseException], ...] = (OSError,),
) -> Iterator[None]:
    """Turn a low-level read failure of SRC into an :class:`InputError`.

    Such failures are a damaged chunk or a truncated file; wrap the converter's and
    verify's reads in it.

    ``errors``: what counts as such a failure. Besides ``OSError``, a damaged source
    raises ``RuntimeError`` (a chunk that fails to decompress), ``KeyError`` (h5py,
    a broken object header) or ``ValueError`` (zarr); an :class:`InputError` passes.
    """
    try:
        yield
    except InputError:
        raise
    except errors as e:
        detail = _one_line(e) if isinstance(e, OSError) else f"{type(e).__name__}: {_one_line(e)}"
        raise _fail(
            f"SRC {src}: reading {what} failed ({detail}): the file is corrupt or "
            "truncated; copy or download it again"
        ) from None


# ---------------------------------------------------------------------- destination


def _is_zarr_dir(p: Path) -> bool:
    return (p / "zarr.json").is_file() or (p / ".zgroup").is_file()


def _same_or_inside(a: Path, b: Path) -> bool:
    """Return True if ``a`` is ``b`` or lies inside it (after resolving symlinks)."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def check_destination(
    dst: str | os.PathLike[str],
    *,
    overwrite: bool,
    src: str | os.PathLike[str] | None = None,
) -> None:
    """Raise :class:`InputError` unless a store can be written at DST.

    Parameters
    ----------
    dst
        Where the layout store goes.
    overwrite
        Whether an existing DST may be replaced. Even then, only a zarr store or an
        empty directory is replaced: never a regular file or a directory of other
        things, so a typo cannot delete a home folder.
    src
        The source: DST must be neither SRC nor inside it, nor contain it.
    """
    path = Path(dst)
    if src is not None and Path(src).exists():
        s = Path(src)
        if _same_or_inside(path, s) or _same_or_inside(s, path):
            raise _fail(f"DST {path} is SRC, inside it or contains it: choose another DST")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise _fail(f"DST {path} exists: pass --overwrite to replace it")
        if path.is_symlink() or not path.is_dir():
            raise _fail(
                f"DST {path} exists and is not a zarr store: refusing to replace it even with "
                "--overwrite; remove it yourself or choose another DST"
            )
        if not _is_zarr_dir(path) and any(path.iterdir()):
            raise _fail(
                f"DST {path} is a non-empty directory that is not a zarr store: refusing to "
                "replace it even with --overwrite; remove it yourself or choose another DST"
            )
    parent = path.absolute().parent
    ancestor = parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _fail(f"DST {path}: {ancestor} is a file, not a directory: choose another DST")
    if ancestor != parent:
        raise _fail(
            f"DST {path}: parent directory {parent} does not exist: create it "
            f"(mkdir -p {parent}) or choose another DST"
        )
    try:  # the only sure test of writability (os.access is always True for root)
        probe = tempfile.mkdtemp(prefix=".sclayout-probe-", dir=parent)
    except OSError as e:
        raise _fail(
            f"DST {path}: cannot write in {parent} ({e.strerror}): choose a writable DST"
        ) from None
    os.rmdir(probe)
