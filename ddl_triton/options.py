"""One typed options object; each field has a ``DDL_*`` environment twin read once at ``init``.

Every ``DDL_*`` variable anything of ddl_triton reads is known here: the twins of the fields, and
``OTHER_VARIABLES`` (each with its one reader). A ``DDL_*`` variable that is neither (the timeout's
twin misspelt, say) would be silently ignored: ``from_env`` warns about it instead, naming the
closest known one.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, fields

from . import compression_methods

_KIB = 1024
# The DDL_* variables read elsewhere than by this object, and who reads each (none else may exist:
# tests/unit/test_options.py checks every DDL_ name the repository reads against known_variables()).
OTHER_VARIABLES = {
    "DDL_ELASTIC_JOIN": "ddl_triton/elastic/world.py: 1 starts this process as a joiner of a running "
                        "elastic job (docs/elastic.md)",
}


@dataclass(frozen=True)
class Options:
    """Configuration of a communicator. Unknown names are rejected.

    Field (env twin)                      meaning
    timeout (DDL_TIMEOUT)                 seconds any single wait may last before CollectiveTimeout (default 300)
    chunk_bytes (DDL_CHUNK_BYTES)         bytes per pipelined chunk, which is also one shm slot (default 2 MiB)
    pipeline_depth (DDL_PIPELINE_DEPTH)   chunks in flight per rank = shm slots per rank (>= 2, default 4)
    wire_chunk_bytes (DDL_WIRE_CHUNK_BYTES)  the most bytes per chunk on a communicator with a peer reached
                                          over MPI or gloo (other hosts, or transport "mpi"): at most
                                          chunk_bytes, default 512 KiB. A smaller chunk lets the link carry
                                          one chunk while this rank reduces the previous: 2 MiB chunks left a
                                          1 Gbit/s link 3-7 points below its ceiling (docs/schedules.md)
    schedule (DDL_SCHEDULE)               force a schedule by registry name ("" = the cost model chooses)
    topology (DDL_TOPOLOGY)               "XxY[xZ]" grid overriding the detected one (emulates nodes)
    transport (DDL_TRANSPORT)             "auto": within a node shm (CPU tensors) or NVSHMEM (CUDA tensors,
                                          when nvshmem4py is installed), MPI between nodes; "mpi": MPI
                                          everywhere; "nvshmem": like auto, but a CUDA collective fails
                                          instead of falling back to MPI when NVSHMEM cannot be used.
                                          Ranks not launched by MPI (torchrun, mp.spawn: ddl_triton/
                                          bootstrap.py) use gloo wherever this says MPI
    mpi_cuda_aware (DDL_MPI_CUDA_AWARE)   hand CUDA buffers to MPI directly (only for an MPI built with
                                          CUDA support); default 0: stage them through pinned host memory
    kernels (DDL_KERNELS)                 "auto", "torch" or "triton" (see ddl_triton.kernels)
    check_calls (DDL_CHECK_CALLS)         compare every call's fingerprint across ranks first (default 1)
    status_dir (DDL_STATUS_DIR)           folder for per-rank status files (set by ddlrun; see status_files.py)
    tuning_file (DDL_TUNING_FILE)         a tuning table from ddl-tune; "" (default): the cached table whose
                                          key matches this machine, if any; "off": none (ddl_triton/planning/tuning_table.py)
    tuning_dir (DDL_TUNING_DIR)           the folder of cached tuning tables, where ddl-tune writes and init
                                          looks ("" (default): $XDG_CACHE_HOME/ddl_triton/tuning, else
                                          ~/.cache/ddl_triton/tuning)
    trace (DDL_TRACE)                     folder for a Chrome-trace timeline per rank (ddl_triton/observability/tracer.py);
                                          "" (default): no timeline
    flight_entries (DDL_FLIGHT_ENTRIES)   collectives the flight recorder keeps (ddl_triton/observability/flight.py; 2000)
    dump_dir (DDL_DUMP_DIR)               where flight-recorder dumps go ("": $TMPDIR/ddl_triton-flight-<uid>/<job id>)
    debug (DDL_DEBUG)                     print each call shape's plan and why, the transports per peer and the
                                          tuning table in use, on stderr (default 0)
    link_emulation (DDL_LINK_EMULATION)   a testing tool: "mpi:bw=1GB/s,lat=50us" makes MPI messages behave like
                                          a slower link (transports/link_emulation.py); "" (default): off
    compression (DDL_COMPRESSION)         lossy, so opt-in: the "ddl" process group's float allreduces of at least
                                          64 KiB (DDP's buckets) go fp32 over shm inside a host and compressed
                                          between hosts (ddl_triton/runtime/compression/per_level.py): a method of
                                          ddl_triton/compression_methods.py ("int8", "onebit", "fp16", "bf16",
                                          "int4"), or
                                          "auto" (per size, where it pays: ddl_triton/tuning/auto_compression.py);
                                          "none" (default): full precision everywhere
    link_probe (DDL_LINK_PROBE)           where ranks span hosts and no tuning table fits the cost model,
                                          measure the link between hosts at init (about 0.1 s) and plan
                                          with it (ddl_triton/runtime/setup/link_probe.py); default 1
    job_secret (DDL_JOB_SECRET)           the job's credential, at least 16 characters, never in the store
                                          nor on the wire: a process joins a running elastic job only by
                                          proving it holds it (ddl_triton/job_secret.py). ddlrun
                                          draws one for its ranks; under torchrun or env:// set the same
                                          value for every process. "" (default): no process may join
    """

    timeout: float = 300.0
    chunk_bytes: int = 2048 * _KIB
    pipeline_depth: int = 4
    wire_chunk_bytes: int = 512 * _KIB
    schedule: str = ""
    topology: str = ""
    transport: str = "auto"
    mpi_cuda_aware: bool = False
    kernels: str = "auto"
    check_calls: bool = True
    status_dir: str = ""
    tuning_file: str = ""
    tuning_dir: str = ""
    trace: str = ""
    flight_entries: int = 2000
    dump_dir: str = ""
    debug: bool = False
    link_emulation: str = ""
    compression: str = "none"
    link_probe: bool = True
    job_secret: str = dataclasses.field(default="", repr=False)  # a credential: never printed

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"Options.timeout must be > 0 seconds, got {self.timeout}")
        if self.chunk_bytes < 64 or self.chunk_bytes % 64:
            raise ValueError(f"Options.chunk_bytes must be a positive multiple of 64, got {self.chunk_bytes}")
        if self.wire_chunk_bytes < 64 or self.wire_chunk_bytes % 64:
            raise ValueError(f"Options.wire_chunk_bytes must be a positive multiple of 64, got {self.wire_chunk_bytes}")
        if self.pipeline_depth < 2:
            # depth 1 would make a step wait for its own slot's reader while holding its input.
            raise ValueError(f"Options.pipeline_depth must be >= 2, got {self.pipeline_depth}")
        if self.transport not in ("auto", "mpi", "nvshmem"):
            raise ValueError(f"Options.transport must be 'auto', 'mpi' or 'nvshmem', got {self.transport!r}")
        from .transports import link_emulation
        link_emulation.parse(self.link_emulation)  # a bad spec is refused here, at init, on every rank
        if self.flight_entries < 1:
            raise ValueError(f"Options.flight_entries must be >= 1, got {self.flight_entries}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"Options.kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}")
        compression_methods.check_choice(self.compression, "Options.compression (DDL_COMPRESSION)")
        if self.job_secret and len(self.job_secret) < 16:
            # the length only: an error message must not quote a credential
            raise ValueError(f"Options.job_secret (DDL_JOB_SECRET) must be at least 16 characters, got "
                             f"{len(self.job_secret)} (draw one: python -c 'import secrets; print(secrets.token_hex(32))')")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> "Options":
        """Defaults, then ``DDL_<FIELD>`` variables, then explicit ``overrides``; a ``DDL_*``
        variable ddl_triton does not read gets a warning naming the closest known one."""
        environ = os.environ if environ is None else environ
        _warn_unknown(environ)
        names = {f.name: f for f in fields(cls)}
        unknown = set(overrides) - set(names)
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; valid: {sorted(names)}")
        values = {}
        for name, f in names.items():
            raw = environ.get("DDL_" + name.upper())
            if raw is not None and raw != "":
                values[name] = _parse(name, f.type, raw)
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


def known_variables() -> list[str]:
    """Every DDL_* variable ddl_triton reads: the options' twins, then ``OTHER_VARIABLES``."""
    return ["DDL_" + f.name.upper() for f in fields(Options)] + list(OTHER_VARIABLES)


def _warn_unknown(environ) -> None:
    """A UserWarning for each DDL_* variable of ``environ`` that nothing reads (Python's warnings
    show each message once per process: init, the tuner and the kernels all read the options)."""
    known = known_variables()
    for name in sorted(n for n in environ if n.startswith("DDL_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "the variables it reads are listed in docs/options.md"
        # stacklevel 4: past from_env and init, at the line of the application that called ddl_triton.init
        warnings.warn(f"{name} is set, but ddl_triton reads no such variable (ignored): {hint}", UserWarning,
                      stacklevel=4)


def _parse(name: str, type_name, raw: str):
    kind = type_name if isinstance(type_name, str) else type_name.__name__
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"DDL_{name.upper()}={raw!r} is not a valid bool (use 1 or 0)")
    try:
        if kind == "int":
            return int(raw, 0)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"DDL_{name.upper()}={raw!r} is not a valid {kind}") from None
    return raw
