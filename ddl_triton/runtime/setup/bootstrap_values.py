"""The values ranks exchange at init: JSON, checked on arrival, never unpickled.

Semantics. Every bootstrap (bootstrap.py) carries JSON-able values only: ``None``, bools,
ints, floats, strings, lists and dicts with string keys. A value goes out as UTF-8 JSON and
comes back as JSON gives it back: a tuple returns as a list, a dict's keys as strings.
Arriving bytes that are not such a value (not UTF-8, not JSON, too large, too deeply nested)
raise ``BootstrapError`` naming where they came from (the store key, or the MPI step and
sender) and this rank; nothing in them is ever executed. ``shaped`` is the second check every
caller makes: the value has the shape that caller expects (``[str, int]``, say).

Why not pickle: the torch store is unauthenticated and any process that reaches its port can
write any key; an unpickled key runs that process's code on every rank. MPI between the ranks
of one ``mpiexec`` job is a trusted channel, but it gets the same encoding (``mpi_allgather``,
``mpi_bcast``: lengths, then bytes, through MPI's buffer collectives), so both bootstraps have
one contract, and a value that works under one launcher works under the other.

Every MPI collective here is nonblocking with a deadline (``mpi_wait``): a rank that failed
init, or never called it, makes the others raise ``BootstrapTimeout`` within ``timeout``
instead of hanging them. These are init-time calls; no collective's data path uses them.
"""
from __future__ import annotations

import json

import numpy as np

from ...errors import DDLError

MAX_VALUE_BYTES = 64 << 20  # the largest value accepted (a tuning table is well under 1 MiB)


class BootstrapError(DDLError):
    """The ranks could not complete a bootstrap step (the store became unreachable, a value
    that is not what the step expects arrived, say)."""


class BootstrapTimeout(BootstrapError):
    """A rank did not arrive at a bootstrap step within Options.timeout."""


def encode(obj) -> bytes:
    """``obj`` as compact UTF-8 JSON. TypeError for a value JSON cannot carry (a caller's bug)."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"ddl_triton bootstrap: only JSON-able values cross a bootstrap, not {obj!r:.200} ({e})") \
            from None


def decode(raw, where: str, rank: int):
    """The value in ``raw`` (bytes from a store or a peer); BootstrapError naming ``where``
    and ``rank`` when it is not JSON (see the module doc)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise BootstrapError(f"rank {rank}: ddl_triton bootstrap: {where} holds a {type(raw).__name__}, not bytes")
    if len(raw) > MAX_VALUE_BYTES:
        raise BootstrapError(f"rank {rank}: ddl_triton bootstrap: {where} holds {len(raw)} bytes, more than the "
                             f"{MAX_VALUE_BYTES} a bootstrap value may have")
    try:
        return json.loads(bytes(raw).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        head = bytes(raw[:24])
        raise BootstrapError(f"rank {rank}: ddl_triton bootstrap: {where} does not hold a JSON value (it starts "
                             f"{head!r}: {type(e).__name__}); something other than a rank of this job wrote "
                             "it (the store is reachable by any process on its network), or ranks of different "
                             "ddl_triton versions met") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def shaped(value, types: tuple, where: str, rank: int) -> list:
    """``value`` when it is a list of ``len(types)`` items, item i an instance of ``types[i]``
    (an int is never a bool); else BootstrapError naming ``where``, ``rank`` and the value."""
    if isinstance(value, list) and len(value) == len(types) and all(_is(v, t) for v, t in zip(value, types)):
        return value
    want = ", ".join(t.__name__ if isinstance(t, type) else "/".join(x.__name__ for x in t) for t in types)
    raise BootstrapError(f"rank {rank}: ddl_triton bootstrap: {where} holds {value!r:.200}, not the [{want}] "
                         "this step expects")


def checked(value, kind, where: str, rank: int):
    """``value`` when it is an instance of ``kind`` (an int is never a bool); else BootstrapError."""
    if _is(value, kind):
        return value
    name = kind.__name__ if isinstance(kind, type) else "/".join(x.__name__ for x in kind)
    raise BootstrapError(f"rank {rank}: ddl_triton bootstrap: {where} holds {value!r:.200}, not the {name} "
                         "this step expects")


def _is(value, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


# -- over MPI: lengths, then bytes, each a nonblocking collective with a deadline --------------------
def mpi_wait(request, timeout: float, what: str, rank: int, size: int, roll=None) -> None:
    """Wait for ``request`` (a nonblocking MPI collective over ``size`` ranks) at most
    ``timeout`` seconds; BootstrapTimeout past it, or soon after the launcher reports a lost
    process (transports/waits.py's ``wait_until``). ``roll``: (RollCall, the step's name, the
    same on every rank; roll_call.py), which answers peers meanwhile and, past the deadline,
    finds the ranks that did not arrive, for the error to name; without it the error names
    the step only (MPI cannot say who is missing from a collective)."""
    from ...transports.waits import PeerTimeout, wait_until

    call, step = roll if roll is not None else (None, "")
    ready = request.Test if call is None else (lambda: call.answer() or request.Test())
    if call is not None:
        call.waiting_in = step
    try:
        wait_until(ready, timeout, -1, what)
    except PeerTimeout as e:
        lost = " (the launcher reported that a process of this job died)" if e.dead else ""
        missing = call.missing(step, rank) if call is not None else None
        who = (f"rank(s) {', '.join(map(str, missing))} of {size} did not arrive" if missing else
               f"not every one of the {size} ranks arrived (MPI cannot tell which rank is missing from a collective)")
        raise BootstrapTimeout(
            f"rank {rank}: ddl_triton init ({what}) did not complete within {timeout:g} s{lost}: {who}. A rank that "
            "reported its own error (it failed init), never called ddl_triton.init, or is still busy elsewhere "
            "(DDL_TIMEOUT bounds each step of init)") from None
    finally:
        if call is not None:
            call.waiting_in = None


def mpi_allgather(comm, obj, timeout: float, what: str, roll=None) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order, over the mpi4py communicator ``comm``
    (``roll``: see ``mpi_wait``)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    data = encode(obj)
    lengths = np.zeros(size, dtype=np.int64)
    mpi_wait(comm.Iallgather(np.array([len(data)], dtype=np.int64), lengths), timeout, what, rank, size,
             _phase(roll, 1))
    for r, n in enumerate(lengths.tolist()):
        if not 0 <= n <= MAX_VALUE_BYTES:
            raise BootstrapError(f"rank {rank}: ddl_triton init ({what}): rank {r} announced a value of {n} bytes")
    counts = lengths.tolist()
    displs = [sum(counts[:r]) for r in range(size)]
    gathered = bytearray(sum(counts))
    mpi_wait(comm.Iallgatherv([data, len(data), MPI.BYTE], [gathered, counts, displs, MPI.BYTE]),
             timeout, what, rank, size, _phase(roll, 2))
    view = memoryview(gathered)
    return [decode(view[displs[r]:displs[r] + counts[r]], f"rank {r}'s value in {what}", rank) for r in range(size)]


def mpi_bcast(comm, obj, root: int, timeout: float, what: str, roll=None):
    """The ``root``'s ``obj`` (JSON-able) on every rank of ``comm``; other ranks' ``obj`` is ignored
    (``roll``: see ``mpi_wait``)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    data = encode(obj) if rank == root else b""
    length = np.array([len(data)], dtype=np.int64)
    mpi_wait(comm.Ibcast(length, root=root), timeout, what, rank, size, _phase(roll, 1))
    n = int(length[0])
    if not 0 <= n <= MAX_VALUE_BYTES:
        raise BootstrapError(f"rank {rank}: ddl_triton init ({what}): rank {root} announced a value of {n} bytes")
    buf = bytearray(data) if rank == root else bytearray(n)
    mpi_wait(comm.Ibcast([buf, n, MPI.BYTE], root=root), timeout, what, rank, size, _phase(roll, 2))
    return decode(buf, f"rank {root}'s value in {what}", rank)


def mpi_dup(comm, timeout: float, what: str):
    """A duplicate of the mpi4py communicator ``comm`` (MPI's nonblocking ``Idup``), made within
    ``timeout`` seconds: a rank that never joins makes the others raise BootstrapTimeout, where
    the blocking ``Dup`` would wait for ever."""
    dup, request = comm.Idup()
    mpi_wait(request, timeout, what, comm.Get_rank(), comm.Get_size())
    return dup


def mpi_members_meet(comm, members: list[int], timeout: float, what: str) -> None:
    """Return once every rank of ``members`` (ranks of the mpi4py communicator ``comm``, this one
    among them) has called this with the same members; BootstrapTimeout naming the ranks not
    heard from past ``timeout``. For a step that only the members enter and that MPI offers
    blocking only (``Create_group``: a member that never comes would hold the others for ever):
    once they have all met, it completes at once. One int64 to and from each other member, on
    ``comm`` (a communicator of its own: no application receive can take these messages)."""
    from mpi4py import MPI

    from ...transports.waits import PeerTimeout, wait_until

    me = comm.Get_rank()
    others = [m for m in members if m != me]
    token = np.array([len(members)], dtype=np.int64)
    got = {m: np.zeros(1, dtype=np.int64) for m in others}
    recvs = {m: comm.Irecv(got[m], source=m, tag=_MEET_TAG) for m in others}
    sends = [comm.Isend(token, dest=m, tag=_MEET_TAG) for m in others]
    try:
        wait_until(lambda: all(r.Test() for r in recvs.values()), timeout, -1, what)
    except PeerTimeout as e:
        missing = [m for m, r in recvs.items() if not r.Test()]
        for m in missing:  # MPI requires a cancelled request to be completed too (it returns at once)
            recvs[m].Cancel()
            recvs[m].Wait()
        lost = " (the launcher reported that a process of this job died)" if e.dead else ""
        raise BootstrapTimeout(f"rank {me}: {what} did not complete within {timeout:g} s{lost}: member rank(s) "
                               f"{', '.join(map(str, missing))} of {members} did not arrive (each member must "
                               "create the group; DDL_TIMEOUT bounds the wait)") from None
    MPI.Request.Waitall(sends)
    differ = sorted(m for m in others if int(got[m][0]) != len(members))
    if differ:
        raise BootstrapError(f"rank {me}: {what}: member rank(s) {', '.join(map(str, differ))} create a group of "
                             f"another size than {len(members)} ({members}) at the same point")


_MEET_TAG = 7  # the members' meeting's messages, on a communicator of their own


def mpi_barrier(comm, timeout: float, what: str, roll=None) -> None:
    """Return once every rank of ``comm`` has entered; BootstrapTimeout past ``timeout``."""
    mpi_wait(comm.Ibarrier(), timeout, what, comm.Get_rank(), comm.Get_size(), roll)


def _phase(roll, n: int):
    """``roll`` for phase ``n`` of a two-phase step (its own name: a rank may be in either)."""
    return None if roll is None else (roll[0], f"{roll[1]}/{n}")
