"""Storage profiles: the measured figures the throughput model predicts from.

A profile says how fast one storage location (a local disk read cold, an HTTP
object store, ...) serves reads, and how fast this CPU decodes and assembles
them. ``sclayout calibrate`` measures one; a few presets ship with the package
(``sclayout/cost/presets/*.json``), each citing where its figures come from.

Profile format version 4 (JSON; version 3 is version 4 without ``assemble_s_per_nnz``,
version 2 also without ``cpu_scale``, version 1 also without the two ``worker_``
figures; all still read)::

    {"format": "sclayout-profile", "version": 4, "name": ..., "kind": "local"|"http",
     "latency_s": ..., "bandwidth_Bps": ..., "request_bytes": ...,
     "concurrency": [[in_flight, requests_per_s], ...],
     "codecs": {"blosc-lz4": {"ratio": ..., "decode_Bps": ..., "chunk_s": ...}, ...},
     "gather_s_per_nnz": ..., "densify_s_per_value": ..., "assemble_s_per_nnz": ...,
     "copy_Bps": ...,
     "fetch_overhead_s": ..., "request_cpu_s": ..., "read_cpu_s_per_byte": ...,
     "read_cpu_scope": "process"|"machine", "cores": ..., "cpu_count": ...,
     "worker_cores": ..., "worker_cpu_s_per_cell": ...,
     "cpu_scale": [[working_set_bytes, measured / priced], ...],
     "source": "where the figures come from", "created": ISO-8601}
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from loader.argtypes import typechecked
from loader.errors import FormatVersionError, SpecError

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "CodecSpeed",
    "Profile",
    "get_preset",
    "list_presets",
    "load_profile",
]

PROFILE_FORMAT = "sclayout-profile"
PROFILE_VERSION = 4
"""Version of the profile format this package writes and the newest it reads (4 added
``assemble_s_per_nnz``; older profiles read with it 0)."""
KINDS = ("local", "http")
MIN_CORES = 0.1
"""Least parallelism a profile holds: on a machine busy with other jobs the loader may
get a small share of one core, and a prediction made then should say so."""


@dataclass(frozen=True)
class CodecSpeed:
    """How one codec behaves on single-cell count data on this CPU.

    Parameters
    ----------
    ratio
        Uncompressed bytes / compressed bytes for CSR ``data`` + ``indices``.
    decode_Bps
        Uncompressed bytes produced per second of CPU time.
    chunk_s
        CPU time per inner chunk decoded on top of its bytes (the per-chunk work of
        the read path: one decoder call, buffers, bookkeeping).
    """

    ratio: float
    decode_Bps: float
    chunk_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ratio", "decode_Bps"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise SpecError(f"codec {name}={v!r}: must be a positive number")
            object.__setattr__(self, name, float(v))
        if not (isinstance(self.chunk_s, int | float) and math.isfinite(self.chunk_s)):
            raise SpecError(f"codec chunk_s={self.chunk_s!r}: must be a number >= 0")
        if self.chunk_s < 0:
            raise SpecError(f"codec chunk_s={self.chunk_s!r}: must be a number >= 0")
        object.__setattr__(self, "chunk_s", float(self.chunk_s))

    def to_dict(self) -> dict[str, float]:
        """Return the codec figures as a JSON-ready dict."""
        return {"ratio": self.ratio, "decode_Bps": self.decode_Bps, "chunk_s": self.chunk_s}


_POSITIVE = (
    "latency_s",
    "bandwidth_Bps",
    "gather_s_per_nnz",
    "densify_s_per_value",
    "copy_Bps",
)
_NON_NEGATIVE = (
    "assemble_s_per_nnz",
    "fetch_overhead_s",
    "request_cpu_s",
    "read_cpu_s_per_byte",
    "worker_cores",
    "worker_cpu_s_per_cell",
)


@dataclass(frozen=True)
class Profile:
    """Measured speeds of one storage location and this CPU.

    Parameters
    ----------
    name
        Short name (a preset's name, or the calibrated target).
    kind
        ``"local"`` (file system) or ``"http"`` (HTTP server / object store).
    latency_s
        Time of one small read with nothing else in flight (cold).
    bandwidth_Bps
        Sequential bandwidth of large reads, bytes/s.
    concurrency
        ``(in_flight, requests_per_s)`` pairs for reads of ``request_bytes`` each,
        sorted by ``in_flight``; how the store's throughput grows with parallelism.
    request_bytes
        Size of the reads behind ``concurrency``.
    codecs
        Codec name -> :class:`CodecSpeed`.
    gather_s_per_nnz
        CPU time to gather one stored value (data + index) into a minibatch's own
        CSR arrays (``csr`` output, and the rows a DataLoader worker hands over).
    densify_s_per_value
        CPU time to write one dense output value (zero fill + scatter straight from
        the fetch's rows), per cell × gene.
    assemble_s_per_nnz
        CPU time per stored value of building a fetch's rows from its reads (widening,
        the rows' CSR arrays), in the reader's assembly thread, beside the minibatch
        thread that cuts the outputs. 0 (profiles before version 4): counted in the
        two figures above.
    copy_Bps
        Memory copy bandwidth (batches handed from worker processes).
    fetch_overhead_s
        Fixed CPU time per fetch (planning, futures, Python).
    request_cpu_s
        CPU time per read request (calibrate: the reading process's, user +
        system; machine-wide for a server on this machine, whose share then counts).
    read_cpu_s_per_byte
        CPU time per byte read from storage (kernel copies and page-cache work of a
        cold local read; a loopback server's and the HTTP client's work).
    read_cpu_scope
        ``"process"``: the reading CPU is the loader process's own (a local disk);
        ``"machine"``: partly another process's (a server on this machine: calibrate
        adds the CPU of the process listening on its port, or, when that process
        cannot be found, the whole machine's), which runs beside the loader.
    cores
        Cores a fetch's CPU can spread over: a fetch's CPU time divided by it is the
        fastest that fetch can go. Calibrate gives the cores the loader plans for
        less those other processes kept busy while it ran the loader, at least the
        cores that run kept busy (:func:`sclayout.cost.calibrate.cpu_bound_cores`;
        both measured figures are in ``extra``); on a busy machine, the loader's share.
    cpu_count
        Cores calibrate could use (its CPU affinity and cgroup quota,
        :func:`loader.cores.usable_cores`): the core count the loader plans its
        threads for on this machine (0: unknown, taken as ``cores`` rounded up).
    worker_cores
        Cores the loader keeps busy with 2 DataLoader workers (their processes and
        the main one together) when it never waits for storage; 0: not measured
        (``cores`` is used).
    worker_cpu_s_per_cell
        CPU time per cell the worker path adds to a single process's (each worker's
        gather and packing, the hand-over, the main process's unpacking); 0: not
        measured (the model counts two memory copies of the CSR rows instead).
    cpu_scale
        ``(working_set_bytes, ratio)`` pairs, sorted: the loader's CPU per cell as
        calibrate measured it running (:func:`sclayout.cost.calibrate.measure_pipeline`)
        over the CPU the model prices from the figures above, at fetches whose data in
        flight (the fetches held and the dense minibatch) is that many bytes. Larger
        fetches outgrow the CPU caches, and the assembly's scatter then waits on
        memory: a cost per cell that grows with the fetch. Empty: 1.
    source
        Where the figures come from (machine and command, or a citation).
    """

    name: str
    kind: str
    latency_s: float
    bandwidth_Bps: float
    concurrency: tuple[tuple[int, float], ...]
    request_bytes: int
    codecs: Mapping[str, CodecSpeed]
    gather_s_per_nnz: float
    densify_s_per_value: float
    copy_Bps: float
    assemble_s_per_nnz: float = 0.0
    fetch_overhead_s: float = 0.0
    request_cpu_s: float = 0.0
    read_cpu_s_per_byte: float = 0.0
    read_cpu_scope: str = "process"
    cores: float = 1.0
    cpu_count: float = 0.0
    worker_cores: float = 0.0
    worker_cpu_s_per_cell: float = 0.0
    cpu_scale: tuple[tuple[float, float], ...] = ()
    source: str = ""
    created: str = ""
    format: str = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(f"profile kind={self.kind!r}: unknown; known: {', '.join(KINDS)}")
        for name in _POSITIVE:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise SpecError(f"profile {name}={v!r}: must be a positive number")
            object.__setattr__(self, name, float(v))
        for name in _NON_NEGATIVE:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise SpecError(f"profile {name}={v!r}: must be a number >= 0")
            object.__setattr__(self, name, float(v))
        try:
            curve = tuple(sorted((int(n), float(r)) for n, r in self.concurrency))
        except (TypeError, ValueError):
            curve = ()
        if not curve or any(n < 1 or not (math.isfinite(r) and r > 0) for n, r in curve):
            raise SpecError(
                f"profile concurrency={self.concurrency!r}: needs (in_flight >= 1, "
                "requests_per_s > 0) pairs"
            )
        object.__setattr__(self, "concurrency", curve)
        try:
            scale = tuple(sorted((float(w), float(r)) for w, r in self.cpu_scale))
        except (TypeError, ValueError):
            scale = ((-1.0, -1.0),)
        if any(not (math.isfinite(w) and w > 0 and math.isfinite(r) and r > 0) for w, r in scale):
            raise SpecError(
                f"profile cpu_scale={self.cpu_scale!r}: needs (working_set_bytes > 0, "
                "ratio > 0) pairs"
            )
        object.__setattr__(self, "cpu_scale", scale)
        if not self.codecs:
            raise SpecError("profile lists no codecs; recalibrate with `sclayout calibrate`")
        object.__setattr__(
            self,
            "codecs",
            {
                k: v if isinstance(v, CodecSpeed) else CodecSpeed(**v)
                for k, v in self.codecs.items()
            },
        )
        if self.read_cpu_scope not in ("process", "machine"):
            raise SpecError(
                f"profile read_cpu_scope={self.read_cpu_scope!r}: unknown; known: process, machine"
            )
        if not (
            isinstance(self.cpu_count, int | float)
            and math.isfinite(self.cpu_count)
            and self.cpu_count >= 0
        ):
            raise SpecError(f"profile cpu_count={self.cpu_count!r}: must be a number >= 0")
        object.__setattr__(self, "cpu_count", float(self.cpu_count))
        if not (
            isinstance(self.cores, int | float)
            and math.isfinite(self.cores)
            and self.cores >= MIN_CORES
        ):
            raise SpecError(f"profile cores={self.cores!r}: must be a number >= {MIN_CORES}")
        object.__setattr__(self, "cores", float(self.cores))
        rb = self.request_bytes
        if isinstance(rb, bool) or not isinstance(rb, int | float) or not 0 <= rb < math.inf:
            raise SpecError(f"profile request_bytes={rb!r}: must be a number of bytes >= 0")
        object.__setattr__(self, "request_bytes", int(rb))

    def requests_per_s(self, in_flight: float) -> float:
        """Throughput in requests/s of reads of ``request_bytes`` with ``in_flight`` in flight.

        Log-linear interpolation of the measured curve, flat beyond it.
        """
        n = max(1.0, float(in_flight))
        xs = [math.log(c) for c, _ in self.concurrency]
        ys = [r for _, r in self.concurrency]
        x = math.log(n)
        if x <= xs[0]:
            # below the first point: scale linearly with parallelism
            return ys[0] * n / self.concurrency[0][0]
        if x >= xs[-1]:
            return ys[-1]
        for i in range(1, len(xs)):
            if x <= xs[i]:
                t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        return ys[-1]  # pragma: no cover

    @property
    def effective_bandwidth(self) -> float:
        """Largest bandwidth seen, sequential or concurrent.

        Sequential reads, or the concurrency curve's requests/s × ``request_bytes``
        (many reads in flight can beat a few large ones).
        """
        curve = max(r for _, r in self.concurrency) * self.request_bytes
        return max(self.bandwidth_Bps, curve)

    def has_codec(self, name: str) -> bool:
        """Whether :meth:`codec` knows ``name`` (measured, or its byte-shuffle form)."""
        return name in self.codecs or name.removesuffix("-bitshuffle") in self.codecs

    def codec(self, name: str) -> CodecSpeed:
        """Speed of codec ``name``; error names the codecs this profile measured."""
        try:
            return self.codecs[name]
        except KeyError:
            base = name.removesuffix("-bitshuffle")
            if base in self.codecs:
                return self.codecs[base]
            raise SpecError(
                f"codec={name!r}: not in profile {self.name!r}; known: "
                f"{', '.join(sorted(self.codecs))} (recalibrate with `sclayout calibrate`)"
            ) from None

    def cpu_scale_at(self, working_set_bytes: float) -> float:
        """Return :attr:`cpu_scale` at ``working_set_bytes``.

        Interpolated on the bytes' logarithm between the measured points, the end
        points' ratio beyond them; 1 without any.
        """
        if not self.cpu_scale:
            return 1.0
        pts = [(math.log(w), r) for w, r in self.cpu_scale]
        x = math.log(max(working_set_bytes, 1.0))
        if x <= pts[0][0]:
            return pts[0][1]
        for (w0, r0), (w1, r1) in itertools.pairwise(pts):
            if x <= w1:
                return r0 + (r1 - r0) * (x - w0) / (w1 - w0) if w1 > w0 else r1
        return pts[-1][1]

    def at_cores(self, cores: int) -> Profile:
        """Return the profile of this machine given ``cores`` cores.

        Instead of the cores it was calibrated with: the same storage and speed per
        core, the cores calibrate gave (``cores``, ``worker_cores``) scaled per
        core. The model then starts as many decode threads as the loader would there.
        """
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise SpecError(f"cores={cores!r}: give a whole number of cores >= 1")
        base = round(self.cpu_count) or max(1, math.ceil(self.cores))
        scale = cores / base
        return replace(
            self,
            cores=max(MIN_CORES, self.cores * scale),
            cpu_count=float(cores),
            worker_cores=self.worker_cores * scale,
        )

    def with_(self, **changes: Any) -> Profile:
        """Return a copy of the profile with ``changes``."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the profile as its JSON-ready dict, with format and version."""
        return {
            "format": self.format,
            "version": PROFILE_VERSION,
            "name": self.name,
            "kind": self.kind,
            "latency_s": self.latency_s,
            "bandwidth_Bps": self.bandwidth_Bps,
            "request_bytes": self.request_bytes,
            "concurrency": [[n, r] for n, r in self.concurrency],
            "codecs": {k: v.to_dict() for k, v in sorted(self.codecs.items())},
            "gather_s_per_nnz": self.gather_s_per_nnz,
            "densify_s_per_value": self.densify_s_per_value,
            "assemble_s_per_nnz": self.assemble_s_per_nnz,
            "copy_Bps": self.copy_Bps,
            "fetch_overhead_s": self.fetch_overhead_s,
            "request_cpu_s": self.request_cpu_s,
            "read_cpu_s_per_byte": self.read_cpu_s_per_byte,
            "read_cpu_scope": self.read_cpu_scope,
            "cores": self.cores,
            "cpu_count": self.cpu_count,
            "worker_cores": self.worker_cores,
            "worker_cpu_s_per_cell": self.worker_cpu_s_per_cell,
            "cpu_scale": [[w, r] for w, r in self.cpu_scale],
            "source": self.source,
            "created": self.created,
            "extra": dict(self.extra),
        }

    def to_json(self) -> str:
        """Return the profile as JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "profile") -> Profile:
        """Return the profile in ``d``; anything else is a :class:`SpecError` naming ``where``."""
        if not isinstance(d, Mapping) or d.get("format") != PROFILE_FORMAT:
            raise SpecError(
                f'{where} is not a storage profile (no "format": "{PROFILE_FORMAT}"); '
                "write one with `sclayout calibrate TARGET --out FILE`"
            )
        version = d.get("version")
        if not isinstance(version, int) or not 1 <= version <= PROFILE_VERSION:
            raise FormatVersionError(
                f"{where}: profile version {version!r} is not readable by this sclayout "
                f"(reads version {PROFILE_VERSION}): upgrade with `pip install -U sclayout`, "
                "or recalibrate with `sclayout calibrate`"
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        kw = dict(d, version=PROFILE_VERSION)  # read older versions as the current one
        try:
            kw["concurrency"] = tuple(tuple(p) for p in d["concurrency"])
            kw["cpu_scale"] = tuple(tuple(p) for p in d.get("cpu_scale", ()))
            kw["codecs"] = {k: CodecSpeed(**v) for k, v in d["codecs"].items()}
            return cls(**kw)
        except SpecError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SpecError(
                f"{where} is incomplete or malformed ({e}); recalibrate with `sclayout calibrate`"
            ) from None

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")


@typechecked
def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON file.

    Raises
    ------
    SpecError
        If the file is missing, not JSON or not a profile.
    FormatVersionError
        If it was written by a newer sclayout.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or "not a text file"
        raise SpecError(f"cannot read profile {p}: {reason}; check the path") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"profile {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    return Profile.from_dict(data, where=f"profile {p}")


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    root = resources.files("sclayout.cost") / "presets"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


@typechecked
def get_preset(name: str) -> Profile:
    """Return the preset profile ``name``; the error lists the known presets."""
    known = list_presets()
    if name not in known:
        raise SpecError(f"profile preset {name!r}: unknown; known presets: {', '.join(known)}")
    text = (resources.files("sclayout.cost") / "presets" / f"{name}.json").read_text()
    return Profile.from_dict(json.loads(text), where=f"preset {name}")


@typechecked
def resolve_profile(value: str | Path | Profile) -> Profile:
    """Return a profile from a :class:`Profile`, a JSON file path or a preset name."""
    if isinstance(value, Profile):
        return value
    s = str(value)
    if s.endswith(".json") or Path(s).exists() or "/" in s:
        return load_profile(s)
    return get_preset(s)
