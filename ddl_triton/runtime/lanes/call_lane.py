"""The call lane: one message per peer per collective across two-sided links (over MPI, or its own TCP),
carrying the call's fingerprint and, for a small allreduce, its data.

Semantics: at every collective the call checker runs (call_check.py), each rank sends each
peer exactly one lane message and receives exactly one from each peer, in call order. A
message is a 16-byte header, the call's fingerprint (fingerprint.py's ``encode``: 6 integers) and
the byte count of the data that follows, encoded exactly (``header``), then that data (none for
a call check alone, the tensor for a small allreduce: ``small_allreduce_two_sided.py``). The
header is short because the message is: MPICH sends a message of a few tens of bytes in one
packet without its rendezvous, and an 8-byte allreduce's whole message is 24 bytes. A rank whose peer's header
differs from its own raises ``CollectiveMismatch`` listing every rank's call, on every rank;
a peer silent past the deadline is a ``PeerTimeout`` naming it.

So the call check rides in the small allreduce's data message across hosts, the way it rides
in the flag word on shm (small_allreduce.py): no round trip of its own. A general-path call
sends the header alone, which is one message each way, as the ``Iallgather`` it replaces was,
but one that a small-path call on a mismatched peer also receives, so a rank on the small path
and a rank on the general path find each other's call and raise, instead of both waiting
for a message the other will never send.

Why no message waits in an unexpected queue: each peer's receive is posted ahead, into a
buffer of its own, as soon as the previous lane message from that peer has been read.
Why two send buffers suffice: a rank reuses the buffer of call k in call k + 2, after it
received every peer's message of call k + 1, which each peer sent only after it had received
our message of call k (it finished call k first). The old send is complete by then; the lane
completes its request anyway, as MPI requires, which returns at once.

**Farewells.** A rank that leaves the communicator (farewell.py: finalize, close, a destroyed
group, exit) sends each peer one last lane message, a header that is its farewell (collective code
15: how it left and after how many calls), where its next call's header would be. A peer waiting
for that message raises ``CollectiveSkipped`` naming the leaver, at once; one waiting for another
peer's message looks at the others' every quarter second (MPI). A farewell after the same call
failed on the leaver is a consequence (``CollectiveTimeout``: farewell.py). No farewell may end up in an
unexpected queue of a freed communicator, whose context id MPI could hand to a later one and match
there: a rank says farewell only to a peer whose message of its last call it has read, and never
after the peer's own farewell; and its close leaves a receive posted for every message a peer may
still send (one past its last call; MPI frees a communicator only once its pending operations
complete), cancelled at interpreter exit. Over TCP a stream's unread bytes die with it, so there it
says farewell to every peer that has not left.

Cost: n - 1 sends and receives per call at n ranks (the ``Iallgather`` took about log n
rounds): this lane is for the few ranks a host-crossing communicator of this stack has, not for
thousands.
"""
from __future__ import annotations

import atexit
import weakref

import numpy as np
from mpi4py import MPI

from ...errors import call_name, calls_disagree
from ...transports import failure_notice
from ...transports.mpi_retired import retire, sweep
from ...transports.waits import PeerTimeout, wait_until
from .farewell import Farewell, decoded, doomed, most_telling
from .fingerprint import CALLS, describe as describe_call
from .lane_sockets import LaneSockets, SocketWire

HEADER_BYTES = 16  # two int64 words: see header()
_BOUND = 256       # cached send requests before the cache starts over
_ROOT_BITS = 24    # word 0: collective (4 bits), op + 1 (4), dtype + 1 (5), on CUDA (1), root (24), data bytes (26)
_DATA_SHIFT = 38


def header(fingerprint: tuple[int, ...], nbytes: int) -> bytes:
    """The 16 header bytes of a call's lane message: ``fingerprint`` (collective, op, dtype, element
    count, root, on CUDA: fingerprint.py's encode) and the data's byte count, exactly (word 1 is the
    element count)."""
    coll, op, dtype, numel, root, on_gpu = fingerprint
    if not (0 <= root < 1 << _ROOT_BITS and 0 <= nbytes < 1 << (63 - _DATA_SHIFT)):
        raise ValueError(f"call lane: root {root} or {nbytes} data bytes out of the header's range")
    word = coll | (op + 1) << 4 | (dtype + 1) << 8 | on_gpu << 13 | root << 14 | nbytes << _DATA_SHIFT
    return np.array([word, numel], dtype=np.int64).tobytes()


_FAREWELL_CODE = 15  # word 0's collective field of a farewell (fingerprint.CALLS has 6 collectives)


def farewell_header(said: Farewell) -> bytes:
    """The 16 header bytes of a farewell: code 15, how the rank left (bits 4-7), whether its last call
    failed (bit 8), and in word 1 how many calls it had issued. No data follows."""
    word = _FAREWELL_CODE | int(said.how) << 4 | int(said.failed) << 8
    return np.array([word, said.calls], dtype=np.int64).tobytes()


def _farewell_of(raw) -> Farewell | None:
    """The farewell a header (bytes or a buffer of 16) states, or None for a call's header."""
    word, calls = (int(v) for v in np.frombuffer(raw, dtype=np.int64, count=2))
    if word & 15 != _FAREWELL_CODE or word >> 9:
        return None
    return decoded(word >> 4 & 15, calls, bool(word >> 8 & 1))


def _data_bytes(head) -> int:
    """The data byte count a header (bytes or a buffer of 16) announces."""
    return int(np.frombuffer(head, dtype=np.int64, count=1)[0]) >> _DATA_SHIFT


def _decode(raw: bytes) -> tuple[tuple[int, ...], int]:
    """(fingerprint, data bytes) of a header."""
    word, numel = (int(v) for v in np.frombuffer(raw, dtype=np.int64))
    fingerprint = (word & 15, (word >> 4 & 15) - 1, (word >> 8 & 31) - 1, numel,
                   word >> 14 & ((1 << _ROOT_BITS) - 1), word >> 13 & 1)
    return fingerprint, word >> _DATA_SHIFT


# MPI lanes still open, closed at exit before mpi4py finalizes MPI (atexit runs last-registered
# first, and mpi4py registered its finalize when it was imported): a receive still posted at
# MPI_Finalize makes UCX warn about every one, for a communicator its program never closed.
_OPEN_MPI_WIRES: "weakref.WeakSet[_MpiWire]" = weakref.WeakSet()
_exit_hook_installed = False
# Receives a lane left posted when it closed with a farewell, for the messages peers may still send
# (module doc); those still active at exit are cancelled, as an open lane's are.
_LEFT_POSTED: list = []


def _close_at_exit() -> None:
    for wire in list(_OPEN_MPI_WIRES):
        wire.close()
    if not MPI.Is_finalized():
        for req in _LEFT_POSTED:
            try:
                if req and not req.Test():
                    req.Cancel()
            except MPI.Exception:
                pass
        sweep()  # completes the cancelled receives and frees them
    _LEFT_POSTED.clear()


class _MpiWire:
    """Lane messages on a communicator of their own (a duplicate: no other message can match),
    through persistent requests: a call restarts requests built once, which saves mpi4py's
    per-call argument handling (microseconds, on a path whose whole budget is a few tens)."""

    drops_unread = False  # a message no receive takes waits in MPI's unexpected queue (module doc)

    def __init__(self, comm, recv_bufs: dict, send_bufs: tuple):
        self.comm = comm.Dup()
        self._recvs = {p: self.comm.Recv_init([buf, MPI.BYTE], source=p, tag=0) for p, buf in recv_bufs.items()}
        self._recv_bufs, self._send_bufs = recv_bufs, send_bufs
        self._sends: dict[tuple[int, int], list] = {}  # (parity, message bytes) -> a request per peer
        self._farewells = None  # (requests, buffer) of the farewell sent, if any
        self.meanwhile = None   # (peer, seq) -> None, run in long waits; may raise (CallLane sets it)
        global _exit_hook_installed
        _OPEN_MPI_WIRES.add(self)
        if not _exit_hook_installed:
            atexit.register(_close_at_exit)
            _exit_hook_installed = True

    def start_recv(self, peer: int) -> None:
        self._recvs[peer].Start()

    def wait_recv(self, peer: int, timeout: float, seq: int, spin: float) -> None:
        """Until ``peer``'s posted message is in; ``meanwhile(peer, seq)``, when set, runs every
        quarter second of a long wait (the lane looks for other peers' farewells there) and may raise."""
        req = self._recvs[peer]
        if not req.Test():
            meanwhile = self.meanwhile
            alive = None if meanwhile is None else (lambda: meanwhile(peer, seq) or True)
            wait_until(req.Test, timeout, peer, _waiting_for(seq), spin=spin, prompt=True, alive=alive)

    def arrived(self, peer: int) -> bool:
        """Whether ``peer``'s posted receive holds its message (without waiting)."""
        return bool(self._recvs[peer].Test())

    def start_sends(self, parity: int, nbytes: int, peers: tuple[int, ...]):
        reqs = self._sends.get((parity, nbytes))
        if reqs is None:
            if len(self._sends) > _BOUND:
                self._free_sends()
            mem = self._send_bufs[parity][:nbytes]
            reqs = self._sends[(parity, nbytes)] = [self.comm.Send_init([mem, MPI.BYTE], dest=p, tag=0) for p in peers]
        # One Start per request, not Startall: mpi4py converts Startall's and Testall's list on
        # every call, 0.6-0.8 us each (measured), more than a loop over the few peers costs.
        for req in reqs:
            req.Start()
        return reqs

    def complete_sends(self, reqs, timeout: float, peers: tuple[int, ...]) -> None:
        for peer, req in zip(peers, reqs):
            if not req.Test():
                wait_until(req.Test, timeout, peer, "call lane send completion", spin=0.0, prompt=True)

    def _free_sends(self) -> None:
        # The lane completes a buffer's sends before reusing it (CallLane.claim_send_buffer), under its
        # deadline; here the requests are only let go, once done (never blocking on a peer).
        retire([r for reqs in self._sends.values() for r in reqs], self._send_bufs)
        self._sends.clear()

    def send_farewell(self, peers, head: bytes) -> None:
        """Send ``head`` (a farewell) to each of ``peers``; its requests are retired at ``close``."""
        buf = np.frombuffer(head, dtype=np.uint8).copy()
        self._farewells = [self.comm.Isend([buf, MPI.BYTE], dest=p, tag=0) for p in peers], buf

    def close(self, expect: dict[int, int] | None = None) -> None:
        """Let the last sends go and end the lane without waiting on any peer: the requests still
        active keep this lane's buffers alive until MPI is done with them (transports/mpi_retired.py:
        a slower peer may still be pulling the last message). Without ``expect`` the posted receives
        are cancelled; with it (peer -> how many more messages it may send, after the one its posted
        receive awaits, if any: a farewell's close) they stay posted, more are posted as counted, and
        all complete as those messages arrive (cancelled at exit if they never do)."""
        _OPEN_MPI_WIRES.discard(self)
        if self.comm is None or MPI.Is_finalized():
            return
        recvs, buffers = list(self._recvs.values()), [self._recv_bufs, self._send_bufs]
        if expect is None:
            for req in recvs:
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass  # inactive: its message arrived and was not re-posted (a failed call)
        else:
            size = len(next(iter(self._recv_bufs.values())))
            for peer, more in expect.items():
                for _ in range(more):
                    buf = np.empty(size, dtype=np.uint8)
                    recvs.append(self.comm.Irecv([buf, MPI.BYTE], source=peer, tag=0))
                    buffers.append(buf)
            _LEFT_POSTED[:] = [r for r in _LEFT_POSTED if r] + recvs  # freed ones (null) go
        sends = [r for reqs in self._sends.values() for r in reqs]
        if self._farewells is not None:
            sends += self._farewells[0]
            buffers.append(self._farewells[1])
        retire(recvs + sends, *buffers)
        self._recvs = {}
        self._sends.clear()
        self.comm.Free()  # local in MPICH; the retired requests complete on their own
        self.comm = None  # closed (by the communicator, or at exit: whichever comes first)


class CallLane:
    """The lane between ``rank`` and every other rank of ``size`` (see the module doc), over
    ``control``: an mpi4py communicator (duplicated: collective) or, for ranks a store
    bootstrapped, the lane's own TCP connections (lane_sockets.py)."""

    def __init__(self, control, rank: int, size: int, limit: int, timeout: float, spin: float, counter,
                 describe=None):
        self.rank = rank
        self.size = size
        self.limit = limit  # the most data bytes one message carries
        self.timeout = timeout
        self.spin = spin  # seconds a wait spins before yielding (the transport's: 0 on a crowded host)
        self.counter = counter  # the transport whose bytes_sent / bytes_received count the data (not the headers)
        self.peers = tuple(p for p in range(size) if p != rank)
        self._recv_bufs = {p: np.zeros(HEADER_BYTES + limit, dtype=np.uint8) for p in self.peers}
        self._send_bufs = tuple(np.zeros(HEADER_BYTES + limit, dtype=np.uint8) for _ in (0, 1))
        self._recv_heads = {p: memoryview(buf)[:HEADER_BYTES] for p, buf in self._recv_bufs.items()}
        self._send_heads = tuple(memoryview(buf)[:HEADER_BYTES] for buf in self._send_bufs)
        if isinstance(control, LaneSockets):
            self.wire = SocketWire(control, self._recv_bufs, self._send_bufs, HEADER_BYTES, _data_bytes)
        else:
            self.wire = _MpiWire(control, self._recv_bufs, self._send_bufs)
        for p in self.peers:
            self.wire.start_recv(p)
        self.wire.meanwhile = self._farewell_elsewhere
        self.describe = describe  # peer -> how an error names it, with its host (Placement.describe), or None
        self._sends: list = [None, None]  # per buffer parity, the sends still to complete
        self._heads_in: list = [None, None]  # per buffer parity, the header bytes object written there
        self._calls = 0
        # Kept only once an exchange failed part-way (the lane is then out of step; see close): peers
        # whose message of call ``_calls`` is unread, and peers read but whose next receive is not posted.
        self._broken = False
        self._unread: set[int] = set()
        self._unposted: set[int] = set()
        self._ended: dict[int, Farewell] = {}  # peers whose farewell was read: they send nothing more
        self._closed = False

    def data_view(self, peer: int | None, parity: int, nbytes: int) -> np.ndarray:
        """Where a message's data lies: ``peer``'s receive buffer, or (None) this rank's send
        buffer of ``parity``; stable for the lane's life, so a caller may keep typed views."""
        buf = self._send_bufs[parity] if peer is None else self._recv_bufs[peer]
        return buf[HEADER_BYTES:HEADER_BYTES + nbytes]

    def claim_send_buffer(self) -> int:
        """The parity of the send buffer the next ``exchange`` sends from, once the sends that last
        used it (call k - 2's: complete, see the module doc) are finished, so its data may go in."""
        parity = (self._calls + 1) & 1
        old = self._sends[parity]
        if old is not None:
            self.wire.complete_sends(old, self.timeout, self.peers)
            self._sends[parity] = None
        return parity

    def exchange(self, seq: int, head: bytes, nbytes: int = 0) -> None:
        """Send this call's message (``head``: ``header(fingerprint, nbytes)``, then the ``nbytes``
        of data the caller put in ``data_view(None, claim_send_buffer(), nbytes)``) to every peer
        and wait for each peer's; raise CollectiveMismatch if any peer's call differs. The peers' data
        stays readable in their ``data_view`` until ``done_reading``; a call without data needs no
        ``done_reading``."""
        peers = self.peers
        if not peers:
            return
        parity = self.claim_send_buffer() if not nbytes else (self._calls + 1) & 1  # with data: claimed
        self._calls += 1
        wire = self.wire
        if self._heads_in[parity] is not head:  # a repeated call shape sends the same header object
            self._send_heads[parity][:] = head
            self._heads_in[parity] = head
        self._sends[parity] = wire.start_sends(parity, HEADER_BYTES + nbytes, peers)
        matched = True
        try:
            for peer in peers:
                wire.wait_recv(peer, self.timeout, seq, self.spin)
                if self._recv_heads[peer] != head:
                    matched = False
                    said = _farewell_of(self._recv_heads[peer])
                    if said is not None:  # it left instead: say so now, not after the slower peers
                        self._ended[peer] = said
                        self._left(seq)
        except BaseException:
            self._broke_at(peer)
            raise
        if not matched:
            self._mismatch(seq, head)
        counter = self.counter
        counter.bytes_sent += nbytes * len(peers)
        counter.bytes_received += nbytes * len(peers)
        if not nbytes:
            self.done_reading()

    def done_reading(self) -> None:
        """Post the next receive from every peer (the last message's data may be overwritten)."""
        if not self._broken:
            for peer in self.peers:
                self.wire.start_recv(peer)
            return
        for peer in sorted(self._unposted):  # after a failed exchange: only where a message was read
            self.wire.start_recv(peer)
        self._unposted = set()

    def _mismatch(self, seq: int, header: bytes) -> None:
        calls = {self.rank: _describe(header)}
        for peer in self.peers:
            calls[peer] = _describe(self._recv_heads[peer].tobytes())
        self.done_reading()  # the lane stays in step: every peer's message of this call was read
        raise calls_disagree(self.rank, seq, calls, self.size)

    def _broke_at(self, peer: int) -> None:
        """An exchange ended with an error while reading ``peer``'s message: note which peers' messages
        were read (those before it, and any farewell read meanwhile) for ``done_reading`` and ``close``."""
        at = self.peers.index(peer)
        read = set(self.peers[:at])
        self._broken = True
        self._unread = {p for p in self.peers[at:] if p not in self._ended}
        self._unposted = read - set(self._ended)

    def _farewell_elsewhere(self, waiting_for: int, seq: int) -> None:
        """In a long wait for ``waiting_for``'s message: raise ``CollectiveSkipped`` if a peer still to
        be read in this exchange already sent its farewell (it left; waiting_for may be merely slow)."""
        peers = self.peers
        for peer in peers[peers.index(waiting_for) + 1:]:
            if peer not in self._ended and self.wire.arrived(peer):
                said = _farewell_of(self._recv_heads[peer])
                if said is not None:
                    self._ended[peer] = said
        if self._ended:
            self._left(seq)

    def _left(self, seq: int) -> None:
        """Raise for call ``seq`` (farewell.doomed), naming the peer that left before issuing it, or that
        left after it failed there (farewell.most_telling of the farewells read)."""
        cause = most_telling(self._ended, seq)
        if cause is None:  # farewells of peers that ran this call, then left (cannot be: they sent its header)
            cause = min(self._ended.items())
        peer, said = cause
        if not said.skipped(seq):  # a consequence: first what this rank can see of the cause (farewell.py)
            gone = [p for p in self.closed_peers() if p not in self._ended]
            if gone:
                raise PeerTimeout(gone[0], "the call lane (its connection closed)", dead=True)
            if failure_notice.received_at() is not None:
                raise PeerTimeout(-1, f"the call lane message of call #{seq} (the launcher reported that a "
                                      "process of this job died)", dead=True)
        own = _decode(self._send_heads[self._calls & 1].tobytes())[0][0]
        call = call_name(CALLS[own] if own < len(CALLS) else "a collective", seq)
        raise doomed(self.rank, call, seq, peer, said, self.describe)

    def closed_peers(self) -> list[int]:
        """Peers whose lane connection is known closed (TCP lanes only; an MPI lane cannot tell)."""
        sockets = getattr(self.wire, "sockets", None)
        return sockets.closed_peers() if sockets is not None else []

    def close(self, said: Farewell | None = None) -> None:
        """End the lane. With ``said`` (this rank's farewell: farewell.py), send it first, as the last
        message to every peer that may still read it (the module doc: over MPI, a peer whose message
        of our last call we read, and that has not left), and leave a receive posted for whatever each
        peer may still send, until it arrives. Without, cancel the posted receives."""
        if self._closed:
            return
        self._closed = True
        wire = self.wire
        if said is None:
            wire.close()
            return
        unread, unposted = (set(self._unread), set(self._unposted)) if self._broken else (set(), set())
        for peer in self.peers:  # what has arrived unread counts as read (a farewell: the peer left)
            if peer not in self._ended and peer not in unposted and wire.arrived(peer):
                arrived = _farewell_of(self._recv_heads[peer])
                if arrived is not None:
                    self._ended[peer] = arrived
                elif peer in unread:  # its message of our last call: now read
                    unread.discard(peer)
                    unposted.add(peer)
        to = [p for p in self.peers if p not in self._ended and (p not in unread or wire.drops_unread)]
        if to:
            try:
                wire.send_farewell(to, farewell_header(said))
            except Exception:  # noqa: BLE001 - a peer already gone: nothing more to tell it
                pass
        # A peer may send up to one message past our last call's: receives for those not yet read.
        expect = {p: (2 if p in unread else 1) - (0 if p in unposted else 1) for p in self.peers if p not in self._ended}
        wire.close(expect)


def _waiting_for(seq: int) -> str:
    """What a lane wait waits for, as a timeout names it (formatted only when a wait is needed:
    about 0.15 us, on a path whose whole Python budget is a few microseconds)."""
    return f"call lane message of call #{seq}"


def _describe(raw: bytes) -> str:
    fingerprint, nbytes = _decode(raw)
    call = describe_call(fingerprint)
    if nbytes:
        call += " (small-message path)"
    if "#" in call:  # a field no rank encodes: bytes that are no header of ours, shown as they came
        call += f" [header bytes {raw.hex()}]"
    return call
