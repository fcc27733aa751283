"""NVSHMEM transport: messages between the GPUs of one node through symmetric memory.

Semantics (the transport protocol of protocol.py, on CUDA tensors):
- Every PE owns ``depth`` send slots in one symmetric tensor. ``acquire`` hands out a view
  of this PE's slot; the executor reduces or copies straight into it.
- ``recv`` returns a view of the *sender's* slot through ``get_peer_tensor`` (NVLink
  load/store), so the Triton reduction kernel reads the peers' buffers directly: there is
  no copy into a receive buffer.
- Ordering is stream-ordered on the current torch stream, never a host synchronisation
  per chunk: ``publish`` is ``signal_op(SET msg_id)`` on each reader's *ready* flag for
  (slot, sender), issued on the stream after the kernel that filled the slot; ``recv``
  enqueues ``signal_wait(ready >= msg_id)`` before the kernel that reads it; ``release``
  signals the sender's *consumed* flag for (slot, reader) after that kernel; ``acquire``
  of a slot enqueues ``signal_wait(consumed >= previous msg_id)`` for each earlier reader.
  Message ids only grow, so the flags are never reset and ``>=`` is always the test; a
  flag carries ``msg_id + 1``, because the flags start at 0 and message 0 must not read
  as already sent.
- Deadlines: a device-side wait cannot time out, so the host bounds the whole collective
  instead: ``flush`` records an event after the last step and polls it with the deadline
  (``waits.wait_until``); a peer that never signals becomes a CollectiveTimeout there.
  That poll is the one host synchronisation of a collective.

The NVSHMEM runtime is per process: ``NvshmemRuntime.get`` initialises it once, over the
node's MPI communicator (UID broadcast: ``initializer_method="emulated_mpi"``), with one PE
per node-local rank. Symmetric allocation is collective over every PE, so only a
communicator spanning every rank of its node may use this transport (the communicator
checks; others stage device buffers through MPI).

Several PEs on one GPU (a test machine) work only in NVSHMEM's LIMITED MPG mode, where
on-stream waits and barriers end the process (seen on an H200: exit 255 at the first on-stream
barrier). The runtime detects that mode right after init and refuses with a ValueError on every
PE, so the GPU path falls back to MPI (``DDL_TRANSPORT=auto``) or says why it cannot
(``DDL_TRANSPORT=nvshmem``). There, the 1-PE smoke test (``smoke_test``) and world-size-1
collectives are what can run.
"""
from __future__ import annotations

import torch

from .waits import DEFAULT_SPIN_SECONDS, wait_until


def _core():
    """nvshmem.core, imported on first use: the CPU path must not need it."""
    import nvshmem.core as nvshmem  # noqa: PLC0415
    return nvshmem


class _StreamRef:
    """A torch stream in the ``__cuda_stream__`` protocol nvshmem4py takes."""

    __slots__ = ("handle",)

    def __init__(self, stream: torch.cuda.Stream):
        self.handle = int(stream.cuda_stream)

    def __cuda_stream__(self):
        return (0, self.handle)


class _CudaOps:
    """The CUDA calls this transport makes, in one place (a seam: the CPU tests run the
    transport's bookkeeping against a host stand-in of nvshmem.core and of these)."""

    @staticmethod
    def bind(device: torch.device) -> None:
        from cuda.core import Device  # noqa: PLC0415 - nvshmem4py's device type
        torch.cuda.set_device(device)
        Device(device.index).set_current()

    @staticmethod
    def nvshmem_device(device: torch.device):
        from cuda.core import Device  # noqa: PLC0415
        return Device(device.index)

    @staticmethod
    def stream() -> _StreamRef:
        return _StreamRef(torch.cuda.current_stream())

    @staticmethod
    def synchronize(device: torch.device) -> None:
        torch.cuda.synchronize(device)

    @staticmethod
    def event():
        event = torch.cuda.Event()
        event.record()
        return event


_cuda = _CudaOps


def _current_stream() -> _StreamRef:
    return _cuda.stream()


_LIMITED_MPG = 3  # nvshmemx_init_status_t's NVSHMEM_STATUS_LIMITED_MPG, where the bindings do not name it


def _limited_mpg(nvshmem) -> bool:
    """Whether NVSHMEM came up in LIMITED MPG mode: several PEs share a GPU without MPS."""
    try:
        from nvshmem import bindings  # noqa: PLC0415
        limited = int(bindings.Init_status.STATUS_LIMITED_MPG)
    except (ImportError, AttributeError):
        limited = _LIMITED_MPG
    return int(nvshmem.init_status()) == limited


class NvshmemRuntime:
    """The process's NVSHMEM job: initialised once over a node communicator, finalised at close."""

    _instance: "NvshmemRuntime | None" = None
    _refused: str = ""  # why NVSHMEM cannot serve this process, once found: it is not initialised again

    def __init__(self, node_comm, device: torch.device, world_ranks: list[int]):
        nvshmem = _core()
        self.world_ranks = list(world_ranks)  # COMM_WORLD rank of each PE
        self.device = device
        _cuda.bind(device)
        nvshmem.init(device=_cuda.nvshmem_device(device), mpi_comm=node_comm, initializer_method="emulated_mpi")
        self.my_pe = int(nvshmem.my_pe())
        self.n_pes = int(nvshmem.n_pes())
        self.users = 0
        if self.n_pes > 1 and _limited_mpg(nvshmem):
            # Every PE of the node sees the same mode, so every one refuses here, before any
            # on-stream call: in this mode NVSHMEM ends the process at the first one
            # ("Called NVSHMEM API not supported with limited MPG", exit 255, seen on an H200
            # with two PEs) instead of returning an error.
            nvshmem.finalize()
            raise ValueError(f"NVSHMEM came up in LIMITED MPG mode ({self.n_pes} PEs share a GPU without CUDA "
                             "MPS), where its on-stream waits and barriers, which this transport needs, end the "
                             "process; give each rank its own GPU, or use DDL_TRANSPORT=mpi")

    @classmethod
    def get(cls, node_comm, device: torch.device, world_ranks: list[int]) -> "NvshmemRuntime":
        """The process's runtime, initialised over ``node_comm`` on first use; ``world_ranks``
        (COMM_WORLD rank of each rank of ``node_comm``) must be those it was initialised over.
        Raises ValueError where NVSHMEM cannot serve (then again at every later call, without
        initialising it again)."""
        if cls._refused:
            raise ValueError(cls._refused)
        if cls._instance is None:
            try:
                cls._instance = cls(node_comm, device, world_ranks)
            except ValueError as e:
                cls._refused = str(e)
                raise
        runtime = cls._instance
        if runtime.world_ranks != list(world_ranks):
            raise ValueError(f"NVSHMEM runs over world ranks {runtime.world_ranks} of this node, but this "
                             f"communicator's node ranks are {list(world_ranks)}: symmetric allocation is "
                             "collective over every PE, so only a communicator spanning the same ranks can use it")
        runtime.users += 1
        return runtime

    def release(self) -> None:
        """Drop one user; the last one finalises NVSHMEM (which frees whatever is left)."""
        self.users -= 1
        if self.users == 0:
            _core().finalize()
            NvshmemRuntime._instance = None


class NvshmemTransport:
    """Messages among the GPUs of one node. ``world_of_local[i]`` is the communicator rank of
    PE ``i``; peers are named by communicator rank in every call (as ShmTransport does)."""

    name = "nvshmem"
    completes_sends = True  # its stream is seen through in flush, under the deadline
    posts_receives_early = False

    def __init__(self, node_comm, world_of_local: list[int], *, slot_bytes: int, depth: int,
                 device: torch.device, world_ranks: list[int]):
        nvshmem = _core()
        self.runtime = NvshmemRuntime.get(node_comm, device, world_ranks)
        self.spin = DEFAULT_SPIN_SECONDS
        self.bytes_sent = 0
        self.bytes_received = 0
        self.depth = depth
        self.slot_bytes = slot_bytes
        self.local_rank = self.runtime.my_pe
        self.local_size = self.runtime.n_pes
        self._local_of_world = {w: i for i, w in enumerate(world_of_local)}
        n, me = self.local_size, self.local_rank
        # Collective allocations, in the same order and sizes on every PE.
        self._slots = nvshmem.bytetensor((depth * slot_bytes,))
        # ready[slot][sender] lives in the reader's memory; consumed[slot][reader] in the sender's.
        self._ready = [[nvshmem.buffer(8) for _ in range(n)] for _ in range(depth)]
        self._consumed = [[nvshmem.buffer(8) for _ in range(n)] for _ in range(depth)]
        for buf in self._flags():
            torch.utils.dlpack.from_dlpack(buf).view(torch.int64).zero_()
        _cuda.synchronize(device)
        nvshmem.barrier_all(stream=_current_stream())  # every PE's flags are zero before anyone signals
        _cuda.synchronize(device)
        # Our own slots are used directly: get_peer_tensor on oneself would skew the free count.
        self._peer_slots = [self._slots if pe == me else nvshmem.get_peer_tensor(self._slots, pe)
                            for pe in range(n)]
        self._slot_user: list[tuple[int, tuple[int, ...]]] = [(0, ())] * depth
        self._pending: tuple[int, tuple[int, ...], int] | None = None
        self._closed = False

    def _pe(self, peer: int) -> int:
        return self._local_of_world[peer]

    def _flags(self):
        """Every flag buffer, ready then consumed, in allocation order."""
        return [buf for flags in (self._ready, self._consumed) for row in flags for buf in row]

    @staticmethod
    def _signal(msg_id: int) -> int:
        """The flag value that says "message ``msg_id`` is there" (or "is read"): flags start at
        0, so message 0 must not read as already signalled."""
        return msg_id + 1

    def _view(self, pe: int, msg_id: int, offset_bytes: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        start = (msg_id % self.depth) * self.slot_bytes + offset_bytes
        return self._peer_slots[pe][start:start + count * dtype.itemsize].view(dtype)

    # -- sender --------------------------------------------------------------------------
    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        nbytes = count * dtype.itemsize
        if nbytes > self.slot_bytes:
            raise ValueError(f"message of {nbytes} bytes exceeds the {self.slot_bytes}-byte NVSHMEM slot")
        nvshmem = _core()
        slot = msg_id % self.depth
        old_id, old_readers = self._slot_user[slot]
        stream = _current_stream()
        for reader in old_readers:  # the slot is reused only once its last readers are done with it
            nvshmem.signal_wait(self._consumed[slot][reader], self._signal(old_id), nvshmem.ComparisonType.CMP_GE,
                                stream)
        self._pending = (msg_id, tuple(self._pe(p) for p in peers), nbytes)
        return self._view(self.local_rank, msg_id, 0, count, dtype)

    def publish(self, msg_id: int) -> None:
        pending_id, readers, nbytes = self._pending  # type: ignore[misc]
        assert pending_id == msg_id, "publish without a matching acquire"
        nvshmem = _core()
        slot = msg_id % self.depth
        stream = _current_stream()
        for pe in readers:  # after the kernel that filled the slot, on the same stream
            nvshmem.signal_op(self._ready[slot][self.local_rank], self._signal(msg_id), nvshmem.SignalOp.SIGNAL_SET,
                              pe, stream)
        self._slot_user[slot] = (msg_id, readers)
        self.bytes_sent += nbytes * len(readers)
        self._pending = None

    # -- receiver ------------------------------------------------------------------------
    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Nothing to post: the data is read in place from the peer's slot."""

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        nvshmem = _core()
        pe = self._pe(peer)
        nvshmem.signal_wait(self._ready[msg_id % self.depth][pe], self._signal(msg_id), nvshmem.ComparisonType.CMP_GE,
                            _current_stream())
        self.bytes_received += count * dtype.itemsize
        return self._view(pe, msg_id, offset * dtype.itemsize, count, dtype)

    def release(self, peer: int, msg_id: int) -> None:
        nvshmem = _core()
        nvshmem.signal_op(self._consumed[msg_id % self.depth][self.local_rank], self._signal(msg_id),
                          nvshmem.SignalOp.SIGNAL_SET, self._pe(peer), _current_stream())

    def flush(self, timeout: float) -> None:
        """Wait, under the deadline, for the stream to pass every step of this collective."""
        done = _cuda.event()
        wait_until(done.query, timeout, -1, "the GPU stream (an NVSHMEM signal never came)", spin=self.spin)

    def close(self) -> None:
        """Free the symmetric memory (collective: every PE closes in the same order)."""
        if self._closed:
            return
        self._closed = True
        nvshmem = _core()
        _cuda.synchronize(self.runtime.device)
        self._peer_slots = []
        nvshmem.free_tensor(self._slots)
        for buf in self._flags():
            nvshmem.free(buf)
        self._ready = self._consumed = []
        self.runtime.release()


def smoke_test(device_index: int = 0) -> dict:
    """Initialise NVSHMEM with 1 PE (UID bootstrap, no MPI), then check: symmetric allocation,
    a self put and get on a stream, a peer tensor, a signal round trip, free and finalize.

    Returns ``{"init_status": str, "checks": {name: bool}, "error": str | None}``.
    """
    result: dict = {"init_status": "not initialised", "checks": {}, "error": None}
    checks = result["checks"]
    try:
        nvshmem = _core()
        from cuda.core import Device  # noqa: PLC0415
        device = Device(device_index)
        device.set_current()
        torch.cuda.set_device(device_index)
        uid = nvshmem.get_unique_id()
        nvshmem.init(device=device, uid=uid, rank=0, nranks=1, initializer_method="uid")
        result["init_status"] = str(nvshmem.init_status())
        checks["one PE"] = int(nvshmem.my_pe()) == 0 and int(nvshmem.n_pes()) == 1
        stream = torch.cuda.Stream()
        ref = _StreamRef(stream)
        n = 1 << 20
        src = nvshmem.tensor((n,), dtype=torch.float32)
        dst = nvshmem.tensor((n,), dtype=torch.float32)
        expected = torch.arange(n, dtype=torch.float32, device=f"cuda:{device_index}")
        with torch.cuda.stream(stream):
            src.copy_(expected)
            dst.zero_()
        nvshmem.put(dst, src, remote_pe=0, stream=ref)
        nvshmem.quiet(stream=ref)
        stream.synchronize()
        checks["symmetric alloc + self put"] = bool(torch.equal(dst, expected))
        with torch.cuda.stream(stream):
            dst.zero_()
        nvshmem.get(dst, src, remote_pe=0, stream=ref)
        stream.synchronize()
        checks["self get"] = bool(torch.equal(dst, expected))
        peer = nvshmem.get_peer_tensor(src, 0)
        checks["peer tensor aliases own buffer"] = peer.data_ptr() == src.data_ptr() and bool(
            torch.equal(peer, expected))
        del peer
        flag = nvshmem.buffer(8)
        nvshmem.signal_op(flag, 7, nvshmem.SignalOp.SIGNAL_SET, 0, ref)
        nvshmem.signal_wait(flag, 7, nvshmem.ComparisonType.CMP_GE, ref)
        stream.synchronize()
        checks["signal set + wait"] = int(nvshmem.signal_fetch(flag)) == 7
        nvshmem.free(flag)
        nvshmem.free_tensor(src)
        nvshmem.free_tensor(dst)
        checks["free"] = True
        nvshmem.finalize()
        checks["finalize"] = True
    except Exception as e:  # noqa: BLE001 - a smoke test reports, it does not raise
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def open_for(opening) -> NvshmemTransport:
    """NVSHMEM over the ranks of this rank's node (transports/table.py's row "nvshmem"). Collective
    over the communicator: every rank opens it, a node of one rank too. CannotOpen, saying why,
    where it cannot serve (a communicator that does not span its node, NVSHMEM's LIMITED MPG mode)."""
    from mpi4py import MPI  # noqa: PLC0415 - the world rank of each PE
    from .table import CannotOpen  # noqa: PLC0415
    place, options = opening.placement, opening.options
    node = opening.control.Split(place.node_of_rank[place.rank], place.rank)
    try:
        world_of_node = opening.gather_ints(node, MPI.COMM_WORLD.Get_rank(), "NVSHMEM's node")
        return NvshmemTransport(node, list(place.on_node), slot_bytes=options.chunk_bytes,
                                depth=options.pipeline_depth, device=opening.device, world_ranks=world_of_node)
    except ValueError as e:
        raise CannotOpen(str(e)) from e
    finally:
        node.Free()
