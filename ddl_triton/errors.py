"""Failures: the errors ddl_triton raises beyond ValueError/TypeError for bad input, how a dead
peer is told from a slow one, and the one wording of every timeout, lost peer and mismatch.

Semantics: a collective that passes its deadline or loses a peer raises ``CollectiveTimeout``;
ranks that call different collectives raise ``CollectiveMismatch``, and a rank waiting in a
collective that a peer left without issuing (finalize, close, a destroyed group, exit) raises its
subclass ``CollectiveSkipped``; one waiting in a collective that a peer ran, saw fail and then
left raises ``CollectiveTimeout`` at once (``peer_failed_there``). An elastic job (ddl_triton/
elastic/membership.py) recovers from a ``CollectiveTimeout`` by re-forming its world; what ends it
is ``PeersLost`` (too few survivors), ``ExcludedFromWorld`` (this rank came back too late) or
``CoordinatorLost`` (the store is gone). Every ``CollectiveTimeout``
text here reads the same way, whichever layer noticed the failure (the executor's step, the call
check, the barrier, the call lane's connections, the torch backend's point-to-point)::

    rank 0: allreduce #4 (schedule ring, step 'r1') timed out after 300 s; not heard from rank 2 on h2 (...)
    rank 0: allreduce #4 (schedule ring, step 'r1') failed: rank 2 on h2 died (...) before the 300 s deadline
    rank 0: rank 1 on h1 did not connect to the call lane within 300 s

that is: this rank, the call (and where in it), the deadline, the peer *and its host* (also on
one host: a log line read alone, or gathered from many hosts, says where), and what was awaited.
``name_peer`` is how a peer is named; ``process_alive`` is the one liveness check (shm's waits
and the naming of a wait on every rank at once both use it).

Why this module: it is the lowest of the package (the standard library only: no torch, no MPI,
no other ddl_triton module), so the transports, the runtime's rooms and the torch backend all
reach it without an import pointing up, and launch and observability could too at no cost. The
classes and their wording sit together, so a reader of a ``CollectiveTimeout`` finds here how
it was written. Wording happens only on failure: the callers keep a peer's rank and a short
"what" on their hot paths, and call a builder here once a wait has failed.
"""
from __future__ import annotations

import os
import socket
import sys
import time


class DDLError(RuntimeError):
    """Base class of ddl_triton's runtime failures."""


class CollectiveTimeout(DDLError):
    """A wait passed its deadline: a peer is slow, dead, or called a different collective.

    The communicator that raised it is poisoned: every later call raises at once,
    because the peers' state is unknown and a retry could pair mismatched messages.
    """


class CommunicatorPoisoned(DDLError):
    """A previous collective on this communicator failed; it cannot be used again."""


class PeersLost(CollectiveTimeout):
    """An elastic job lost ranks (dead, cut off or stopped past the deadline) and could not go on
    without them: the survivors are fewer than the job's ``min_size``. Names the ranks and hosts."""


class ExcludedFromWorld(DDLError):
    """This process came back (resumed from a stop, its link mended) after the other ranks of an
    elastic job had decided a new world without it. It must not touch the new world: it ends."""


class CoordinatorLost(DDLError):
    """An elastic job lost the store its ranks agree through (served by rank 0's process under
    env://, by torchrun's agent on the first host): the world cannot be re-formed without it."""


class CollectiveMismatch(DDLError):
    """Ranks called different collectives (or the same one with different arguments) as the
    same call in sequence. Raised on every rank, with what each rank called."""


class CollectiveSkipped(CollectiveMismatch):
    """A peer left the communicator (finalize, close, its process group destroyed, interpreter exit)
    without issuing the collective this rank waits in: what it did instead of that call. ``peer``
    is the rank that left, ``did`` what it did ("reached exit"), ``calls`` how many collectives it
    had issued on the communicator, ``failed`` whether the last of them failed."""

    def __init__(self, text: str, peer: int = -1, did: str = "", calls: int = 0, failed: bool = False):
        super().__init__(text)
        self.peer, self.did, self.calls, self.failed = peer, did, calls, failed


# -- liveness ------------------------------------------------------------------------------

def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A zombie (killed, its parent not yet
    told, as torchrun's agent is not at once) or a dying process ("X") has ended. Where /proc
    cannot say (not Linux, or a hidden /proc), ``os.kill(pid, 0)`` decides; a process of another
    user that exists counts as alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# -- naming a peer -------------------------------------------------------------------------

_RECHECKS, _RECHECK_SECONDS = 6, 0.05  # a failure path only: 0.3 s at most
_UNKNOWN = "(the wait was on all ranks at once: which one is unknown)"


def this_host() -> str:
    """This host's name, as errors give it."""
    return socket.gethostname()


def name_peer(placement, peer: int) -> str:
    """``peer`` as every error names it: "rank 2 on h2" (one host: "rank 2 on" this host's name).

    ``placement``: the communicator's ``Placement`` (its ``rank``, ``size``, ``host_of_rank``, and,
    across hosts, ``host_names`` and ``pids``). ``peer`` < 0 is a wait on every rank at once (an
    MPI or gloo collective, a barrier), which cannot say whose message is missing; what can be
    said is narrowed from this host: a rank of this host whose process has exited, else (every
    rank here alive) one of the ranks on the other hosts."""
    spans = len(set(placement.host_of_rank)) > 1
    if peer >= 0:
        return f"rank {peer} on {placement.host_names[peer] if spans else this_host()}"
    if not spans:
        return f"a rank on {this_host()} {_UNKNOWN}"
    rank, hosts = placement.rank, placement.host_of_rank
    here = [r for r in range(placement.size) if hosts[r] == hosts[rank] and r != rank]
    exited = [r for r in here if not process_alive(placement.pids[r])]
    for _ in range(_RECHECKS if here else 0):  # a peer that just died may still be closing its sockets
        if exited:
            break
        time.sleep(_RECHECK_SECONDS)
        exited = [r for r in here if not process_alive(placement.pids[r])]
    names = placement.host_names
    if exited:
        return (f"rank(s) {', '.join(map(str, exited))} on {names[rank]} (this host), whose "
                "process has exited (the wait was on all ranks at once)")
    elsewhere: dict[str, list[int]] = {}
    for r in range(placement.size):
        if hosts[r] != hosts[rank]:
            elsewhere.setdefault(names[r], []).append(r)
    return ("a rank on another host, one of " + "; ".join(f"rank(s) {', '.join(map(str, rs))} on {h}"
                                                           for h, rs in elsewhere.items())
            + f" (the wait was on all ranks at once, and every rank on {names[rank]} is alive)")


def _named(peer: int, name) -> str:
    """``name(peer)`` (a Placement's ``describe``), or the rank alone where no placement is known."""
    if name is not None:
        return name(peer)
    return f"rank {peer} (host unknown)" if peer >= 0 else f"a rank {_UNKNOWN}"


# -- the builders --------------------------------------------------------------------------

def call_name(collective: str, seq: int, schedule: str | None = None, step: str | None = None) -> str:
    """A call as errors name it: "allreduce #4", with where in it when known:
    "allreduce #4 (schedule ring, step 'r1')"."""
    where = f" (schedule {schedule}, step {step!r})" if schedule is not None else ""
    return f"{collective} #{seq}{where}"


def peer_failed(rank: int, call: str, peer: int, what: str, timeout: float, name=None,
                dead: bool = False) -> CollectiveTimeout:
    """The error of ``call`` (``call_name``) whose wait for ``peer`` on ``what`` failed: the peer's
    process is gone (``dead``), or nothing came from it within ``timeout`` seconds. ``name``:
    peer -> its name with its host (``Placement.describe``)."""
    who = _named(peer, name)
    if dead:
        return CollectiveTimeout(f"rank {rank}: {call} failed: {who} died ({what}) before the {timeout:g} s deadline")
    return CollectiveTimeout(f"rank {rank}: {call} timed out after {timeout:g} s; not heard from {who} ({what})")


def wait_failed(rank: int, call: str, e, timeout: float, name=None) -> CollectiveTimeout:
    """``peer_failed`` for a transport's ``PeerTimeout`` ``e`` (its peer, what it waited on, and
    whether the peer is known dead)."""
    return peer_failed(rank, call, e.peer, e.what, timeout, name, e.dead)


def engine_failed(rank: int, call: str, peer: int, engine: str, report: str, timeout: float,
                  name=None) -> DDLError:
    """``call`` failed inside another engine (``engine``: "gloo"), which bounds its own waits by
    ``timeout`` and said ``report``; ``peer``: the rank it was exchanging with (-1: several)."""
    return DDLError(f"rank {rank}: {call} failed (with {_named(peer, name)}, within the {timeout:g} s deadline): "
                    f"{engine} reported: {report}")


def did_not_arrive(rank: int, peer: int, what: str, timeout: float, name=None,
                   detail: str = "") -> CollectiveTimeout:
    """A peer that did not take its part in setting something up (``what``: "connect to the call
    lane") within ``timeout`` seconds; ``detail``: what else is known (a refused connection)."""
    return CollectiveTimeout(f"rank {rank}: {_named(peer, name)} did not {what} within {timeout:g} s{detail}")


def did_not_finish(rank: int, what: str, timeout: float) -> CollectiveTimeout:
    """Work of this rank's own (``what``: "the call lane's accepting thread") still under way past
    the deadline, with no one peer to blame."""
    return CollectiveTimeout(f"rank {rank}: {what} did not finish within {timeout:g} s")


def calls_disagree(rank: int, seq: int, calls: dict[int, str], size: int) -> CollectiveMismatch:
    """Ranks that made different calls as collective ``seq``: ``calls`` maps each rank to what it
    called, as far as known (a rank missing from it has not reached this call yet)."""
    listing = "; ".join(f"rank {r}: {calls.get(r, '(has not reached this call yet)')}" for r in range(size))
    return CollectiveMismatch(f"rank {rank}: ranks disagree on collective #{seq}: {listing}")


def peer_left(rank: int, call: str, peer: int, did: str, calls: int, failed: bool = False,
              name=None) -> CollectiveSkipped:
    """``peer`` left the communicator (``did``: "reached exit", "called finalize", ...) after ``calls``
    collectives (the last of which ``failed``) while this rank waits in ``call`` ("allreduce #6"),
    which the peer will never run: the error every rank waiting in it raises, within its next
    check, not at the deadline."""
    last = ", the last of which failed" if failed else ""
    return CollectiveSkipped(f"rank {rank}: {_named(peer, name)} {did} while rank {rank} waits in {call} (rank "
                             f"{peer} had issued {calls} collective{'' if calls == 1 else 's'} on this communicator"
                             f"{last})", peer, did, calls, failed)


def peer_failed_there(rank: int, call: str, peer: int, did: str, calls: int, name=None) -> CollectiveTimeout:
    """``peer`` ran ``call`` ("allreduce #6") too, saw it fail, and left (``did``: "reached exit")
    while this rank still waits in it: the call is lost here as well, at once, not at the deadline.
    A ``CollectiveTimeout`` (a lost peer), not ``CollectiveSkipped``: the peer did issue the call.
    Its own error names the cause; the waits name a cause they can see (a dead process on this
    host, the launcher's notice) before this one, which is only a consequence."""
    return CollectiveTimeout(f"rank {rank}: {call} failed: {_named(peer, name)} {did} after the same call failed "
                             f"there (rank {peer} had issued {calls} collective{'' if calls == 1 else 's'} on this "
                             f"communicator; its own error names the cause)")


def queue_stuck(owner: str, running: str, queued: int, timeout: float) -> CollectiveTimeout:
    """A queue of issued calls where none finished for ``timeout`` seconds (a call's own waits are
    bounded by the same deadline, so such a queue is stuck, not slow)."""
    return CollectiveTimeout(f"{owner}: {running} still running, {queued} more queued, and no call finished "
                             f"for {timeout:g} s (the communicator's timeout) while waiting for them to finish")


# -- said first ----------------------------------------------------------------------------

def say_first(error: BaseException, where: str) -> None:
    """Write ``error``'s one-line cause on stderr now (once per error object), because where it goes
    next puts it last: a collective's error inside ``jax.jit`` or ``tf.function`` reaches the user as
    the framework's own error, the cause the last of ~15-50 lines of its trace (and JAX logs that
    trace first); an elastic job's end comes under torch's C++ warnings. ``where``: what follows it,
    e.g. "inside jax.jit: JAX's report of it follows"."""
    if getattr(error, "_ddl_said_first", False):
        return
    try:
        error._ddl_said_first = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: said each time it passes
        pass
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    first = next(iter(str(error).splitlines()), "")
    print(f"{name}: {first} [{where}]", file=sys.stderr, flush=True)
