"""Datasets for benchmarks, examples and the demo: generated or tiled from real files.

Two builders write an ``.h5ad`` file out of core (rows streamed with h5py into
resizable datasets, so memory stays bounded whatever ``n_obs``), and :func:`cached`
keeps their output outside the repository so that a multi-GB benchmark set is built
once per machine.

* :func:`make_tahoe_like` — a synthetic set shaped like Tahoe-100M plates: CSR float32
  counts, ``plate`` and ``cell_line`` labels that a classifier can learn from the
  expression, rows sorted by plate then cell line (as real atlases are on disk).
* :func:`tile_real` — a larger *real* set made by tiling real files (e.g. the PBMC
  files of the real-data folder beside the checkout) with binomial thinning
  per copy, so no two cells are equal, sorted by a label column.

Both are deterministic given ``seed``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

from loader.errors import InputError

__all__ = [
    "bench_dir",
    "cached",
    "cached_tahoe_like",
    "make_tahoe_like",
    "tahoe_like_name",
    "tile_real",
]

DENSE_CHUNK_ENTRIES = 1 << 24
"""Cells × genes generated at once (16 Mi entries ≈ 64 MB per float32 array, a few arrays
alive): bounds the generator's memory while keeping each numpy call large enough to be
fast."""


def _h5_chunk(expected_nnz: int, itemsize: int = 4) -> int:
    """HDF5 chunk length of ``data``/``indices``: what anndata gets for this size.

    anndata writes sparse X resizable, with h5py's guessed chunks (48,829 elements,
    ~190 KB, for 4·10^8 non-zeros). Much larger chunks (e.g. 4 MB) make
    random row access to the h5ad — the true-random baseline — far slower than
    on a real file, and every "× random" ratio unfairly large.
    """
    try:
        from h5py._hl.filters import guess_chunk
    except ImportError:  # pragma: no cover - private h5py helper moved
        return 1 << 16
    return int(guess_chunk((max(int(expected_nnz), 1),), None, itemsize)[0])


GENE_MEAN_SIGMA = 2.0
"""Spread (natural-log sd) of the lognormal gene means. Real scRNA-seq gene means span
~5 orders of magnitude; sd 2 (≈ ±4 decades at 2 sd) gives a Zipf-like head of
ubiquitous genes and a long tail of rare ones."""

SIZE_FACTOR_SIGMA = 0.35
"""Log-sd of the per-cell library size (sequencing depth varies ~2× between cells)."""

OVERDISPERSION = 2.0
"""Gamma shape of the per-entry extra-Poisson noise (negative-binomial-like counts)."""

LINE_PROGRAM_FRACTION, LINE_PROGRAM_SIGMA = 0.05, 1.5
"""Each cell line up/down-regulates 5 % of the genes by a lognormal factor (log-sd 1.5):
strong, line-specific programs a classifier can learn."""

PLATE_EFFECT_FRACTION, PLATE_EFFECT_SIGMA = 0.10, 0.4
"""Plates (batches) shift 10 % of the genes by a milder factor (log-sd 0.4)."""


# --------------------------------------------------------------------------- cache


def bench_dir() -> Path:
    """Dataset cache: ``$SCLAYOUT_BENCH_DIR``, else ``~/.cache/sclayout-bench``."""
    env = os.environ.get("SCLAYOUT_BENCH_DIR")
    path = Path(env) if env else Path.home() / ".cache" / "sclayout-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached(name: str, builder: Callable[..., Any], *, root: Path | None = None, **kw: Any) -> Path:
    """Return ``root/name``, building it first with ``builder(tmp_path, **kw)`` if absent.

    The build writes a temporary sibling and renames it into place, so an interrupted
    build never leaves a file that looks complete. A lock file serialises concurrent
    builders (several processes asking for the same dataset build it once).

    Parameters
    ----------
    name
        File (or folder) name inside the cache; encode the parameters in it.
    builder
        Called as ``builder(path, **kw)``; must create ``path``.
    root
        Folder of the cache (created if absent); ``None``: :func:`bench_dir`.
    **kw
        Passed to ``builder``.
    """
    if root is None:
        root = bench_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    if final.exists():
        return final
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.exists():  # built by another process while we waited
                return final
            tmp = root / f".{name}.tmp-{os.getpid()}"
            _remove(tmp)
            try:
                builder(tmp, **kw)
                os.replace(tmp, final)
            finally:
                _remove(tmp)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _remove(path: Path) -> None:
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ------------------------------------------------------------------ h5ad streaming


class _CSRWriter:
    """Append CSR rows to an h5ad whose obs/var skeleton anndata already wrote."""

    def __init__(self, path: Path, *, n_obs: int, n_vars: int, expected_nnz: int) -> None:
        self.f = h5py.File(path, "r+")
        x = self.f["X"]
        for key in ("data", "indices", "indptr"):
            del x[key]
        chunk = _h5_chunk(expected_nnz)
        self.data = x.create_dataset(
            "data", shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(chunk,)
        )
        self.indices = x.create_dataset(
            "indices", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(chunk,)
        )
        self.indptr = np.zeros(n_obs + 1, dtype=np.int64)
        self.row = 0
        self.nnz = 0
        x.attrs["shape"] = np.array([n_obs, n_vars], dtype=np.int64)

    def append(self, data: np.ndarray, indices: np.ndarray, row_nnz: np.ndarray) -> None:
        n = len(data)
        end = self.nnz + n
        self.data.resize((end,))
        self.indices.resize((end,))
        self.data[self.nnz : end] = data
        self.indices[self.nnz : end] = indices
        m = len(row_nnz)
        self.indptr[self.row + 1 : self.row + 1 + m] = self.nnz + np.cumsum(row_nnz)
        self.row += m
        self.nnz = end

    def close(self) -> None:
        if self.row != len(self.indptr) - 1:
            raise RuntimeError(f"wrote {self.row} rows, expected {len(self.indptr) - 1}")
        self.f["X"].create_dataset("indptr", data=self.indptr)
        self.f.close()


def _write_skeleton(path: Path, obs: pd.DataFrame, var: pd.DataFrame) -> None:
    """Write obs/var (and an empty X) with anndata itself, so encodings are exactly anndata's."""
    import anndata as ad

    x = sp.csr_matrix((len(obs), len(var)), dtype=np.float32)
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(path)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="cells", unit_scale=True)


# ------------------------------------------------------------------- Tahoe-like


def tahoe_like_name(
    *,
    n_obs: int = 200_000,
    n_vars: int = 20_000,
    nnz_per_cell: int = 2_000,
    seed: int = 0,
    sampler: str = "dense",
) -> str:
    """Cache file name of :func:`make_tahoe_like` output for these parameters."""
    tag = "" if sampler == "dense" else f"_{sampler}"
    return f"tahoe_like_{n_obs}x{n_vars}_nnz{nnz_per_cell}_seed{seed}{tag}.h5ad"


def cached_tahoe_like(
    *,
    n_obs: int = 200_000,
    n_vars: int = 20_000,
    nnz_per_cell: int = 2_000,
    seed: int = 0,
    sampler: str = "dense",
    progress: bool = False,
    root: Path | None = None,
) -> Path:
    """Return the Tahoe-like dataset from the cache, built on first use.

    The cache is ``root``, else :func:`bench_dir`.
    """
    name = tahoe_like_name(
        n_obs=n_obs, n_vars=n_vars, nnz_per_cell=nnz_per_cell, seed=seed, sampler=sampler
    )
    return cached(
        name,
        make_tahoe_like,
        root=root,
        n_obs=n_obs,
        n_vars=n_vars,
        nnz_per_cell=nnz_per_cell,
        seed=seed,
        sampler=sampler,
        progress=progress,
    )


def _solve_depth(weights: np.ndarray, target: float, sizes: np.ndarray) -> np.ndarray:
    """Per row of ``weights``, depth L with ``mean_s sum_j 1 - exp(-L s w_j) = target``.

    ``sizes`` are quantiles of the per-cell size factor, so the *average* cell (not the
    cell of median depth) has ``target`` detected genes. Bisection, vectorised over rows.
    """
    lo = np.zeros(len(weights))
    hi = np.full(len(weights), 1.0)

    def detected(depth: np.ndarray) -> np.ndarray:
        rate = depth[:, None, None] * sizes[None, :, None] * weights[:, None, :]
        return (-np.expm1(-rate)).sum(axis=2).mean(axis=1)

    while np.any(detected(hi) < target):
        hi = np.where(detected(hi) < target, hi * 4, hi)
    for _ in range(40):  # 2^-40 relative: far below sampling noise
        mid = (lo + hi) / 2
        below = detected(mid) < target
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return (lo + hi) / 2


def make_tahoe_like(
    path: str | os.PathLike,
    *,
    n_obs: int = 200_000,
    n_vars: int = 20_000,
    nnz_per_cell: int = 2_000,
    n_plates: int = 14,
    n_cell_lines: int = 50,
    seed: int = 0,
    sampler: str = "dense",
    progress: bool = False,
) -> Path:
    """Write a synthetic, Tahoe-100M-like count matrix as ``.h5ad``, out of core.

    Generative model (per cell *i* of cell line *c* on plate *p*, gene *j*): a Poisson
    process of rate ``λ_ij = L_i · μ_j · program_cj · plate_pj`` with lognormal gene
    means ``μ`` (see the module constants), line programs and plate effects; the entry
    is non-zero when the first arrival ``E_ij ~ Exp(1)`` falls below ``λ_ij``, and its
    count is ``1 + Poisson(G · (λ_ij − E_ij))`` with gamma noise ``G`` (overdispersed,
    negative-binomial-like). Depths ``L`` are solved per line so a cell has on average
    ``nnz_per_cell`` detected genes. Rows are grouped by plate, then cell line.

    Parameters
    ----------
    path
        Output ``.h5ad`` (overwritten).
    n_obs, n_vars
        Shape. At the defaults the file is ≈3.2 GB (uncompressed CSR float32 / int32).
    nnz_per_cell
        Mean number of non-zero genes per cell.
    n_plates, n_cell_lines
        Categories of ``obs["plate"]`` and ``obs["cell_line"]``.
    seed
        Same seed, same file (byte for byte in X).
    sampler
        ``"dense"`` draws every cell × gene entry as described above (time grows with
        ``n_obs × n_vars``). ``"sparse"`` draws each cell's detected genes directly
        (time grows with the non-zeros, so 10^6-10^7 cells take minutes): a cell of
        line *c* draws ``K ~ Poisson(k_c · L_i)`` genes with replacement from its
        rates, ``k_c`` solved so that a cell has on average ``nnz_per_cell`` distinct
        genes; a gene's count is how often it was drawn. Same labels and gene
        programs, different bytes.
    progress
        Show a progress bar.

    Returns
    -------
    The path written. obs: ``plate``, ``cell_line`` (categoricals); var_names: gene ids.

    Notes
    -----
    ``X/data`` and ``X/indices`` are uncompressed, resizable HDF5 datasets chunked as
    anndata chunks them (h5py's guess for the final size, ~190 KB here); because both
    grow together their chunks alternate in the file (anndata writes one after the
    other), so a reader of the same row range in both arrays reads one region of it.
    """
    path = Path(path)
    _check_tahoe_args(n_obs, n_vars, nnz_per_cell, n_plates, n_cell_lines, sampler)
    structure_ss, rows_ss = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(structure_ss)
    genes = _TahoeGenes.draw(rng, n_vars, n_cell_lines, n_plates, nnz_per_cell)
    cells = _TahoeCells.draw(rng, n_obs, n_plates, n_cell_lines)
    var = pd.DataFrame(index=pd.Index([f"ENSG{j:011d}" for j in range(n_vars)]))
    _write_skeleton(path, cells.obs(n_plates, n_cell_lines), var)
    _write_tahoe_x(path, genes, cells, rows_ss, nnz_per_cell, sampler, progress=progress)
    return path


def _check_tahoe_args(
    n_obs: int, n_vars: int, nnz_per_cell: int, n_plates: int, n_cell_lines: int, sampler: str
) -> None:
    """Refuse a shape, a group count or a sampler :func:`make_tahoe_like` cannot generate."""
    for name, value in (("n_obs", n_obs), ("n_vars", n_vars), ("nnz_per_cell", nnz_per_cell)):
        if int(value) != value or value <= 0:
            raise InputError(f"{name}={value!r}: must be a positive integer")
    if not 0 < nnz_per_cell < n_vars:
        raise InputError(f"nnz_per_cell={nnz_per_cell}: must be below n_vars={n_vars}")
    if n_plates <= 0 or n_cell_lines <= 0:
        raise InputError(
            f"n_plates={n_plates}, n_cell_lines={n_cell_lines}: must be positive integers"
        )
    if sampler not in ("dense", "sparse"):
        raise InputError(f"sampler={sampler!r}: use 'dense' or 'sparse'")


@dataclass(frozen=True)
class _TahoeGenes:
    """The genes of :func:`make_tahoe_like`: each cell line's rates and each plate's effect."""

    weights: np.ndarray
    """Per cell line, the share of each gene in its expression (rows sum to 1)."""
    line_rates: np.ndarray
    """Per cell line, each gene's Poisson rate at the line's solved depth."""
    plate_effect: np.ndarray

    @classmethod
    def draw(
        cls,
        rng: np.random.Generator,
        n_vars: int,
        n_cell_lines: int,
        n_plates: int,
        nnz_per_cell: int,
    ) -> _TahoeGenes:
        """Draw lognormal means, line programs and plate effects (float64, then float32)."""
        mu = rng.lognormal(0.0, GENE_MEAN_SIGMA, n_vars)
        mu /= mu.sum()
        program = np.ones((n_cell_lines, n_vars))
        hit = rng.random((n_cell_lines, n_vars)) < LINE_PROGRAM_FRACTION
        program[hit] = rng.lognormal(0.0, LINE_PROGRAM_SIGMA, int(hit.sum()))
        weights = mu * program
        weights /= weights.sum(axis=1, keepdims=True)
        quantiles = statistics.NormalDist().inv_cdf
        sizes = np.exp(SIZE_FACTOR_SIGMA * np.array([quantiles((k + 0.5) / 8) for k in range(8)]))
        depth = _solve_depth(weights, float(nnz_per_cell), sizes)
        line_rates = (weights * depth[:, None]).astype(np.float32)
        plate_effect = np.ones((n_plates, n_vars), dtype=np.float32)
        hit = rng.random((n_plates, n_vars)) < PLATE_EFFECT_FRACTION
        plate_effect[hit] = rng.lognormal(0.0, PLATE_EFFECT_SIGMA, int(hit.sum()))
        return cls(weights, line_rates, plate_effect)


@dataclass(frozen=True)
class _TahoeCells:
    """The cells of :func:`make_tahoe_like`: plate, cell line and size factor of each row."""

    plate_code: np.ndarray
    line_code: np.ndarray
    size_factor: np.ndarray

    @classmethod
    def draw(
        cls, rng: np.random.Generator, n_obs: int, n_plates: int, n_cell_lines: int
    ) -> _TahoeCells:
        """Draw the size of each (plate, line) group; rows sorted by plate, then line."""
        plate_p = rng.dirichlet(np.full(n_plates, 20.0))
        line_p = rng.dirichlet(np.full(n_cell_lines, 5.0), size=n_plates)
        sizes = rng.multinomial(n_obs, (plate_p[:, None] * line_p).ravel())
        group = np.repeat(np.arange(n_plates * n_cell_lines), sizes)
        plate_code, line_code = np.divmod(group, n_cell_lines)
        size_factor = rng.lognormal(0.0, SIZE_FACTOR_SIGMA, n_obs).astype(np.float32)
        return cls(plate_code, line_code, size_factor)

    def obs(self, n_plates: int, n_cell_lines: int) -> pd.DataFrame:
        """Return the obs table: ``plate`` and ``cell_line`` categoricals, cell names."""
        plates = [f"plate{p + 1:02d}" for p in range(n_plates)]
        lines = [f"CVCL_{c:04d}" for c in range(n_cell_lines)]
        return pd.DataFrame(
            {
                "plate": pd.Categorical.from_codes(self.plate_code, categories=plates),
                "cell_line": pd.Categorical.from_codes(self.line_code, categories=lines),
            },
            index=pd.Index([f"cell{i:08d}" for i in range(len(self.plate_code))]),
        )


def _write_tahoe_x(
    path: Path,
    genes: _TahoeGenes,
    cells: _TahoeCells,
    rows_ss: np.random.SeedSequence,
    nnz_per_cell: int,
    sampler: str,
    *,
    progress: bool,
) -> None:
    """Generate X chunk by chunk of rows (one seed each) and append it to ``path``."""
    n_obs, n_vars = len(cells.plate_code), genes.line_rates.shape[1]
    if sampler == "sparse":
        draws = _solve_draws(genes.weights, float(nnz_per_cell))
        rows_per_chunk = max(1, DENSE_CHUNK_ENTRIES // (4 * nnz_per_cell))
    else:
        rows_per_chunk = max(1, DENSE_CHUNK_ENTRIES // n_vars)
    starts = range(0, n_obs, rows_per_chunk)
    chunk_seeds = rows_ss.spawn(len(starts))
    line_code, plate_code, size_factor = cells.line_code, cells.plate_code, cells.size_factor
    writer = _CSRWriter(path, n_obs=n_obs, n_vars=n_vars, expected_nnz=n_obs * nnz_per_cell)
    try:
        with _progress(n_obs, progress, "generating") as bar:
            for start, ss in zip(starts, chunk_seeds, strict=True):
                stop = min(start + rows_per_chunk, n_obs)
                rng = np.random.default_rng(ss)
                if sampler == "sparse":
                    data, indices, row_nnz = _tahoe_rows_sparse(
                        rng,
                        genes.line_rates,
                        genes.plate_effect,
                        draws,
                        line_code[start:stop],
                        plate_code[start:stop],
                        size_factor[start:stop],
                    )
                else:
                    data, indices, row_nnz = _tahoe_rows(
                        rng,
                        genes.line_rates[line_code[start:stop]],
                        genes.plate_effect[plate_code[start:stop]],
                        size_factor[start:stop],
                    )
                writer.append(data, indices, row_nnz)
                if bar is not None:
                    bar.update(stop - start)
    finally:
        writer.close()


def _tahoe_rows(
    rng: np.random.Generator, rates: np.ndarray, plate: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate one chunk of rows (vectorised over the dense chunk); returns CSR pieces."""
    m, n_vars = rates.shape
    lam = rates
    lam *= plate
    lam *= size[:, None]
    arrival = rng.standard_exponential((m, n_vars), dtype=np.float32)
    flat = np.flatnonzero(arrival < lam)
    rest = lam.ravel()[flat] - arrival.ravel()[flat]
    del arrival, lam
    noise = rng.gamma(OVERDISPERSION, 1.0 / OVERDISPERSION, len(flat))
    counts = (1 + rng.poisson(rest * noise)).astype(np.float32)
    rows, cols = np.divmod(flat, n_vars)
    row_nnz = np.bincount(rows, minlength=m)
    return counts, cols.astype(np.int32), row_nnz


def _solve_draws(weights: np.ndarray, target: float) -> np.ndarray:
    """Per row of ``weights`` (summing to 1), draws k with ``sum_j 1 - exp(-k w_j) = target``.

    Drawing Poisson(k) genes with replacement from ``w`` then yields ``target``
    distinct genes on average. Bisection, vectorised over rows.
    """
    lo, hi = np.zeros(len(weights)), np.full(len(weights), target)

    def distinct(k: np.ndarray) -> np.ndarray:
        return (-np.expm1(-k[:, None] * weights)).sum(axis=1)

    while np.any(distinct(hi) < target):
        hi = np.where(distinct(hi) < target, hi * 2, hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        below = distinct(mid) < target
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return (lo + hi) / 2


def _sorted_uniforms(rng: np.random.Generator, k: np.ndarray) -> np.ndarray:
    """For each n in ``k``, n uniforms in [0, 1) in increasing order, concatenated.

    Normalised partial sums of exponential spacings (no sort): the i-th of n sorted
    uniforms is ``(E_1 + ... + E_i) / (E_1 + ... + E_{n+1})``.
    """
    spacing = rng.standard_exponential(int(k.sum()) + k.size)
    total = np.cumsum(spacing)
    ends = np.cumsum(k + 1) - 1  # last spacing of each row: its normaliser
    base = np.r_[0.0, total[ends[:-1]]]
    row = np.repeat(np.arange(k.size), k + 1)
    keep = np.ones(total.size, dtype=bool)
    keep[ends] = False
    span = total[ends] - base
    return ((total - base[row]) / span[row])[keep]


def _tahoe_rows_sparse(
    rng: np.random.Generator,
    line_rates: np.ndarray,
    plate_effect: np.ndarray,
    draws: np.ndarray,
    line: np.ndarray,
    plate: np.ndarray,
    size: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One chunk of rows drawn gene by detected gene (``sampler="sparse"``); CSR pieces.

    Rows of one (plate, line) group are consecutive, so the chunk is cut into runs of
    one group, each sampled from its group's cumulative rates. Each row's draws are
    sorted uniforms, so its genes come out sorted and repeats are adjacent.
    """
    m = len(line)
    group = plate.astype(np.int64) * line_rates.shape[0] + line
    cuts = np.r_[0, np.flatnonzero(np.diff(group)) + 1, m]
    k = rng.poisson(draws[line] * size)
    u = _sorted_uniforms(rng, k)
    genes = np.empty(u.size, dtype=np.int64)
    at = np.r_[0, np.cumsum(k)]
    for a, b in itertools.pairwise(cuts):
        c, p = int(line[a]), int(plate[a])
        cdf = np.cumsum(line_rates[c] * plate_effect[p], dtype=np.float64)
        lo, hi = int(at[a]), int(at[b])
        genes[lo:hi] = np.searchsorted(cdf, u[lo:hi] * cdf[-1], side="right")
    np.minimum(genes, line_rates.shape[1] - 1, out=genes)
    rows = np.repeat(np.arange(m), k)
    new = np.ones(genes.size, dtype=bool)
    new[1:] = (genes[1:] != genes[:-1]) | (rows[1:] != rows[:-1])
    first = np.flatnonzero(new)
    counts = np.diff(np.r_[first, genes.size]).astype(np.float32)  # draws of each gene
    return counts, genes[first].astype(np.int32), np.bincount(rows[first], minlength=m)


# --------------------------------------------------------------------- tiled real


def _read_source(path: Path, label: str) -> tuple[sp.csr_matrix, pd.DataFrame, pd.Index]:
    import anndata as ad

    if not path.exists():
        raise InputError(f"sources: {path} does not exist; pass existing .h5ad files")
    a = ad.read_h5ad(path)
    if label not in a.obs.columns:
        raise InputError(
            f"label={label!r}: not an obs column of {path.name} "
            f"(columns: {', '.join(map(str, a.obs.columns))})"
        )
    x = a.X if sp.issparse(a.X) else sp.csr_matrix(a.X)
    return sp.csr_matrix(x, dtype=np.float32), a.obs, a.var_names


def tile_real(
    sources: Sequence[str | os.PathLike] | Mapping[str | os.PathLike, str],
    path: str | os.PathLike,
    *,
    n_obs: int = 100_000,
    label: str = "Annotation",
    seed: int = 0,
    thinning: float = 0.9,
    test_fraction: float = 0.2,
    progress: bool = False,
) -> Path:
    """Tile real ``.h5ad`` files into a larger real dataset, sorted by a label on disk.

    Each copy of a source cell is binomially thinned (every count kept with probability
    ``thinning``), so copies differ like resequenced cells and no two rows are equal.
    Genes: those of a single source, or the intersection of the sources' var_names (in
    the first source's order). Copies are spread evenly over the source cells until
    ``n_obs`` rows, then rows are sorted by ``label`` (stable) — the on-disk order of
    many real atlases, which is what makes sequential reading biased.

    Parameters
    ----------
    sources
        ``.h5ad`` files with counts in X; or a mapping ``file -> label column`` when the
        label column is named differently per file (the output column is ``label``).
    path
        Output ``.h5ad`` (overwritten).
    n_obs
        Rows in the output.
    label
        obs column to sort by and keep (categorical in the output).
    seed
        Same seed, same output.
    thinning
        Binomial keep-probability per count, in (0, 1].
    test_fraction
        Fraction of *source cells* whose copies all go to ``obs["split"] == "test"``,
        so a held-out split never shares a source cell with the training split.
    progress
        Show a progress bar.

    Returns
    -------
    The path written. obs: ``label``, ``source`` (file stem), ``source_cell`` (its obs
    name in the source), ``copy`` (int), ``split`` (``train``/``test``).
    """
    path = Path(path)
    if not 0.0 < thinning <= 1.0:
        raise InputError(f"thinning={thinning}: must be in (0, 1]")
    if not 0.0 <= test_fraction < 1.0:
        raise InputError(f"test_fraction={test_fraction}: must be in [0, 1)")
    if int(n_obs) != n_obs or n_obs <= 0:
        raise InputError(f"n_obs={n_obs!r}: must be a positive integer")
    x_all, cell, genes = _pooled_sources(sources, label)
    ss_split, ss_pick, ss_thin = np.random.SeedSequence(seed).spawn(3)
    is_test = _held_out(len(cell), test_fraction, ss_split)
    src_row, copy_no = _tiled_rows(cell[label], n_obs, ss_pick)
    obs = _tiled_obs(cell, label, src_row, copy_no, is_test)
    _write_skeleton(path, obs, pd.DataFrame(index=genes.astype(str)))
    del obs
    _write_thinned(path, x_all, src_row, ss_thin, thinning, progress=progress)
    return path


def _pooled_sources(
    sources: Sequence[str | os.PathLike] | Mapping[str | os.PathLike, str], label: str
) -> tuple[sp.csr_matrix, pd.DataFrame, pd.Index]:
    """Read the sources and stack them on their common genes.

    Returns X (CSR, sorted indices), a table of the source cells (``label``, ``source``,
    ``source_cell``) and the genes (the first source's order).
    """
    columns = (
        {Path(s): c for s, c in sources.items()}
        if isinstance(sources, Mapping)
        else {Path(s): label for s in sources}
    )
    if not columns:
        raise InputError("sources: empty; pass at least one .h5ad file")
    loaded = [(p, *_read_source(p, col), col) for p, col in columns.items()]
    genes = loaded[0][3]
    for _, _, _, names, _ in loaded[1:]:
        genes = genes[genes.isin(names)]
    if len(genes) == 0:
        raise InputError("sources: their var_names have no gene in common; tile one file")
    xs, cells = [], []
    for p, x, obs, names, col in loaded:
        xs.append(x[:, names.get_indexer(genes)])
        cells.append(
            pd.DataFrame(
                {
                    label: obs[col].astype(str).to_numpy(),
                    "source": p.stem,
                    "source_cell": obs.index.astype(str),
                }
            )
        )
    x_all = sp.vstack(xs, format="csr")
    x_all.sort_indices()
    return x_all, pd.concat(cells, ignore_index=True), genes


def _held_out(n_src: int, test_fraction: float, ss: np.random.SeedSequence) -> np.ndarray:
    """Return which source cells are held out (all their copies go to the test split)."""
    is_test = np.zeros(n_src, dtype=bool)
    n_test = round(test_fraction * n_src)
    is_test[np.random.default_rng(ss).choice(n_src, n_test, replace=False)] = True
    return is_test


def _tiled_rows(
    labels: pd.Series, n_obs: int, ss: np.random.SeedSequence
) -> tuple[np.ndarray, np.ndarray]:
    """Return each output row's source cell and copy number, rows sorted by label (stable).

    Every source cell is copied ``n_obs // n_src`` times, and a random subset once more.
    """
    n_src = len(labels)
    full, extra = divmod(n_obs, n_src)
    copies = np.full(n_src, full, dtype=np.int64)
    copies[np.random.default_rng(ss).choice(n_src, extra, replace=False)] += 1
    src_row = np.repeat(np.arange(n_src), copies)
    copy_no = np.arange(n_obs) - np.repeat(np.cumsum(copies) - copies, copies)
    categories = sorted(labels.unique())
    order = np.argsort(pd.Categorical(labels, categories).codes[src_row], kind="stable")
    return src_row[order], copy_no[order]


def _tiled_obs(
    cell: pd.DataFrame, label: str, src_row: np.ndarray, copy_no: np.ndarray, is_test: np.ndarray
) -> pd.DataFrame:
    """Return the obs table of the tiled rows (see :func:`tile_real`'s Returns)."""
    categories = sorted(cell[label].unique())
    return pd.DataFrame(
        {
            label: pd.Categorical(cell[label].to_numpy()[src_row], categories=categories),
            "source": pd.Categorical(cell["source"].to_numpy()[src_row]),
            "source_cell": cell["source_cell"].to_numpy()[src_row],
            "copy": copy_no.astype(np.int32),
            "split": pd.Categorical(
                np.where(is_test[src_row], "test", "train"), categories=["train", "test"]
            ),
        },
        index=pd.Index(
            [f"{s}-{c}" for s, c in zip(_row_names(cell, src_row), copy_no, strict=True)]
        ),
    )


def _write_thinned(
    path: Path,
    x_all: sp.csr_matrix,
    src_row: np.ndarray,
    ss: np.random.SeedSequence,
    thinning: float,
    *,
    progress: bool,
) -> None:
    """Append X: each row a copy of its source row, every count binomially thinned."""
    n_obs, n_genes, n_src = len(src_row), x_all.shape[1], x_all.shape[0]
    rows_per_chunk = max(1, DENSE_CHUNK_ENTRIES // max(1, n_genes))
    starts = range(0, n_obs, rows_per_chunk)
    chunk_seeds = ss.spawn(len(starts))
    expected_nnz = n_obs * x_all.nnz * thinning / max(1, n_src)
    writer = _CSRWriter(path, n_obs=n_obs, n_vars=n_genes, expected_nnz=int(expected_nnz))
    try:
        with _progress(n_obs, progress, "tiling") as bar:
            for start, chunk_ss in zip(starts, chunk_seeds, strict=True):
                stop = min(start + rows_per_chunk, n_obs)
                block = x_all[src_row[start:stop]]
                data = block.data
                if thinning < 1.0:
                    kept = np.random.default_rng(chunk_ss).binomial(
                        np.rint(data).astype(np.int64), thinning
                    )
                    block = sp.csr_matrix(
                        (kept.astype(np.float32), block.indices, block.indptr), shape=block.shape
                    )
                    block.eliminate_zeros()
                writer.append(block.data, block.indices.astype(np.int32), np.diff(block.indptr))
                if bar is not None:
                    bar.update(stop - start)
    finally:
        writer.close()


def _row_names(cell: pd.DataFrame, src_row: np.ndarray) -> Iterator[str]:
    """Unique-ish row names: ``<source>:<source cell>`` per tiled row (copy appended by caller)."""
    src = cell["source"].to_numpy()
    name = cell["source_cell"].to_numpy()
    return (f"{src[i]}:{name[i]}" for i in src_row)
