"""MPI transport for CUDA tensors: host-staged through pinned buffers, or CUDA-aware.

Semantics are those of MpiTransport (two-sided, per-pair FIFO on a private communicator,
tags = message id modulo the tag range, every wait polled against the deadline); only
where the bytes sit differs.

Host-staged (the default; any MPI):
    sender    the kernel writes a device staging buffer (acquire) -> publish enqueues an
              async device-to-host copy into a pinned buffer on the current stream and
              records an event; the Isend is posted once that event has passed. Meanwhile
              the host goes on enqueuing the next chunks, so the copy of chunk k overlaps
              the kernels of chunk k+1. Isends are posted strictly in publish order.
    receiver  the Irecv lands in a pinned buffer (posted ``pipeline_depth`` steps ahead by
              prefetch); recv waits for it, then enqueues an async host-to-device copy on
              the current stream and returns the device buffer; the kernel that reads it
              is queued behind the copy. The pinned buffer is reused only after its copy's
              event has passed.
    Every wait also posts the sends whose copies have finished: a rank that waits for its
    peer's message must not hold back the message its peer waits for.

CUDA-aware (``Options.mpi_cuda_aware`` / ``DDL_MPI_CUDA_AWARE=1``, only with an MPI built
with CUDA support): MPI reads and writes the device buffers directly. MPI works outside
CUDA streams, so publish synchronises the current stream before the Isend (the kernel
that filled the buffer must be done), and a device buffer given back by a reader is
reused only after an event recorded at release has passed (its reading kernel is done).
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
from mpi4py import MPI

from .host_arrays import numpy_view
from .mpi_retired import retire
from .waits import DEFAULT_SPIN_SECONDS, wait_until
from .mpi import TAG_RANGE
from .staged_sends import size_class as _size_class


class _CudaStreamOps:
    """What the transport asks of the current CUDA stream (a seam: the CPU tests of this
    transport's bookkeeping substitute host stand-ins, since this machine has no GPU)."""

    pinned = True

    @staticmethod
    def event():
        event = torch.cuda.Event()
        event.record()
        return event

    @staticmethod
    def synchronize() -> None:
        torch.cuda.current_stream().synchronize()


def _mpi_buffer(buf: torch.Tensor):
    """Host buffers through numpy (the buffer protocol); device buffers as themselves
    (``__cuda_array_interface__``, which a CUDA-aware mpi4py accepts)."""
    return numpy_view(buf) if buf.device.type == "cpu" else buf


class DeviceMpiTransport:
    """Messages of CUDA tensors to any rank of ``comm``, a communicator private to this
    transport (a Dup: its tags never meet the CPU path's); freed at close."""

    name = "mpi"
    completes_sends = True  # host-staged MPI: sends to complete, receives to post
    posts_receives_early = True

    def __init__(self, comm, device: torch.device, *, cuda_aware: bool = False, _stream_ops=_CudaStreamOps):
        self.comm = comm
        self.device = device
        self.cuda_aware = cuda_aware
        self._stream = _stream_ops
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = DEFAULT_SPIN_SECONDS
        self._device_pool: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._host_pool: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._cooling: deque = deque()   # (event, pool, buffer): back to its pool once the event passed
        self._copying: deque = deque()   # (event, host, device, peers, nbytes, msg_id): D2H copy queued
        self._sending: list = []         # (requests, buffer, pool, dest)
        self._staged = None
        self._posted: dict[tuple[int, int], tuple] = {}  # (peer, msg) -> (request, landing buffer)
        self._delivered: dict[tuple[int, int], torch.Tensor] = {}  # device copies handed out by recv

    # -- buffer pools --------------------------------------------------------------------
    def _take(self, pool: dict, nbytes: int, pinned: bool) -> torch.Tensor:
        self._cool_down()
        cls = _size_class(nbytes)
        free = pool[cls]
        if free:
            return free.pop()
        if pinned:
            return torch.empty(cls, dtype=torch.uint8, pin_memory=self._stream.pinned)
        return torch.empty(cls, dtype=torch.uint8, device=self.device)

    def _after_stream(self, pool: dict, buf: torch.Tensor) -> None:
        """Give ``buf`` back once the work queued so far on the current stream has run."""
        self._cooling.append((self._stream.event(), pool, buf))

    def _cool_down(self) -> None:
        while self._cooling and self._cooling[0][0].query():
            _, pool, buf = self._cooling.popleft()
            pool[buf.numel()].append(buf)

    # -- sender --------------------------------------------------------------------------
    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        self._progress()
        nbytes = count * dtype.itemsize
        buf = self._take(self._device_pool, nbytes, pinned=False)
        self._staged = (msg_id, peers, nbytes, buf)
        return buf[:nbytes].view(dtype)

    def publish(self, msg_id: int) -> None:
        staged_id, peers, nbytes, dev = self._staged  # type: ignore[misc]
        assert staged_id == msg_id, "publish without a matching acquire"
        self._staged = None
        self.bytes_sent += nbytes * len(peers)
        if self.cuda_aware:
            self._stream.synchronize()  # MPI reads outside the stream
            self._isend(dev, self._device_pool, peers, nbytes, msg_id)
            return
        host = self._take(self._host_pool, nbytes, pinned=True)
        host[:nbytes].copy_(dev[:nbytes], non_blocking=True)
        self._copying.append((self._stream.event(), host, dev, peers, nbytes, msg_id))
        self._progress()

    def _isend(self, buf: torch.Tensor, pool: dict, peers, nbytes: int, msg_id: int) -> None:
        reqs = [self.comm.Isend([_mpi_buffer(buf), nbytes, MPI.BYTE], dest=p, tag=msg_id % TAG_RANGE) for p in peers]
        self._sending.append((reqs, buf, pool, peers[0]))

    def _progress(self) -> bool:
        """Post the Isends whose device-to-host copies have finished (in publish order) and
        recycle completed sends. Returns False (a ``ready`` callback's shape)."""
        while self._copying and self._copying[0][0].query():
            _, host, dev, peers, nbytes, msg_id = self._copying.popleft()
            self._device_pool[dev.numel()].append(dev)  # the copy that read it has run
            self._isend(host, self._host_pool, peers, nbytes, msg_id)
        still = []
        for reqs, buf, pool, dest in self._sending:
            if MPI.Request.Testall(reqs):
                pool[buf.numel()].append(buf)
            else:
                still.append((reqs, buf, pool, dest))
        self._sending = still
        return False

    def post_ready_sends(self) -> None:
        """``_progress`` for another transport's waits (the NVSHMEM stream wait: gpu_path.py)."""
        self._progress()

    # -- receiver ------------------------------------------------------------------------
    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        key = (peer, msg_id)
        if key in self._posted or key in self._delivered:
            return
        nbytes = size * dtype.itemsize
        if self.cuda_aware:
            buf = self._take(self._device_pool, nbytes, pinned=False)
        else:
            buf = self._take(self._host_pool, nbytes, pinned=True)
        req = self.comm.Irecv([_mpi_buffer(buf), nbytes, MPI.BYTE], source=peer, tag=msg_id % TAG_RANGE)
        self._posted[key] = (req, buf, nbytes)

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        size = max(size, offset + count)
        key = (peer, msg_id)
        item = dtype.itemsize
        if key not in self._delivered:
            self.prefetch(peer, msg_id, size, dtype)
            req, landing, nbytes = self._posted.pop(key)
            wait_until(lambda: self._progress() or req.Test(), timeout, peer, f"MPI message {msg_id}",
                       spin=self.spin)
            self.bytes_received += nbytes
            if self.cuda_aware:
                dev = landing
            else:
                dev = self._take(self._device_pool, nbytes, pinned=False)
                dev[:nbytes].copy_(landing[:nbytes], non_blocking=True)
                self._after_stream(self._host_pool, landing)  # reusable once the copy has run
            self._delivered[key] = dev
        return self._delivered[key][offset * item:(offset + count) * item].view(dtype)

    def release(self, peer: int, msg_id: int) -> None:
        dev = self._delivered.pop((peer, msg_id))
        self._after_stream(self._device_pool, dev)  # reusable once the kernel that read it has run

    def flush(self, timeout: float) -> None:
        """Complete every outstanding send (copies first, then the Isends), under the deadline."""
        while self._copying:
            event = self._copying[0][0]
            wait_until(event.query, timeout, -1, "a device-to-host copy of a message", spin=self.spin)
            self._progress()
        for reqs, buf, pool, dest in self._sending:
            wait_until(lambda: MPI.Request.Testall(reqs), timeout, dest, "MPI send completion", spin=self.spin)
            pool[buf.numel()].append(buf)
        self._sending = []

    def close(self) -> None:
        # Nothing MPI may still read or write is freed under it (mpi_retired.py): receives are
        # cancelled, and a send left by a failed call keeps its buffer until it completes, if ever.
        for req, buf, _ in self._posted.values():
            req.Cancel()
            retire([req], buf)
        self._posted.clear()
        self._delivered.clear()
        for reqs, buf, _, _ in self._sending:
            retire(reqs, buf)
        self._sending = []
        self._copying.clear()
        self._cooling.clear()
        self._device_pool.clear()
        self._host_pool.clear()
        if not MPI.Is_finalized():
            self.comm.Free()


def open_for(opening) -> DeviceMpiTransport:
    """MPI for CUDA tensors on ``opening.device`` (transports/table.py's CUDA row "mpi"), over a
    duplicate of the communicator's private MPI communicator."""
    return DeviceMpiTransport(opening.control.Dup(), opening.device, cuda_aware=opening.options.mpi_cuda_aware)
