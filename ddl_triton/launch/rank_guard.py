"""The parent of one rank under ``ddlrun``: it turns a rank's death by a signal into an
ordinary non-zero exit, and records which rank died.

Usage (``ddlrun`` writes this; nobody types it)::

    mpiexec -disable-auto-cleanup -n N python .../ddl_triton/launch/rank_guard.py COMMAND [ARGS...]

Why it exists: MPICH's hydra proxy SIGKILLs every process of the job as soon as one of its
children ends *by a signal*, whatever ``-disable-auto-cleanup`` says (``pmip.c``: the
``WIFSIGNALED`` branch after ``waitpid``). A rank that is SIGKILLed would therefore take the
survivors with it before they can notice the loss, report it and exit on their own. With
this guard between hydra and the rank, hydra's child (the guard) exits normally with
``128 + signal``, so hydra only notifies the survivors (SIGUSR1, which ``ddl_triton.init``
catches) and the survivors' own deadlines and liveness checks do the rest.

Semantics:
- The rank runs as a child in the guard's process group, inheriting every descriptor
  (hydra's PMI connection is one) and the environment. If the guard itself dies, the kernel
  SIGKILLs the rank (``PR_SET_PDEATHSIG``), so no rank outlives its guard.
- Signals sent to the process group (Ctrl-C, hydra's signals) reach the rank directly; the
  guard ignores SIGINT and SIGUSR1 and passes SIGTERM on (a SIGTERM sent to the guard's
  pid alone must still stop the rank).
- Exit status: the rank's own; ``128 + N`` when the rank was killed by signal N, after
  writing ``rank<r>.killed`` (pid and signal name) into ``DDL_STATUS_DIR`` and one line on
  stderr naming the rank, its pid and the signal. The status is also written there as
  ``rank<r>.returncode``.
- Heartbeat: while the rank runs, the guard rewrites ``rank<r>.alive`` every second, so that
  ddlrun can tell a rank whose host is gone (its guard fell silent) from one still working.
- Relay: at each beat, a ``rank<r>.signal`` file naming SIGUSR2 (ddlrun's request for a rank it
  cannot signal itself, as one on another host) is removed and the signal passed to the rank.
- Across hosts, a guard whose rank exited 0 outlasts the job: it waits until every rank of the
  job has recorded its end, then ``_OUTLAST_MARGIN_S`` more (at most ``_OUTLAST_CAP_S`` in all).

Why a guard outlasts the job across hosts: under ``-disable-auto-cleanup`` hydra treats every
rank's exit, clean or not, as "a process ended" (``pmip_cb.c``: the PMI socket closes while it
is still registered) and mpiexec passes SIGUSR1 to every *other* host's proxy
(``pmiserv_cb.c``). A proxy ends as soon as its last rank does; when mpiexec writes to one
that has just ended it gets EPIPE and exits 255, killing the ranks of the other hosts that are
still tearing down (a flake of the slow-link fault test, 1 run in 4). So each guard closes its
copy of hydra's PMI socket the moment its rank ends (the notice goes out then, not when the
guard exits) and keeps its proxy alive until no notice can still be on its way.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_HEARTBEAT_SECONDS = 1.0  # status_files.py's SILENT_SECONDS must be several of these
_OUTLAST_MARGIN_S = 1.0   # after the last rank's end, for hydra to pass its notice to every proxy
_OUTLAST_CAP_S = 30.0     # a rank that exited 0 never waits longer than this for the others


def _rank_from_environment() -> int:
    """This rank's number as the launcher set it (MPICH: PMI_RANK; Open MPI; PMIx)."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return -1


def _prepare_child() -> None:
    """In the child, before exec: undo the guard's ignored signals (an ignored disposition
    survives exec) and be SIGKILLed when the guard dies (Linux only; else skipped)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_status = None


def _status_module():
    """ddl_triton/status_files.py, loaded from its file: the guard imports no package (it runs
    below each MPICH rank before any import)."""
    global _status
    if _status is None:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "status_files.py")
        spec = importlib.util.spec_from_file_location("_ddl_status", path)
        _status = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_status)
    return _status


def _record(rank: int, event: str, text: str) -> None:
    """Write ``rank<r>.<event>`` into DDL_STATUS_DIR with status_files.py's writer."""
    folder = os.environ.get("DDL_STATUS_DIR", "")
    if folder:
        _status_module().record(folder, rank, event, text)


def _wait_beating(child: subprocess.Popen, rank: int) -> int:
    """Wait for the rank, rewriting ``rank<r>.alive`` every ``HEARTBEAT_SECONDS`` meanwhile: a
    guard that stops (its host died, or its link to the shared folder was cut) is how ddlrun
    tells a rank that is gone from one that is only slow (supervision.py). Each beat also passes
    on a signal ddlrun asked for (``_relay_signal``)."""
    folder = os.environ.get("DDL_STATUS_DIR", "")
    while True:
        if folder:
            _record(rank, "alive", "")
            _relay_signal(folder, rank, child)
        try:
            return child.wait(_HEARTBEAT_SECONDS if folder else None)
        except subprocess.TimeoutExpired:
            pass


_RELAYED = {"SIGUSR2"}  # dump the flight recorder: the only signal ddlrun asks a guard to pass on


def _relay_signal(folder: str, rank: int, child: subprocess.Popen) -> None:
    """Pass on the signal ddlrun asked for in ``rank<r>.signal`` (status.request_signal) to this
    guard's own rank, which it started and has not reaped (so the pid cannot be another
    process's): how ddlrun reaches a rank on another host without using a pid from there.
    Anything but a name in ``_RELAYED`` is dropped."""
    path = os.path.join(folder, f"rank{rank}.signal")
    try:
        with open(path) as f:
            name = f.read(16).strip()
        os.unlink(path)
    except OSError:
        return
    if name in _RELAYED:
        child.send_signal(getattr(signal, name))  # a no-op once the rank has ended


def _close_pmi_socket() -> None:
    """Close the guard's copy of hydra's PMI socket (``PMI_FD``): the rank's copy closed when it
    ended, so hydra learns of the end now. Under ``PMI_PORT`` the guard holds no copy."""
    fd = os.environ.get("PMI_FD", "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def _outlast_the_job() -> None:
    """When the job's ranks recorded more than one host, wait until each rank has recorded its
    end (``status.settle``), then ``_OUTLAST_MARGIN_S`` more; never longer than ``_OUTLAST_CAP_S``
    in all, and not at all once the status folder is gone (ddlrun has ended)."""
    folder = os.environ.get("DDL_STATUS_DIR", "")
    size = os.environ.get("PMI_SIZE", "")
    if not folder or not size.isdigit():
        return
    status, ranks = _status_module(), int(size)
    deadline = time.monotonic() + _OUTLAST_CAP_S
    try:
        if len({events.get("host") for events in status.read(folder).values()} - {None}) < 2:
            return  # one host, one proxy: hydra notifies no other
        records = status.settle(folder, ranks, patience=_OUTLAST_CAP_S)
        if status.ended(folder, records) >= set(range(ranks)):
            time.sleep(min(_OUTLAST_MARGIN_S, max(0.0, deadline - time.monotonic())))
    except OSError:
        return


def _record_kill(rank: int, pid: int, signum: int) -> None:
    name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
    _record(rank, "killed", f"{pid} {name}")
    # SIGUSR1 is hydra's notice that another process of the job ended; ddl_triton.init
    # catches it and the exit guard ignores it, so only a rank outside that window dies of it.
    why = (" (MPICH's notice that another process of the job ended; ranks survive it from ddl_triton.init on)"
           if signum == signal.SIGUSR1 else "")
    print(f"ddlrun: rank {rank} (pid {pid}) was killed by {name}{why}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if not argv:
        print(f"usage: python {__file__} COMMAND [ARGS...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the rank gets the group's Ctrl-C and decides
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's "a process died" notice is for the rank
    try:
        # close_fds=False: the rank needs hydra's PMI descriptor (PMI_FD) and any others.
        child = subprocess.Popen(argv, close_fds=False, preexec_fn=_prepare_child)
    except OSError as e:
        print(f"ddlrun: rank {_rank_from_environment()}: cannot start {argv[0]!r}: {e}", file=sys.stderr)
        return 127
    signal.signal(signal.SIGTERM, lambda s, _f: child.poll() is None and child.send_signal(s))
    rank = _rank_from_environment()
    status = _wait_beating(child, rank)
    _close_pmi_socket()
    if status < 0:
        _record_kill(rank, child.pid, -status)
        status = 128 - status
    _record(rank, "returncode", str(status))
    if status == 0:
        _outlast_the_job()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
