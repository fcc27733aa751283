"""Which ranks are missing from an MPI bootstrap step that did not complete: a roll call.

Semantics. MPI cannot say who is missing from a collective that never completes. A roll call
asks: a rank whose wait in a bootstrap step (``step``, a name every rank of the bootstrap gives
the same step) passes its deadline tells every other rank of the bootstrap that it gave up
there, asks each whether it is waiting in that step too, and collects answers for
``_GRACE_SECONDS``. A rank answers while it waits in a bootstrap step (``answer``, called at
every check of the wait). Ranks that answered yes, or said they gave up there, arrived; the
others did not (they failed init, never called it, or are busy elsewhere), and the error names
them.

The messages travel on a communicator of their own (``comm``, duplicated with the bootstrap's),
so they never meet a bootstrap collective, a transport's message or the application's. A
bootstrap made by ``split`` asks through its root bootstrap's communicator, naming its members
by their ranks there. Nothing of this runs on a step that completes, except one ``Iprobe`` per
check of the wait: the cost is paid on the error path.
"""
from __future__ import annotations

import time

_GAVE_UP, _ASK, _ANSWER = 11, 12, 13  # tags on the roll call's own communicator
_GRACE_SECONDS = 1.0  # how long a rank that gave up collects answers (peers answer at each check of their wait)
_MAX_STEP_BYTES = 4096


class RollCall:
    """The roll call of one bootstrap: ``comm`` is the root bootstrap's own communicator for it,
    ``members[r]`` the rank there of this bootstrap's rank ``r``."""

    def __init__(self, comm, members: list[int]):
        self.comm = comm
        self.members = members
        self.waiting_in: str | None = None  # the step this rank waits in now, if any
        self._gave_up: set[tuple[int, str]] = set()  # (root rank, step) that said they gave up
        self._sends: list = []  # (request, buffer) in flight: never waited for, the error path ends init

    def for_members(self, ranks: list[int]) -> "RollCall":
        """The roll call of a sub-bootstrap whose rank ``i`` is this bootstrap's rank ``ranks[i]``."""
        return RollCall(self.comm, [self.members[r] for r in ranks])

    def answer(self) -> None:
        """Answer the peers that ask, and note those that gave up (at each check of a wait)."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            source, tag = status.Get_source(), status.Get_tag()
            self._serve(source, tag, self._receive(source, tag, status))

    def _serve(self, source: int, tag: int, step: str) -> None:
        """A peer's question (``_ASK``: is this rank waiting in ``step``?) answered, or its giving up noted."""
        if tag == _ASK:
            self._send(bytes([1 if step == self.waiting_in else 0]), source, _ANSWER)
        elif tag == _GAVE_UP:
            self._gave_up.add((source, step))

    def missing(self, step: str, me: int) -> list[int]:
        """After this rank's wait in ``step`` passed its deadline: the ranks of this bootstrap
        that are not at ``step`` (see the module doc)."""
        from mpi4py import MPI

        name = step.encode()
        others = [r for r in range(len(self.members)) if r != me]
        for r in others:
            self._send(name, self.members[r], _GAVE_UP)
            self._send(name, self.members[r], _ASK)
        here: set[int] = set()
        answered: set[int] = set()
        status = MPI.Status()
        deadline = time.monotonic() + _GRACE_SECONDS
        root_of = {self.members[r]: r for r in others}
        while len(answered) < len(others) and time.monotonic() < deadline:
            if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                time.sleep(0.001)
                continue
            source, tag = status.Get_source(), status.Get_tag()
            payload = self._receive(source, tag, status)
            if tag == _ANSWER and source in root_of:
                answered.add(root_of[source])
                if payload == "\x01":
                    here.add(root_of[source])
            else:
                self._serve(source, tag, payload)
        here |= {root_of[s] for s, at in self._gave_up if at == step and s in root_of}
        return [r for r in others if r not in here]

    def _receive(self, source: int, tag: int, status) -> str:
        from mpi4py import MPI

        n = min(status.Get_count(MPI.BYTE), _MAX_STEP_BYTES)
        buf = bytearray(max(n, 1))
        self.comm.Recv([buf, n, MPI.BYTE], source=source, tag=tag)
        return bytes(buf[:n]).decode("utf-8", "replace")

    def _send(self, data: bytes, dest: int, tag: int) -> None:
        from mpi4py import MPI

        self._sends.append((self.comm.Isend([data, len(data), MPI.BYTE], dest=dest, tag=tag), data))
