"""MPI requests still active when their owner closes: kept alive with their buffers, never freed under MPI.

Semantics: MPI reads a send's buffer, and writes a receive's, until the request completes; freeing
the request (``MPI_Request_free``) does not stop the transfer, it only stops anyone from knowing when
it ends. A transport or lane that closes hands its requests here with every buffer they point into
(``retire``). Each is tested at once: a finished one is freed and its buffers let go; one still
active is kept, buffers and all, in a list this module holds, and tested again at every later
``retire`` and at ``sweep``. So a closed communicator's memory is never reused while MPI may still
touch it, and close never waits on a peer (a dead peer's send never completes: its few buffers stay
for the life of the process).

Why: a lane closed right after its last small broadcast freed its 64 KiB send buffer while a slower
peer was still pulling the message (MPICH moves a message that large by rendezvous, from the
sender's memory, when the receiver arrives): under load the peer received heap pointers where the
header should be, and raised a CollectiveMismatch naming garbage (tests/multirank, 2x2 matrix).
"""
from __future__ import annotations

from mpi4py import MPI

_kept: list[tuple[list, tuple]] = []  # (requests still active, the buffers they point into)


def retire(requests, *buffers) -> None:
    """Free ``requests`` once complete; until then keep them and ``buffers`` alive (see the module doc).
    Persistent requests (``Send_init``, ``Recv_init``) count as complete when inactive."""
    sweep()
    requests = [r for r in requests if r]  # MPI.REQUEST_NULL is false: nothing to wait for
    if requests and not _settled(requests):
        _kept.append((requests, buffers))


def sweep() -> int:
    """Free the kept requests that completed since; return how many are still active."""
    _kept[:] = [(reqs, bufs) for reqs, bufs in _kept if not _settled(reqs)]
    return sum(1 for reqs, _ in _kept for req in reqs if req)


def _settled(requests: list) -> bool:
    """Test every request (which also moves MPI's progress); free those complete. True when none
    is left active. After MPI_Finalize nothing completes: everything stays kept."""
    if MPI.Is_finalized():
        return False
    done = True
    for req in requests:
        if not req:
            continue
        try:
            if not req.Test():
                done = False
                continue
            if req:  # a persistent request stays allocated after it completes
                req.Free()
        except MPI.Exception:
            done = False  # an erroneous request (a failed peer): keep its buffers rather than guess
    return done
