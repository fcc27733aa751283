"""The flight recorder: the last N collectives of this process, always on, dumped when it matters.

Semantics: every collective a communicator issues gets a ``Record`` at issue time, kept in
a bounded ring (``Options.flight_entries`` / ``DDL_FLIGHT_ENTRIES``, default 2,000, shared
by every communicator of the process; the oldest records fall off). A record holds

    seq, collective, fingerprint text ("allreduce(sum, 1000 x float32)"), bytes, the
    schedule once planned, state (issued -> started -> done | failed), the label of the
    step reached, the wait in progress when the dump was taken, timestamps (issue, start,
    end; seconds since the epoch) and the Python call site (the first frame outside
    ddl_triton and torch, e.g. "train.py:88").

A record of a collective that failed because a peer left without issuing it (``CollectiveSkipped``)
also keeps who left and how (``left``: rank, what it did, after how many calls).

``dump`` writes every communicator's records, and this rank's identity and job id, to
``<dump_dir>/flight-rank<R>.json``: a new file of mode 0600 renamed onto that name, so a link
planted there is replaced, never written through (ddl_triton/_private_files.py). ``dump_dir`` is
``Options.dump_dir`` (``DDL_DUMP_DIR``; created 0700 if missing, else used as the user made it)
or by default ``$TMPDIR/ddl_triton-flight-<uid>/<job id>``: a folder per job (the id every rank of
the job agreed on at init: ddl_triton/runtime/setup/job_id.py), so dumps of different jobs never
mix, inside a folder per user. Both must be this user's own directories, not links and writable by
nobody else: otherwise a fresh ``mkdtemp`` folder is used, and named on stderr as well as in the
path ``dump`` returns. The communicator dumps on ``CollectiveTimeout`` and
``CollectiveMismatch``; ``SIGUSR2`` dumps at once (``ddlrun`` sends it to every rank when a
rank is lost, and passes on a SIGUSR2 it receives). ``python -m ddl_triton.trace why DIR``
reads the dumps (ddl_triton/observability/diagnose.py).

Cost: one small object, one deque append and one jump up the Python stack per call (about
1 us; bench/results/observability.md), and an attribute store per executed step. The call
site's line is looked up only when a record is shown.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque

from .._private_files import chosen_folder, private_folder, write_private_file

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddl_triton/, above observability/
_SKIP = (_PACKAGE_DIR, os.path.dirname(_PACKAGE_DIR) + os.sep + "transports",
         os.path.dirname(_PACKAGE_DIR) + os.sep + "schedules")


def _torch_dir() -> str:
    """torch's folder, found without importing torch (observability needs neither torch nor MPI)."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    return os.path.dirname(os.path.abspath(spec.origin)) if spec is not None and spec.origin else "<no torch>"


class Record:
    """One collective, as the flight recorder keeps it (see the module doc). ``call`` is
    (collective, op, input numel, dtype, root), formatted only when dumped."""

    __slots__ = ("comm", "seq", "call", "schedule", "state", "step", "t_issue", "t_start", "t_end", "site", "error",
                 "waiting", "left")

    def __init__(self, comm: int, seq: int, call: tuple, site):
        self.comm, self.seq, self.call, self.site = comm, seq, call, site
        self.schedule = self.step = self.error = ""
        self.state = "issued"
        self.t_issue = time.time()
        self.t_start = self.t_end = 0.0
        self.waiting = None
        self.left = None  # {"rank", "did", "calls", "failed"}: the peer that left without issuing this call

    @property
    def collective(self) -> str:
        return self.call[0]

    def to_json(self) -> dict:
        collective, _, numel, dtype, _ = self.call
        where = site_of(self.site)
        site = f"{os.path.basename(where[0])}:{where[1]}" if where else "?"
        return {"comm": self.comm, "seq": self.seq, "collective": collective, "call": describe(self.call),
                "bytes": numel * dtype.itemsize if dtype is not None else 0,
                "dtype": str(dtype).replace("torch.", "") if dtype is not None else "", "schedule": self.schedule,
                "state": self.state, "step": self.step, "t_issue": self.t_issue, "t_start": self.t_start,
                "t_end": self.t_end, "site": site, "error": self.error, "waiting": self.waiting, "left": self.left}


def site_of(site) -> tuple[str, int] | None:
    """(file, line) of a record's call site, kept as (code object, instruction offset): the line
    is looked up only here, when a record is shown, because finding it costs a scan of the code's
    line table on every call (about 3 us for a script's top level, the cost of the whole call)."""
    if site is None:
        return None
    code, offset = site
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return code.co_filename, line
    return code.co_filename, code.co_firstlineno


def describe(call: tuple) -> str:
    """ "allreduce(sum, 1000 x float32)", "broadcast(root 0, 10 x int64)", "barrier" for a record's call."""
    collective, op, numel, dtype, root = call
    if dtype is None:
        return collective
    args = [op] if op else []
    if root is not None:
        args.append(f"root {root}")
    args.append(f"{numel} x {str(dtype).replace('torch.', '')}")
    return f"{collective}({', '.join(args)})"


# How far above FlightRecorder._call_site the public entry's caller is: _call_site (0), issue (1),
# the IssuePath method that records the call (2), the Communicator method the user called (3).
# The walk goes on upwards past frames of ddl_triton and torch (the torch backend's wrappers).
_ENTRY_CALLER_DEPTH = 4


class FlightRecorder:
    """The process's ring of records, and its dumps."""

    def __init__(self, capacity: int = 2000):
        self.records: deque[Record] = deque(maxlen=max(1, capacity))
        self.rank = -1
        self.size = 0
        self.dump_dir = ""  # the user's folder; "" for the default (see default_dump_dir)
        self.job = ""  # the job's id, agreed by every rank at init ("" until a world communicator exists)
        self._lock = threading.RLock()  # SIGUSR2's dump may interrupt a dump on the same thread
        self._skip = _SKIP + (_torch_dir(),)
        self._ours: dict = {}  # id(code object) -> (the code object, whether it is ddl_triton's or torch's)
        self.dumped: list[str] = []

    def configure(self, *, rank: int, size: int, capacity: int, dump_dir: str, job: str = "") -> None:
        """Called by the world communicator's init: who this rank is, its job, and where dumps go."""
        self.rank, self.size = rank, size
        self.dump_dir = dump_dir
        self.job = job or self.job
        if capacity != self.records.maxlen:
            self.records = deque(self.records, maxlen=max(1, capacity))

    def issue(self, comm: int, seq: int, call: tuple) -> Record:
        """A new record for a collective being issued now (``call``: see ``Record``)."""
        record = Record(comm, seq, call, self._call_site(_ENTRY_CALLER_DEPTH))
        self.records.append(record)
        return record

    def _call_site(self, depth: int):
        """The first caller outside ddl_triton and torch, at or above the frame ``depth`` levels up
        from here, as (code object, instruction offset): ``site_of`` turns it into (file, line) when
        a record is shown. Whether a code object is ours is remembered (this runs on every call)."""
        try:
            # sys._getframe(depth) jumps there without building a frame object for each frame
            # between; each f_back below builds one (about 0.45 us each, measured).
            frame = sys._getframe(depth)
        except ValueError:  # no Python frame that deep (a call from C with nothing above it)
            return None
        ours = self._ours
        while frame is not None:
            code = frame.f_code
            # Keyed by identity: a code object hashes its whole body, constants and nested code
            # included (~10 us for a module's top level, which a script's loop runs in). The
            # entry holds the code object, so its id is not reused while the entry exists.
            known = ours.get(id(code))
            if known is None or known[0] is not code:
                known = ours[id(code)] = (code, code.co_filename.startswith(self._skip))
            if not known[1]:
                return code, frame.f_lasti
            frame = frame.f_back
        return None

    def dump(self, reason: str) -> str:
        """Write ``flight-rank<R>.json`` (see the module doc); returns its path ("" if it
        could not be written: a dump must never turn one failure into two)."""
        with self._lock:
            waiting = _current_wait()
            records = list(self.records)
            rows = [r.to_json() for r in records]
            for r, row in zip(records, rows):
                if r.state == "started" and waiting is not None:
                    row["waiting"] = waiting
            data = {"format": "ddl_triton-flight", "version": 1, "rank": self.rank, "size": self.size,
                    "job": self.job, "pid": os.getpid(), "host": os.uname().nodename, "time": time.time(),
                    "reason": reason, "capacity": self.records.maxlen, "records": rows}
            try:
                folder = chosen_folder(self.dump_dir) if self.dump_dir else self._job_folder()
                path = os.path.join(folder, f"flight-rank{self.rank}.json")
                write_private_file(path, json.dumps(data, indent=1))
            except OSError:
                return ""
            self.dumped.append(path)
            return path

    def _job_folder(self) -> str:
        """The default dump folder: this job's folder (``job_folder_name``) inside this user's
        (``default_dump_dir``), each private (a refused one is replaced by a fresh private folder)."""
        what = f"rank {self.rank}: flight-recorder dumps"
        return private_folder(os.path.join(private_folder(default_dump_dir(), what=what), job_folder_name(self.job)),
                              what=what)

    def install_sigusr2(self) -> bool:
        """Dump on SIGUSR2 when nobody else handles it (main thread only)."""
        from ..transports.failure_notice import install_if_default
        return install_if_default(signal.SIGUSR2, _on_sigusr2)


def _current_wait(wait=None):
    from ..transports import waits
    wait = wait or waits.current_wait
    if wait is None:
        return None
    peer, what, since = wait
    return {"peer": peer, "what": what, "since": since}


def stuck_wait():
    """The wait that last gave up (for the record of a collective that timed out)."""
    from ..transports import waits
    return _current_wait(waits.last_stuck) if waits.last_stuck else None


def default_dump_dir() -> str:
    """``$DDL_DUMP_DIR`` is read into Options at init; without it dumps go to a folder per job in
    this one, per user (when both are private: see the module doc)."""
    return os.path.join(tempfile.gettempdir(), f"ddl_triton-flight-{os.getuid()}")


def job_folder_name(job: str) -> str:
    """The name of a job's dump folder inside ``default_dump_dir``: its id; a process that dumps
    before any communicator spanning its job agreed on one has a folder of its own."""
    return job or f"no-job-id-{os.uname().nodename}-{os.getpid()}"


RECORDER = FlightRecorder()


def _on_sigusr2(_signum, _frame) -> None:
    path = RECORDER.dump("SIGUSR2")
    print(f"ddl_triton: rank {RECORDER.rank}: flight recorder dumped to {path or '(could not write)'}",
          file=sys.stderr, flush=True)
