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
    returns whether the handler is in place. Only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGUSR1)
    if current is _record:
        return True
    if current is not signal.SIG_DFL:
        return False  # the application handles SIGUSR1 itself: leave it alone
    signal.signal(signal.SIGUSR1, _record)
    return True


def received_at() -> float | None:
    """``time.monotonic()`` of the first notice, or None."""
    return _received_at
