"""A host stand-in for the part of ``nvshmem.core`` that transports/nvshmem.py uses, so
the transport's protocol (slots, ready/consumed signals, message ids, slot reuse) runs on
CPU ranks under mpiexec. Not a simulator of NVSHMEM's performance or memory model.

Symmetric memory: allocation number k of PE p is the file /dev/shm/ddl-fake-nvshmem-<job>-<k>-<p>,
mapped shared by every PE that asks for it (``get_peer_tensor``). Stream-ordered operations
happen at once on the host: ``signal_op`` stores into the peer's flag, ``signal_wait`` spins
(yielding) until the flag satisfies the comparison. One in-order stream per rank executes
the same operations in the same order, so a protocol that completes on a stream completes
here; a wait that is never satisfied raises after ``WAIT_LIMIT`` seconds instead of hanging.
"""
from __future__ import annotations

import enum
import os
import time

import torch

WAIT_LIMIT = 30.0
_state = {"comm": None, "pe": 0, "n": 1, "job": "", "next": 0, "files": []}


class SignalOp(enum.IntEnum):
    SIGNAL_SET = 0
    SIGNAL_ADD = 5


class ComparisonType(enum.IntEnum):
    CMP_EQ = 0
    CMP_NE = 1
    CMP_GT = 2
    CMP_LE = 3
    CMP_LT = 4
    CMP_GE = 5


def _path(k: int, pe: int) -> str:
    return f"/dev/shm/ddl-fake-nvshmem-{_state['job']}-{k}-{pe}"


def _map(k: int, pe: int, nbytes: int) -> torch.Tensor:
    return torch.from_file(_path(k, pe), shared=True, size=nbytes, dtype=torch.uint8)


class Buffer:
    """A symmetric allocation: ``tensor`` is this PE's bytes; ``index`` names it on every PE."""

    def __init__(self, index: int, nbytes: int, tensor: torch.Tensor):
        self.index, self.size, self.tensor = index, nbytes, tensor

    def __dlpack__(self, *args, **kwargs):
        return self.tensor.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


_buffers: dict[int, Buffer] = {}  # data_ptr of a tensor handed out -> its Buffer


def init(device=None, mpi_comm=None, initializer_method="", **_) -> None:
    assert initializer_method == "emulated_mpi" and mpi_comm is not None
    # A private duplicate: like NVSHMEM's own bootstrap, it outlives the caller's communicator.
    comm = mpi_comm.Dup()
    _state.update(comm=comm, pe=comm.Get_rank(), n=comm.Get_size(), next=0, files=[],
                  job=comm.bcast(f"{os.getpid()}", root=0))


STATUS_IS_INITIALIZED, STATUS_LIMITED_MPG = 2, 3  # nvshmemx_init_status_t's values
LIMITED_MPG_ENV = "FAKE_NVSHMEM_LIMITED_MPG"  # set to 1: init comes up as several PEs sharing a GPU without MPS


def init_status() -> int:
    return STATUS_LIMITED_MPG if os.environ.get(LIMITED_MPG_ENV) == "1" and _state["n"] > 1 else STATUS_IS_INITIALIZED


def my_pe() -> int:
    return _state["pe"]


def n_pes() -> int:
    return _state["n"]


def buffer(nbytes: int) -> Buffer:
    k = _state["next"]
    _state["next"] += 1
    path = _path(k, _state["pe"])
    with open(path, "wb") as f:
        f.write(b"\0" * nbytes)
    _state["files"].append(path)
    _state["comm"].Barrier()  # collective, like nvshmem_malloc: every PE's file exists after it
    buf = Buffer(k, nbytes, _map(k, _state["pe"], nbytes))
    _buffers[buf.tensor.data_ptr()] = buf
    return buf


def bytetensor(shape) -> torch.Tensor:
    return buffer(int(shape[0])).tensor


def get_peer_tensor(t: torch.Tensor, pe: int) -> torch.Tensor:
    buf = _buffers[t.data_ptr()]
    return _map(buf.index, pe, buf.size)


def signal_op(signal_var: Buffer, value: int, op, remote_pe: int, stream) -> None:
    flag = _map(signal_var.index, remote_pe, 8).view(torch.int64)
    flag[0] = value if op == SignalOp.SIGNAL_SET else flag[0] + value


def signal_wait(signal_var: Buffer, value: int, cmp, stream) -> None:
    assert cmp == ComparisonType.CMP_GE, "the transport only waits for >="
    flag = signal_var.tensor.view(torch.int64)
    deadline = time.monotonic() + WAIT_LIMIT
    from ddl_triton.transports import waits
    while int(flag[0]) < value:
        # A device-side wait does not hold the host: it goes on posting sends meanwhile (the
        # progress hooks every host wait runs), which this host stand-in must do itself.
        for hook in list(waits.progress_hooks):
            hook()
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake nvshmem: PE {_state['pe']} waited {WAIT_LIMIT} s for signal "
                               f"{signal_var.index} >= {value} (it is {int(flag[0])})")
        os.sched_yield()


def barrier_all(stream=None) -> None:
    _state["comm"].Barrier()


def free_tensor(t: torch.Tensor) -> None:
    _buffers.pop(t.data_ptr(), None)


def free(buf: Buffer) -> None:
    _buffers.pop(buf.tensor.data_ptr(), None)


def finalize() -> None:
    _state["comm"].Barrier()
    for path in _state["files"]:
        os.unlink(path)
    _state["files"] = []
    _buffers.clear()
    _state["comm"].Free()
    _state["comm"] = None


class HostCudaOps:
    """Host stand-ins for transports/nvshmem.py's ``_cuda`` seam."""

    @staticmethod
    def bind(device) -> None:
        pass

    @staticmethod
    def nvshmem_device(device):
        return None

    @staticmethod
    def stream():
        return None

    @staticmethod
    def synchronize(device) -> None:
        pass

    @staticmethod
    def event():
        return _DoneEvent()


class _DoneEvent:
    def query(self) -> bool:
        return True


class SlowEvents:
    """Host stand-ins for transports/mpi_device.py's stream ops: each event reports done only
    on its ``lag``-th query, so copies are seen in flight and the transport must keep posting
    sends from inside its waits (as on a GPU, where copies overlap the host)."""

    pinned = False

    def __init__(self, lag: int = 3):
        self.lag = lag
        self.synchronized = 0

    def event(self):
        return _LaggingEvent(self.lag)

    def synchronize(self) -> None:
        self.synchronized += 1


class _LaggingEvent:
    def __init__(self, lag: int):
        self.left = lag

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0
