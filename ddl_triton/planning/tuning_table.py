"""The tuning table: what a sweep (``ddl-tune``) measured on one machine, and what it chose.

A table is a versioned JSON file. It is valid only where it was measured, so it carries
a **key**, and the runtime uses it only when every field of the key matches:

    {
      "format": "ddl_triton-tuning", "version": 1, "created": "2026-11-30T10:40:00Z",
      "key": {
        "world_size": 2,                       # ranks
        "topology": "2",                       # Topology.signature, e.g. "2x2" for 2 nodes of 2
        "transports": {"intra": "shm", "inter": "mpi"},   # per level: how ranks of a node / of
                                               #   different nodes talk (Options.transport)
        "device": "cpu",                       # tensors the sweep timed
        "cpu": "AMD EPYC ...", "cores": 2,     # /proc/cpuinfo model name; usable cores
        "ddl_triton": "0.1.0", "torch": "2.13.0", "mpi": "MPICH Version: 5.0.2"
      },
      "options": {"chunk_bytes": 4194304, "pipeline_depth": 4},
                                               # the communicator layout the entries were
                                               #   measured with (shm slot bytes, slots per rank)
      "entries": {                             # collective -> dtype -> measured sizes, ascending
        "allreduce": {"float32": [
          {"bytes": 262144,                    # the input tensor's bytes on each rank
           "schedule": "one_shot", "chunk_bytes": 2097152,
           "algos": null,                      # per grid dimension, for multidim
           "time_us": 262.0, "p20_us": 255.1, "p80_us": 270.3,   # median of interleaved rounds,
                                               #   each the slowest rank's time per call
           "runner_up": {"schedule": "ring", "chunk_bytes": 524288, "algos": null, "time_us": 414.0},
           "by_schedule": {"one_shot": 262.0, "ring": 414.0, ...}}   # best time of each schedule
        ]}},
      "model": {"parameters": {...CostModel.to_dict()...}, "fit": {"samples": 212, "median_abs_rel_error": 0.08,
                "not_fitted": ["mpi_alpha", "mpi_beta"]}, "validation": [...]},
      "kernels": {"reduce": {"config": {"BLOCK": 4096, "num_warps": 8, "num_stages": 1}}},   # optional (CUDA)
      "compression": {"levels": {"intra": {...}, "inter": {"latency_us": 150.0, "bytes_per_s": 1.1e8, ...}},
                      "entries": [{"bytes": 2097152, "by_method": {"none": 18900.0, "int8": 6100.0, "onebit": 2900.0}}]},
                                               # optional (ddl-tune --compression): each level's link and,
                                               #   per size, the fp32 and per-level compressed allreduce's
                                               #   median; what Options.compression="auto" follows
                                               #   (ddl_triton/tuning/auto_compression.py)
      "measurements": [...]                    # every timed candidate (for plots and refits)
    }

How the runtime uses a table (ddl_triton/planning/planner.py): a call's (collective, dtype, bytes)
takes the entry measured at exactly that size; between two measured sizes, each schedule
measured at both is interpolated log-log and the fastest wins; outside the measured range,
or for a collective or dtype the sweep skipped, the table's fitted cost model decides.

Where a table comes from (``resolve``): ``Options.tuning_file`` / ``DDL_TUNING_FILE`` names
one; "off" uses none; empty (the default) looks in the cache folder (``DDL_TUNING_DIR``, else
``$XDG_CACHE_HOME/ddl_triton/tuning``, else ``~/.cache/ddl_triton/tuning``) for the file whose
name is the hash of the current key, which ``ddl-tune`` writes there. Errors:

- a named file that is missing, not JSON, or not a version-1 table: ``ValueError`` at init
  (a typo in a path must not silently fall back);
- a named file whose key differs: ignored with one warning naming every differing field,
  and the built-in cost model decides;
- entries naming a schedule this process does not know: those entries are dropped with a
  warning (a custom schedule registered when the table was made, not now);
- a cached file that is unreadable or does not match: ignored with a warning.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import schedules
from .._private_files import chosen_folder, write_private_file
from .costmodel import CostModel

FORMAT = "ddl_triton-tuning"
VERSION = 1
OFF = "off"


class TuningTableError(ValueError):
    """A tuning table that cannot be used as given (the message names the file and the problem)."""


@dataclass(frozen=True)
class Choice:
    """What a table says for one call: a schedule, its parameters, and the evidence."""

    schedule: str
    chunk_bytes: int
    algos: tuple[str, ...] | None
    evidence: str           # e.g. "one_shot measured 262 us, ring 414 us"


@dataclass
class TuningTable:
    key: dict
    options: dict
    entries: dict                       # collective -> dtype -> list of entry dicts, ascending bytes
    model: CostModel | None = None
    model_info: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    measurements: list = field(default_factory=list)
    peers: dict = field(default_factory=dict)
    compression: dict = field(default_factory=dict)
    created: str = ""
    path: str = ""                      # where it was loaded from ("" when built in memory)

    # -- lookup ---------------------------------------------------------------------------
    def choose(self, collective: str, dtype: str, nbytes: int) -> Choice | None:
        """The table's choice for a call, or None where the table is silent (see module doc)."""
        rows = self.entries.get(collective, {}).get(dtype)
        if not rows or nbytes < rows[0]["bytes"] or nbytes > rows[-1]["bytes"]:
            return None
        sizes = [r["bytes"] for r in rows]
        hi = next(i for i, b in enumerate(sizes) if b >= nbytes)
        if sizes[hi] == nbytes:
            row = rows[hi]
            return Choice(row["schedule"], int(row["chunk_bytes"]), _algos(row.get("algos")),
                          _evidence(row["by_schedule"], "measured"))
        lo_row, hi_row = rows[hi - 1], rows[hi]
        both = set(lo_row["by_schedule"]) & set(hi_row["by_schedule"])
        if not both:
            return None
        w = math.log(nbytes / lo_row["bytes"]) / math.log(hi_row["bytes"] / lo_row["bytes"])
        estimate = {s: math.exp((1 - w) * math.log(lo_row["by_schedule"][s]) + w * math.log(hi_row["by_schedule"][s]))
                    for s in both}
        best = min(estimate, key=estimate.get)
        # The winner's parameters: from the nearer measured size where it won or came second.
        near, far = (lo_row, hi_row) if w < 0.5 else (hi_row, lo_row)
        params = {"chunk_bytes": self.options["chunk_bytes"], "algos": None}
        for row in (near, far):
            if row["schedule"] == best or (row.get("runner_up") or {}).get("schedule") == best:
                params = row if row["schedule"] == best else row["runner_up"]
                break
        return Choice(best, int(params["chunk_bytes"]), _algos(params.get("algos")),
                      _evidence(estimate, f"interpolated between {lo_row['bytes']} B and {hi_row['bytes']} B:", "~"))

    def digest(self) -> str:
        """A short hash of what makes two tables choose alike (key, options, entries, model)."""
        payload = json.dumps([self.key, self.options, self.entries, self.model.to_dict() if self.model else None]
                             + ([self.compression] if self.compression else []), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # -- (de)serialisation ---------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "created": self.created, "key": self.key,
                "options": self.options, "entries": self.entries,
                "model": {"parameters": self.model.to_dict(), **self.model_info} if self.model else None,
                "kernels": self.kernels, "peers": self.peers, **({"compression": self.compression}
                                                                    if self.compression else {}),
                "measurements": self.measurements}

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (a reader never sees half a table): a new 0600 file renamed onto
        ``path``, so a link planted there is replaced, not written through; a missing folder is
        created 0700 (ddl_triton/_private_files.py)."""
        path = Path(path)
        chosen_folder(str(path.parent))
        write_private_file(str(path), json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")


def load(path: str | os.PathLike) -> TuningTable:
    """Read and validate a table; raises TuningTableError naming the file and what is wrong."""
    path = str(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TuningTableError(f"tuning table {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TuningTableError(f"tuning table {path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise TuningTableError(f"tuning table {path}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") \
            from None
    return from_json(data, path)


def from_json(data, path: str = "<memory>") -> TuningTable:
    def bad(why: str) -> TuningTableError:
        return TuningTableError(f"tuning table {path}: {why}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"not a ddl_triton tuning table (expected \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise bad(f"format version {data.get('version')!r}, but this ddl_triton reads version {VERSION}")
    for name, kind in (("key", dict), ("options", dict), ("entries", dict)):
        if not isinstance(data.get(name), kind):
            raise bad(f"field {name!r} is missing or not an object")
    entries = {}
    for collective, by_dtype in data["entries"].items():
        if collective not in schedules.COLLECTIVES:
            raise bad(f"unknown collective {collective!r} in entries; valid: {', '.join(schedules.COLLECTIVES)}")
        if not isinstance(by_dtype, dict):
            raise bad(f"entries.{collective} is not an object")
        for dtype, rows in by_dtype.items():
            if not isinstance(rows, list):
                raise bad(f"entries.{collective}.{dtype} is not a list")
            for row in rows:
                _check_row(row, f"entries.{collective}.{dtype}", bad)
            entries.setdefault(collective, {})[dtype] = sorted(rows, key=lambda r: r["bytes"])
    model, info = None, {}
    if data.get("model"):
        try:
            model = CostModel.from_dict(data["model"]["parameters"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"model parameters: {e}") from None
        info = {k: v for k, v in data["model"].items() if k != "parameters"}
    opts = data["options"]
    for name in ("chunk_bytes", "pipeline_depth"):
        if not isinstance(opts.get(name), int) or opts[name] < 1:
            raise bad(f"options.{name} must be a positive integer, got {opts.get(name)!r}")
    compression = data.get("compression") or {}
    for row in compression.get("entries", []) if isinstance(compression, dict) else [None]:
        times = row.get("by_method") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("bytes"), int) or not isinstance(times, dict) \
                or "none" not in times or not all(isinstance(v, (int, float)) and v > 0 for v in times.values()):
            raise bad("compression.entries: each entry needs an integer 'bytes' and a 'by_method' of positive "
                      "times including 'none'")
    return TuningTable(key=data["key"], options=opts, entries=entries, model=model, model_info=info,
                       kernels=data.get("kernels") or {}, measurements=data.get("measurements") or [],
                       peers=data.get("peers") or {}, compression=compression, created=str(data.get("created", "")),
                       path=path)


def _check_row(row, where: str, bad) -> None:
    if not isinstance(row, dict):
        raise bad(f"{where}: an entry is not an object")
    for name, kind in (("bytes", int), ("schedule", str), ("chunk_bytes", int), ("time_us", (int, float)),
                       ("by_schedule", dict)):
        if not isinstance(row.get(name), kind):
            raise bad(f"{where}: entry {row.get('bytes', '?')} B has no valid {name!r}")
    if row["bytes"] < 0 or row["chunk_bytes"] < 1 or not row["time_us"] > 0:
        raise bad(f"{where}: entry {row['bytes']} B has a negative size, a chunk < 1 or a time <= 0")
    if not all(isinstance(v, (int, float)) and v > 0 for v in row["by_schedule"].values()):
        raise bad(f"{where}: entry {row['bytes']} B has a non-positive time in by_schedule")


def drop_unknown_schedules(table: TuningTable) -> list[str]:
    """Remove entries (and per-schedule times) naming schedules this process does not know;
    returns the unknown names (the caller warns)."""
    known = set(schedules.names())
    unknown: set[str] = set()
    for by_dtype in table.entries.values():
        for dtype, rows in list(by_dtype.items()):
            kept = []
            for row in rows:
                unknown |= set(row["by_schedule"]) - known
                row["by_schedule"] = {s: t for s, t in row["by_schedule"].items() if s in known}
                if row["schedule"] in known:
                    kept.append(row)
                else:
                    unknown.add(row["schedule"])
            by_dtype[dtype] = kept
    return sorted(unknown)


# -- the key ---------------------------------------------------------------------------------
def machine_key(*, world_size: int, topology: str, transport: str, device: str = "cpu") -> dict:
    """The key a table measured here, now, would carry (see the module doc)."""
    import torch
    from mpi4py import MPI

    from .. import __version__

    inter = "mpi"
    intra = "mpi" if transport == "mpi" else ("nvshmem" if device == "cuda" else "shm")
    return {"world_size": world_size, "topology": topology, "transports": {"intra": intra, "inter": inter},
            "device": device, "cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "ddl_triton": __version__, "torch": torch.__version__.split("+")[0],
            "mpi": MPI.Get_library_version().strip().splitlines()[0].strip()}


def key_differences(table_key: dict, current: dict) -> list[str]:
    """Human-readable differences, e.g. ["world_size: table 4, here 2"]; empty when they match."""
    out = []
    for name in sorted(set(table_key) | set(current)):
        if table_key.get(name) != current.get(name):
            out.append(f"{name}: table {table_key.get(name)!r}, here {current.get(name)!r}")
    return out


def cache_dir(folder: str | None = None) -> Path:
    """The folder of cached tables: ``folder`` (a communicator's ``Options.tuning_dir``); None: the
    environment's (``Options.from_env().tuning_dir``, for callers without a communicator); "": the
    default under $XDG_CACHE_HOME (else ~/.cache)."""
    if folder is None:
        from ..options import Options
        folder = Options.from_env().tuning_dir
    if folder:
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddl_triton" / "tuning"


def cache_path(key: dict, folder: str | None = None) -> Path:
    """Where ``ddl-tune`` stores, and the runtime looks for, the table for ``key`` (``folder``: see
    ``cache_dir``)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(folder) / f"tuning-{key['world_size']}ranks-{key['topology']}-{digest}.json"


@dataclass(frozen=True)
class Resolved:
    """The outcome of ``resolve``: a table (or None), and what to say about it."""

    table: TuningTable | None
    source: str                 # "t.json", "<path>, from the cache", "" when none
    note: str                   # why there is no table, or what was dropped ("" when nothing to say)


def resolve(setting: str, key: dict, folder: str | None = None) -> Resolved:
    """Find the table for this communicator (see the module doc for the rules): ``setting`` is
    ``Options.tuning_file``, ``folder`` the cache (``Options.tuning_dir``; see ``cache_dir``). Warnings
    are returned in ``note`` and also issued with ``warnings.warn`` by the caller on one rank."""
    if setting.lower() in (OFF, "none", "0"):
        return Resolved(None, "", "")
    explicit = bool(setting)
    path = Path(setting) if explicit else cache_path(key, folder)
    if not explicit and not path.exists():
        return Resolved(None, "", "")
    try:
        table = load(path)
    except TuningTableError as e:
        if explicit:
            raise
        return Resolved(None, "", f"ignoring cached {e}")
    where = str(path) if explicit else f"{path}, from the cache"
    diffs = key_differences(table.key, key)
    if diffs:
        return Resolved(None, "", f"ignoring tuning table {path}: it was measured elsewhere ({'; '.join(diffs)})")
    unknown = drop_unknown_schedules(table)
    note = (f"tuning table {path}: dropped entries naming schedules not registered in this process: "
            f"{', '.join(unknown)}") if unknown else ""
    return Resolved(table, where, note)


def warn_once(message: str) -> None:
    """Warn (the communicator calls this on rank 0 only, so a job warns once). stacklevel 5
    points at the user's ``ddl_triton.init`` call."""
    if message:
        warnings.warn(f"ddl_triton: {message}", RuntimeWarning, stacklevel=5)


def _algos(value) -> tuple[str, ...] | None:
    return tuple(value) if value else None


def _evidence(times_us: dict, how: str, approx: str = "") -> str:
    ranked = sorted(times_us.items(), key=lambda kv: kv[1])
    return how + " " + ", ".join(f"{name} {approx}{t:.0f} us" for name, t in ranked)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
