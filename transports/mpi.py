"""MPI transport: two-sided messages through mpi4py's buffer methods (Isend/Irecv).

Only the uppercase buffer interface is used on the data path: no pickling, no
copies beyond the staging buffer. Each message is staged in a pooled byte
buffer, so the executor can reduce straight into a send buffer and keep
overwriting its own data while sends are in flight. Messages from one sender
are matched by MPI's per-pair FIFO order on a private duplicated communicator;
the tag (message id modulo the tag range) guards against mis-pairing.

Waits poll ``Test`` against a deadline instead of blocking in ``Wait``, so a
lost peer raises instead of hanging.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from . import waits
from .host_arrays import numpy_view
from .waits import DEFAULT_SPIN_SECONDS, wait_until
from .link_emulation import Pacer, parse
from .mpi_retired import retire
from .staged_sends import StagedSends

TAG_RANGE = 32767  # tags are message ids modulo this (MPI guarantees MPI_TAG_UB >= 32767); mpi_device.py too
_MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
              torch.int64: MPI.INT64_T}
_MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
# MPI moves a transfer only inside MPI calls, a bounded step per call (a protocol message, a
# socket read). While the application computes on every core, a background thread's check comes
# only when the scheduler next gives it a core, every 5-13 ms during DDP's backward on a 2-core
# host, so one Test per check left a 718 KB receive done ~11 ms after its bytes had arrived; 16 per
# check brought that to ~1 ms and the bucket from 28 to 12 ms (bench/results/overlap_across_hosts.md).
_TESTS_PER_CHECK = 16
# A group step's allreduce (schedules/native.py) runs in pieces of this many bytes, at most
# _GROUP_DEPTH in flight (allreduce_group).
_GROUP_PIECE_BYTES = 1 << 20
_GROUP_DEPTH = 4


def _tested(test):
    """A readiness check for ``wait_until`` that calls ``test()`` up to ``_TESTS_PER_CHECK`` times."""
    def ready() -> bool:
        for _ in range(_TESTS_PER_CHECK):
            if test():
                return True
        return False
    return ready


class _Pending:
    """The sends of one message over an emulated link: the pacer posts them later, one per
    addressee, into ``reqs``."""

    __slots__ = ("reqs", "expected")

    def __init__(self, expected: int):
        self.reqs: list = []
        self.expected = expected


def _complete(reqs) -> bool:
    """Whether every send of a message is done: a list of requests, or (emulated links) a
    _Pending whose requests are not all posted yet."""
    if isinstance(reqs, _Pending):
        return len(reqs.reqs) == reqs.expected and MPI.Request.Testall(reqs.reqs)
    return MPI.Request.Testall(reqs)


class MpiTransport(StagedSends):
    """Messages to any rank of ``comm`` (a communicator private to ddl_triton)."""

    name = "mpi"
    completes_sends = True  # two-sided: sends to complete, receives to post
    posts_receives_early = True

    def __init__(self, comm, emulate=None):
        self.comm = comm
        # transports/link_emulation.py: a slower link for tests and simulator validation (None: off).
        self._pacer = Pacer(emulate) if emulate is not None else None
        # Group steps (schedules/native.py) run MPI's own allreduce, which an emulated link would
        # not pace: with one, the executor runs their point-to-point stand-in through the pacer.
        self.has_group_allreduce = self._pacer is None
        self._group_comms: dict[tuple[int, ...], object] = {}
        if self._pacer is not None:
            # Queued sends must go out while this rank waits on any transport (a shm wait too).
            waits.progress_hooks.append(self._pacer.pump)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = DEFAULT_SPIN_SECONDS
        self._init_staging()

    def _sends_done(self, reqs) -> bool:
        return _complete(reqs)

    def push_sends(self) -> None:
        """Test the oldest send still in flight: what a wait on another transport calls to keep
        this transport's sends moving (ShmTransport.keep_moving, set by ddl_triton/runtime/setup/wiring.py).

        MPI moves a large message only inside MPI calls on both sides (a rendezvous: the
        sender must answer the receiver's request). A rank that sent a chunk over MPI and then
        waits for a shm message makes no MPI call, so its send stands still; and if the shm
        message it waits for depends on the receiver of that send (a ring across hosts: 3 waits
        on 2 over shm, 2 on 1 over MPI, 1 on 0 over shm, 0 on 3's stalled send), every rank
        waits for ever. So, where a communicator mixes shm and MPI, its shm waits also test the
        oldest send not yet complete (about half a microsecond, and nothing once every send is
        done). Testing any incomplete request runs MPI's progress engine, which moves every
        transfer; testing a complete one does not (MPICH returns at once for a request already
        done), so the sends already done, which stay listed until they are reaped, are passed
        over: testing only the first listed let a ring of 2 x 2 ranks hang on its later chunks.
        Only that communicator's waits do this: they run on the one thread that runs its
        collectives, so no other thread ever completes these requests meanwhile."""
        for reqs, _, _ in self._sending:
            if not _complete(reqs):
                return

    def _progress(self) -> None:
        if self._pacer is not None:
            self._pacer.pump()

    # -- sender (acquire: staged_sends.py) ------------------------------------------------
    def publish(self, msg_id: int) -> None:
        peers, nbytes, buf = self._unstage(msg_id)
        mem = numpy_view(buf)  # may be the caller's memory: leave its storage resizable
        self.bytes_sent += nbytes * len(peers)
        if self._pacer is None:
            reqs = [self.comm.Isend([mem, nbytes, MPI.BYTE], dest=p, tag=msg_id % TAG_RANGE) for p in peers]
            self._sending.append((reqs, buf, peers[0]))
            return
        pending = _Pending(len(peers))
        for p in peers:  # one emulated wire transfer per addressee
            self._pacer.submit(nbytes, lambda p=p: pending.reqs.append(
                self.comm.Isend([mem, nbytes, MPI.BYTE], dest=p, tag=msg_id % TAG_RANGE)))
        self._sending.append((pending, buf, peers[0]))

    # -- receiver ------------------------------------------------------------------------
    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Post the Irecv (of the whole ``size``-element message) early, so the data can land
        while this rank reduces other chunks."""
        key = (peer, msg_id)
        if key in self._posted:
            return
        nbytes = size * dtype.itemsize
        buf = self._take(nbytes)
        req = self.comm.Irecv([buf.numpy(), nbytes, MPI.BYTE], source=peer, tag=msg_id % TAG_RANGE)
        self._posted[key] = (req, buf)

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        size = max(size, offset + count)
        self.prefetch(peer, msg_id, size, dtype)
        req, buf = self._posted[(peer, msg_id)]
        wait_until(_tested(req.Test), timeout, peer, f"MPI message {msg_id}", spin=self.spin, prompt=True)
        self.bytes_received += size * dtype.itemsize  # the whole message crossed the wire
        item = dtype.itemsize
        return buf[offset * item:(offset + count) * item].view(dtype)

    def flush(self, timeout: float) -> None:
        """Complete every outstanding send (its receiver may be the last to arrive)."""
        for reqs, buf, dest in self._sending:
            wait_until(_tested(lambda: _complete(reqs)), timeout, dest, "MPI send completion", spin=self.spin,
                       prompt=True)
            self._give(buf)
        self._sending = []

    # -- group steps (schedules/native.py) ------------------------------------------------------
    def split_for_groups(self, color: int) -> None:
        """Make the communicator of the ranks that share ``color`` with this one, for their group
        steps. Collective over the whole communicator: the communicator's wiring calls it at init,
        with each rank's index inside its node, so a group step never waits in a blocking split."""
        sub = self.comm.Split(color, self.comm.Get_rank())
        members = sub.Get_group().Translate_ranks(list(range(sub.Get_size())), self.comm.Get_group())
        self._group_comms[tuple(members)] = sub

    def allreduce_group(self, group: tuple[int, ...], tensor: torch.Tensor, op: str, timeout: float) -> None:
        """MPI's own allreduce of ``tensor`` among ``group`` (transports/protocol.py), polled against the
        deadline like a receive. 16-bit floats, which MPI has no type for, are reduced in fp32 and
        rounded once (the same bits on every member). A group not made at init is made here with
        ``Create_group``, which blocks until every member arrives."""
        sub = self._group_comms.get(group)
        if sub is None:
            sub = self._group_comms[group] = self.comm.Create_group(self.comm.Get_group().Incl(list(group)))
        wide = tensor if tensor.dtype in _MPI_TYPES else tensor.float()
        flat, mpi_type = numpy_view(wide.view(-1)), _MPI_TYPES[wide.dtype]
        peer = next(p for p in group if p != self.comm.Get_rank()) if len(group) == 2 else -1
        what = f"MPI allreduce among ranks {', '.join(map(str, group))}"
        # In pieces, several in flight: MPI's allreduce of one large buffer exchanges, reduces, then
        # exchanges again, and the link idles while it reduces; pieces keep the next one on the wire
        # meanwhile (2 testbed hosts x 1 rank, 1 Gbit/s, 16 MiB: whole, 93% of the link's bound).
        step = max(1, _GROUP_PIECE_BYTES // wide.element_size())
        pieces = [(a, min(a + step, flat.size)) for a in range(0, flat.size, step)]
        flight: list = []
        for a, b in pieces:
            flight.append(sub.Iallreduce(MPI.IN_PLACE, [flat[a:b], mpi_type], _MPI_OPS[op]))
            if len(flight) == _GROUP_DEPTH:
                wait_until(_tested(flight.pop(0).Test), timeout, peer, what, spin=self.spin, prompt=True)
        for req in flight:
            wait_until(_tested(req.Test), timeout, peer, what, spin=self.spin, prompt=True)
        if wide is not tensor:
            tensor.copy_(wide)
        moved = 2 * (len(group) - 1) * tensor.numel() * tensor.element_size() // len(group)
        self.bytes_sent += moved
        self.bytes_received += moved

    def close(self) -> None:
        for sub in self._group_comms.values():
            try:
                sub.Free()  # local in MPICH: no wait on a peer that may be gone
            except MPI.Exception:
                pass
        self._group_comms.clear()
        if self._pacer is not None and self._pacer.pump in waits.progress_hooks:
            waits.progress_hooks.remove(self._pacer.pump)
        # Nothing MPI may still read or write is freed under it (mpi_retired.py): receives are cancelled,
        # and a send left by a failed call keeps its staging buffer until it completes, if ever.
        for req, buf in self._posted.values():
            req.Cancel()
            retire([req], buf)
        self._posted.clear()
        for reqs, buf, _ in self._sending:
            retire(reqs.reqs if isinstance(reqs, _Pending) else reqs, buf)
        self._sending = []
        self._free.clear()


def open_for(opening) -> MpiTransport:
    """The MPI transport of a communicator MPI launched (transports/table.py's row "mpi"), over its
    private communicator, with the link emulation its options ask for; where some peer is not on shm
    and MPI reduces for itself, also the communicators of the group steps (schedules/native.py)."""
    place = opening.placement
    transport = MpiTransport(opening.control, parse(opening.options.link_emulation))
    if not place.every_peer_on_shm and transport.has_group_allreduce:
        # Every rank or none (the nodes partition the ranks): the communicators of the ranks with one
        # index inside their nodes, for hierarchical_native's group steps. MPI's Split has no deadline:
        # it starts once the bootstrap's barrier (which has one) shows every rank here.
        opening.bootstrap.barrier()
        transport.split_for_groups(place.on_node.index(place.rank))
    return transport
