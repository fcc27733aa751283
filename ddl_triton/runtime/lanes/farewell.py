"""A rank's farewell: what it says to its peers when it leaves a communicator, so that none waits for it.

Semantics: a rank leaves a communicator once, by one of the ways ``Leaving`` names (``finalize``,
``close``, destroying the torch process group over it, or reaching interpreter exit with it still
open), and then says so to every peer: how it left, how many collectives it had issued on the
communicator (``calls``), and whether the last of them failed. A peer waiting in collective ``seq``
that the leaver will never run (``Farewell.dooms``: a later call than its last, or the call that
failed there) raises at once (``doomed``): ``CollectiveSkipped`` naming the leaver and what it did
instead of the call,

    rank 0: rank 1 on h1 reached exit while rank 0 waits in allreduce #6 (rank 1 had issued 5 collectives ...)

or, for a leaver whose own call ``seq`` failed (a consequence of a failure elsewhere, not a skip),
``CollectiveTimeout`` (``errors.peer_failed_there``); the waits first name a cause they can see
themselves (a process on this host that died without a farewell, the launcher's notice),
so that every survivor of a killed rank names the killed rank, whichever survivor gave up first,

instead of waiting out the deadline (300 s by default) for a rank that is already at exit.

Where it travels: over shm, one word of the leaver's segment header (``shm_word``; the call check
reads its peers' words in its long waits, call_check.py); across two-sided links, as the last
message of the call lane to each peer, in place of a call's header (call_lane.py). Both readers
decode with ``decoded``, which accepts only what a leaver writes (anything else: None).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ...errors import DDLError, peer_failed_there, peer_left


class Leaving(enum.IntEnum):
    """How a rank left a communicator (the value is what crosses the wire: 4 bits)."""

    CLOSED = 1            # Communicator.close()
    FINALIZED = 2         # ddl_triton.finalize()
    DESTROYED_GROUP = 3   # torch.distributed.destroy_process_group() (the "ddl" group's shutdown)
    EXIT = 4              # interpreter exit with the communicator still open

    @property
    def words(self) -> str:
        """What the rank did, as an error says it ("rank 1 on h1 reached exit while ...")."""
        return _WORDS[self]


_WORDS = {Leaving.CLOSED: "closed its communicator", Leaving.FINALIZED: "called finalize",
          Leaving.DESTROYED_GROUP: "destroyed its process group", Leaving.EXIT: "reached exit"}
_FAILED_BIT = 1 << 7
_CALLS_SHIFT = 8


@dataclass(frozen=True)
class Farewell:
    """One rank's farewell: ``how`` it left, after ``calls`` collectives, the last ``failed`` or not."""

    how: Leaving
    calls: int
    failed: bool = False

    def dooms(self, seq: int) -> bool:
        """Whether a peer waiting in collective ``seq`` waits for nothing: the leaver never issued
        it, or it failed there (it will never send what that call still needs from it)."""
        return seq > self.calls or (self.failed and seq == self.calls)

    def skipped(self, seq: int) -> bool:
        """Whether the leaver never issued collective ``seq`` (else it ran it, and ``dooms``
        only because it failed there)."""
        return seq > self.calls

    def shm_word(self) -> int:
        """The farewell as one nonzero int64 (a segment header's farewell word; 0 means "still here")."""
        return self.calls << _CALLS_SHIFT | (_FAILED_BIT if self.failed else 0) | int(self.how)


def decoded(how: int, calls: int, failed: bool) -> Farewell | None:
    """The farewell these fields state, or None when they are not one (a value no leaver writes)."""
    if calls < 0 or how not in _WORDS.keys():
        return None
    return Farewell(Leaving(how), calls, bool(failed))


def from_shm_word(word: int) -> Farewell | None:
    """The farewell in a segment header's word, or None (0: the rank has not left)."""
    if word <= 0:
        return None
    return decoded(word & 15, word >> _CALLS_SHIFT, word & _FAILED_BIT)


def most_telling(farewells: dict[int, Farewell], seq: int) -> tuple[int, Farewell] | None:
    """Of the peers' farewells (rank -> farewell), the one that dooms call ``seq`` and names its cause:
    the rank that issued the fewest collectives (the one that skipped it; a rank whose own call
    ``seq`` failed and which then left is a consequence), the lowest rank among equals."""
    doomed = [(f.calls, rank, f) for rank, f in farewells.items() if f.dooms(seq)]
    if not doomed:
        return None
    _, rank, farewell = min(doomed, key=lambda t: (t[0], t[1]))
    return rank, farewell


def doomed(rank: int, call: str, seq: int, peer: int, said: Farewell, name=None) -> DDLError:
    """The error of a rank waiting in ``call`` (number ``seq``) that ``peer``'s farewell ``said`` dooms:
    ``CollectiveSkipped`` when the peer never issued it, ``CollectiveTimeout`` when it failed there."""
    if said.skipped(seq):
        return peer_left(rank, call, peer, said.how.words, said.calls, said.failed, name)
    return peer_failed_there(rank, call, peer, said.how.words, said.calls, name)
