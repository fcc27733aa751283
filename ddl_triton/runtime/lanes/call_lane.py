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

Cost: n - 1 sends and receives per call at n ranks (the ``Iallgather`` took about log n
rounds): this lane is for the few ranks a host-crossing communicator of this stack has, not for
thousands.
"""
from __future__ import annotations

import atexit
import weakref

import numpy as np
from mpi4py import MPI

from ...errors import calls_disagree
from ...transports.mpi_retired import retire
from ...transports.waits import wait_until
from .fingerprint import describe as describe_call
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


def _close_at_exit() -> None:
    for wire in list(_OPEN_MPI_WIRES):
        wire.close()


class _MpiWire:
    """Lane messages on a communicator of their own (a duplicate: no other message can match),
    through persistent requests: a call restarts requests built once, which saves mpi4py's
    per-call argument handling (microseconds, on a path whose whole budget is a few tens)."""

    def __init__(self, comm, recv_bufs: dict, send_bufs: tuple):
        self.comm = comm.Dup()
        self._recvs = {p: self.comm.Recv_init([buf, MPI.BYTE], source=p, tag=0) for p, buf in recv_bufs.items()}
        self._recv_bufs, self._send_bufs = recv_bufs, send_bufs
        self._sends: dict[tuple[int, int], list] = {}  # (parity, message bytes) -> a request per peer
        global _exit_hook_installed
        _OPEN_MPI_WIRES.add(self)
        if not _exit_hook_installed:
            atexit.register(_close_at_exit)
            _exit_hook_installed = True

    def start_recv(self, peer: int) -> None:
        self._recvs[peer].Start()

    def wait_recv(self, peer: int, timeout: float, seq: int, spin: float) -> None:
        req = self._recvs[peer]
        if not req.Test():
            wait_until(req.Test, timeout, peer, _waiting_for(seq), spin=spin, prompt=True)

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

    def close(self) -> None:
        """Cancel the posted receives and let the last sends go, without waiting on any peer: the
        requests still active keep this lane's buffers alive until MPI is done with them
        (transports/mpi_retired.py: a slower peer may still be pulling the last message)."""
        _OPEN_MPI_WIRES.discard(self)
        if self.comm is None or MPI.Is_finalized():
            return
        for req in self._recvs.values():
            try:
                req.Cancel()
            except MPI.Exception:
                pass  # inactive: its message arrived and was not re-posted (a failed call)
        sends = [r for reqs in self._sends.values() for r in reqs]
        retire(list(self._recvs.values()) + sends, self._recv_bufs, self._send_bufs)
        self._recvs = {}
        self._sends.clear()
        self.comm.Free()  # local in MPICH; the retired requests complete on their own
        self.comm = None  # closed (by the communicator, or at exit: whichever comes first)


class CallLane:
    """The lane between ``rank`` and every other rank of ``size`` (see the module doc), over
    ``control``: an mpi4py communicator (duplicated: collective) or, for ranks a store
    bootstrapped, the lane's own TCP connections (lane_sockets.py)."""

    def __init__(self, control, rank: int, size: int, limit: int, timeout: float, spin: float, counter):
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
        self._sends: list = [None, None]  # per buffer parity, the sends still to complete
        self._heads_in: list = [None, None]  # per buffer parity, the header bytes object written there
        self._calls = 0

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
        for peer in peers:
            wire.wait_recv(peer, self.timeout, seq, self.spin)
            if self._recv_heads[peer] != head:
                matched = False
        if not matched:
            self._mismatch(seq, head)
        counter = self.counter
        counter.bytes_sent += nbytes * len(peers)
        counter.bytes_received += nbytes * len(peers)
        if not nbytes:
            self.done_reading()

    def done_reading(self) -> None:
        """Post the next receive from every peer (the last message's data may be overwritten)."""
        for peer in self.peers:
            self.wire.start_recv(peer)

    def _mismatch(self, seq: int, header: bytes) -> None:
        calls = {self.rank: _describe(header)}
        for peer in self.peers:
            calls[peer] = _describe(self._recv_heads[peer].tobytes())
        self.done_reading()  # the lane stays in step: every peer's message of this call was read
        raise calls_disagree(self.rank, seq, calls, self.size)

    def closed_peers(self) -> list[int]:
        """Peers whose lane connection is known closed (TCP lanes only; an MPI lane cannot tell)."""
        sockets = getattr(self.wire, "sockets", None)
        return sockets.closed_peers() if sockets is not None else []

    def close(self) -> None:
        self.wire.close()


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
