"""The launcher's "a process of this job died" notice, as a flag that waits can read.

MPICH's hydra, run with ``-disable-auto-cleanup`` (as ``ddlrun`` runs it), tells the
surviving processes that a process ended without finalizing MPI by sending them SIGUSR1.
SIGUSR1's default action ends the process, which would turn one lost rank into a lost job
before anyone could say which rank was lost; ``install`` (called by ``ddl_triton.init``)
replaces that default with a handler that only records the time.

What the notice means to a wait (``base.wait_until``): a wait that has not completed half a
second after the notice gives up as a lost peer, instead of waiting out the whole deadline.
This is the only fast signal of a death on another node (over shared memory the exact
rank is found by its pid first). The cost: a communicator whose ranks are all alive, in a
job where some other process died, also stops waiting after half a second. Data-parallel
training cannot go on without a rank, so that is the behaviour wanted there.

What the notice does *not* mean: that a rank failed. Under ``-disable-auto-cleanup`` hydra
keeps every rank's PMI socket registered after ``PMI_Finalize`` (it deregisters it only
with auto-cleanup on), so a rank that exits cleanly closes a socket hydra still watches,
and hydra sends SIGUSR1 to every other rank of its node then too. MPI_Finalize is
collective (MPICH's waits for every rank), so such a notice can only reach a rank that has
itself entered MPI_Finalize, or a rank of a job whose peer left without finalizing (a
failure). Two consequences, both handled by ``ignore_from_now_on`` at exit:
- a notice that arrives once MPI is finalized says nothing about this rank's collectives;
- Python's interpreter teardown puts every signal it handles back to the default action
  before mpi4py's MPI_Finalize runs, and SIGUSR1's default action ends the process: a rank
  still tearing down when a faster rank exits would die of the notice (exit status 138
  under ``ddlrun``). An *ignored* disposition is left alone by the teardown.
"""
from __future__ import annotations

import signal
import threading
import time

_received_at: float | None = None


def _record(_signum, _frame) -> None:
    global _received_at
    if _received_at is None:
        _received_at = time.monotonic()


def install() -> bool:
    """Catch SIGUSR1 when nobody else does (its disposition is still the default);
    returns whether the handler is in place."""
    return install_if_default(signal.SIGUSR1, _record)


def install_if_default(signum: int, handler) -> bool:
    """Set ``handler`` for ``signum`` unless the application handles it itself (its
    disposition is not the default); returns whether ``handler`` is in place. Only the main
    thread may set handlers (elsewhere: False)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signum)
    if current is handler:
        return True
    if current is not signal.SIG_DFL:
        return False  # the application's own: leave it alone
    signal.signal(signum, handler)
    return True


def received_at() -> float | None:
    """``time.monotonic()`` of the first notice, or None."""
    return _received_at


def ignore_from_now_on() -> None:
    """Ignore SIGUSR1 for the rest of the process's life, if this module handles it.

    Called at interpreter exit (the exit guard in ``ddl_triton/__init__.py``), once the
    decision to finalize MPI or not has been taken: from then on a notice can change
    nothing, and under the default action it would kill a rank that exits cleanly while
    a faster peer's exit is being announced. An application's own SIGUSR1 handler is left
    in place. Only the main thread may set handlers (atexit runs there).
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR1) is _record:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


# -- revocation: "this communicator's world has failed", from the job itself --------------------------
# An elastic job (ddl_triton/elastic/membership.py) learns through its store that a rank somewhere
# failed. Every wait then gives up at its next liveness check, whatever it waits on (a survivor stuck
# on a survivor would otherwise wait out the whole deadline), as ncclCommRevoke makes NCCL's
# operations return. Unlike the launcher's notice this is cleared once a new world is built.
_revoked: tuple[float, str] | None = None
_revocable = False


def revoke(reason: str) -> None:
    """Make every wait of this process give up (the first reason is kept)."""
    global _revoked
    if _revoked is None:
        _revoked = (time.monotonic(), reason)


def revoked() -> tuple[float, str] | None:
    """(``time.monotonic()`` of the revocation, its reason), or None."""
    return _revoked


def clear_revocation() -> None:
    """The failed world is gone and a new one is being built: waits wait again."""
    global _revoked
    _revoked = None
    _gone.clear()


# Ranks of the current world whose process is known to have ended: a wait found its pid gone (same
# host), or gloo failed an operation with it otherwise than by a timeout (its sockets closed). An
# elastic job tells the others (ddl_triton/elastic/membership.py: they need not wait for its word).
_gone: set[int] = set()


def note_gone(rank: int) -> None:
    if rank >= 0:
        _gone.add(rank)


def gone() -> set[int]:
    """The ranks noted gone since the last ``clear_revocation``."""
    return set(_gone)


def set_revocable(on: bool) -> None:
    """Whether every wait of this process must be interruptible by ``revoke`` (an elastic job): the
    gloo transport then polls its receives instead of blocking in gloo (transports/gloo.py)."""
    global _revocable
    _revocable = bool(on)


def revocable() -> bool:
    return _revocable
