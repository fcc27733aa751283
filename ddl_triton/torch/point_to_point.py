"""Point-to-point for the "ddl" backend: send, recv and uneven all-to-all, as raw bytes.

Semantics (torch.distributed's): ``send(t, dst, tag)`` delivers ``t``'s bytes to the
``recv`` of ``dst`` with the same source and tag (or to its ``recv_anysource`` with that
tag, which learns the sender's rank), which must expect the same number of bytes; messages
between one pair with one tag arrive in the order sent. ``alltoallv``
exchanges dim-0 slices of uneven sizes (or whole tensors of unequal sizes). Each call
returns a ddl_triton ``Work`` done once the bytes have arrived and been copied into the
caller's tensor; errors (a lost peer, a deadline) go to that Work.

Two implementations, one per bootstrap (ddl_triton/runtime/setup/bootstrap.py):

- ``MpiPointToPoint``: mpi4py buffer methods (Isend/Irecv/Ialltoallv) on a private MPI
  communicator; requests are posted on the caller's thread (so MPI matches them in program
  order) and polled to completion by one background thread against Options.timeout.
- ``GlooPointToPoint``: a gloo process group of its own on the group's store; each
  operation is watched by a thread blocked in gloo's ``wait()`` (transports/gloo.py explains
  why gloo's send/recv cannot be polled); gloo's own timeout (Options.timeout) bounds it.

Tensors are staged through contiguous host copies, so any layout and any dtype travel.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch

from ..errors import engine_failed, peer_failed
from ..runtime.calls.work import OrderedRunner, Work
from ..transports.host_arrays import numpy_view
from .staging import as_bytes, byte_counts, displs, nbytes

_TAG_BOUND = 32767  # the least MPI_TAG_UB the MPI standard guarantees; gloo's is larger, one bound for both


def check_tag(tag: int) -> int:
    if not 0 <= tag <= _TAG_BOUND:
        raise ValueError(f"ddl backend: tag {tag} outside 0..{_TAG_BOUND}")
    return tag


def _stagings(outputs):
    return [torch.empty(t.shape, dtype=t.dtype) for t in outputs]


def _alltoallv_buffers(outputs, inputs, out_splits, in_splits, per_tensor: bool):
    """(send bytes, output stagings, receive bytes, send counts, receive counts) of an uneven
    all-to-all exchanged as bytes, whichever engine moves them."""
    send = torch.cat([as_bytes(t.detach().contiguous()) for t in inputs])
    recv = torch.empty(sum(nbytes(t) for t in outputs), dtype=torch.uint8)
    return (send, _stagings(outputs), recv, byte_counts(inputs, in_splits, per_tensor),
            byte_counts(outputs, out_splits, per_tensor))


def _unpack(outputs, stagings, recv: torch.Tensor) -> None:
    """Copy the received bytes, in order, into each output (through its staging tensor)."""
    offset = 0
    for out, st in zip(outputs, stagings):
        n = nbytes(st)
        as_bytes(st).copy_(recv[offset:offset + n])
        out.copy_(st)
        offset += n


class MpiPointToPoint:
    """Point-to-point over ``mpi_comm``, a communicator private to it (freed at close)."""

    def __init__(self, mpi_comm, timeout: float, rank: int, describe=None):
        self._describe = describe  # peer -> how an error names it, with its host (Placement.describe)
        self._mpi = mpi_comm
        self._timeout = timeout
        self._rank = rank
        self._runner = OrderedRunner(f"ddl_triton-p2p-rank{rank}")
        self._closed = False

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        from mpi4py import MPI

        data = as_bytes(tensor.detach().contiguous())  # the caller's memory: a view that leaves it resizable
        req = self._mpi.Isend([numpy_view(data), data.numel(), MPI.BYTE], dest=dst, tag=check_tag(tag))
        return self._complete(req, None, f"send to {dst} (tag {tag})", keep=(data,), peer=dst)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        from mpi4py import MPI

        staging = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = as_bytes(staging)
        req = self._mpi.Irecv([data.numpy(), data.numel(), MPI.BYTE], source=src, tag=check_tag(tag))
        return self._complete(req, lambda: tensor.copy_(staging), f"recv from {src} (tag {tag})", keep=(data,),
                              peer=src)

    def recv_anysource(self, tensor: torch.Tensor, tag: int) -> tuple[Work, list[int]]:
        """``recv`` from whichever rank sends first; the list gets the sender's rank."""
        from mpi4py import MPI

        staging = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = as_bytes(staging)
        status, source = MPI.Status(), [-1]
        req = self._mpi.Irecv([data.numpy(), data.numel(), MPI.BYTE], source=MPI.ANY_SOURCE, tag=check_tag(tag))

        def finish():
            source[0] = status.Get_source()
            tensor.copy_(staging)

        return self._complete(req, finish, f"recv from any rank (tag {tag})", keep=(data,), status=status), source

    def alltoallv(self, outputs, inputs, out_splits, in_splits, per_tensor: bool) -> Work:
        """Slices (per dim-0 row, or whole tensors when ``per_tensor``) exchanged as bytes."""
        from mpi4py import MPI

        send, stagings, recv, scounts, rcounts = _alltoallv_buffers(outputs, inputs, out_splits, in_splits,
                                                                    per_tensor)
        req = self._mpi.Ialltoallv([send.numpy(), (scounts, displs(scounts)), MPI.BYTE],
                                   [recv.numpy(), (rcounts, displs(rcounts)), MPI.BYTE])
        return self._complete(req, lambda: _unpack(outputs, stagings, recv), "all_to_all (uneven splits)",
                              keep=(send,))

    def _complete(self, req, finish, what: str, keep=(), status=None, peer: int = -1) -> Work:
        def job():
            _ = keep  # the message buffers live until the request completes
            self._wait(req, what, status, peer)
            if finish is not None:
                finish()
        return self._runner.submit(job, what)

    def _wait(self, req, what: str, status=None, peer: int = -1) -> None:
        """Poll ``req`` to completion; past the deadline, a CollectiveTimeout naming ``peer`` (-1: any
        rank, or every rank of an all-to-all) with its host."""
        deadline = time.monotonic() + self._timeout
        pause = 0.0
        while not (req.Test(status) if status is not None else req.Test()):
            if time.monotonic() > deadline:
                raise peer_failed(self._rank, what, peer, "its MPI request", self._timeout, self._describe)
            time.sleep(pause)  # releases the GIL for the training thread
            pause = min(1e-3, pause * 2 or 1e-6)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._runner.close()
        from mpi4py import MPI

        if not MPI.Is_finalized():
            self._mpi.Free()


class GlooPointToPoint:
    """Point-to-point over a gloo process group made on ``store`` (a namespace nobody else
    uses). Collective: every rank of the group constructs it."""

    def __init__(self, store, rank: int, size: int, timeout: float, describe=None):
        import torch.distributed as dist

        from ..transports.gloo import Watchers

        self._describe = describe  # peer -> how an error names it, with its host (Placement.describe)
        self._rank = rank
        self._timeout = timeout
        self._pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
        self._watchers = Watchers(f"ddl_triton-p2p-rank{rank}")

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        data = as_bytes(tensor.detach().contiguous()).clone()  # ours until gloo has sent it
        return self._complete(self._pg.send([_nonempty(data)], dst, check_tag(tag)), None,
                              f"send to {dst} (tag {tag})", keep=data, peer=dst)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        staging = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = as_bytes(staging)
        return self._complete(self._pg.recv([_nonempty(data)], src, check_tag(tag)), lambda: tensor.copy_(staging),
                              f"recv from {src} (tag {tag})", keep=data, peer=src)

    def recv_anysource(self, tensor: torch.Tensor, tag: int) -> tuple[Work, list[int]]:
        staging = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = as_bytes(staging)
        source = [-1]
        gloo_work = self._pg.recv_anysource([_nonempty(data)], check_tag(tag))

        def finish():
            source[0] = gloo_work._source_rank()
            tensor.copy_(staging)

        return self._complete(gloo_work, finish, f"recv from any rank (tag {tag})", keep=data), source

    def alltoallv(self, outputs, inputs, out_splits, in_splits, per_tensor: bool) -> Work:
        send, stagings, recv, scounts, rcounts = _alltoallv_buffers(outputs, inputs, out_splits, in_splits,
                                                                    per_tensor)
        work = self._pg.alltoall_base(recv, send, rcounts, scounts)
        return self._complete(work, lambda: _unpack(outputs, stagings, recv), "all_to_all (uneven splits)",
                              keep=send)

    def _complete(self, gloo_work, finish, what: str, keep=None, peer: int = -1) -> Work:
        work = Work(what)

        def done(pending) -> None:
            _ = keep  # the message buffers live until gloo is done with them
            if pending.error is not None:
                first = str(pending.error).splitlines()[0][:300]
                error = engine_failed(self._rank, what, peer, "gloo", first, self._timeout, self._describe)
                work.set_exception(error)
                return
            try:
                if finish is not None:
                    finish()
            except BaseException as e:  # noqa: BLE001 - delivered through the Work
                work.set_exception(e)
                return
            work.set_result(None)

        self._watchers.watch(gloo_work, done)
        return work

    def close(self) -> None:
        self._watchers.close()
        # Free the group now, while the interpreter is whole (transports/gloo.py's close says why): a
        # group of an elastic job's old world would otherwise live on into exit and can abort it.
        self._pg = None


def _nonempty(data: torch.Tensor) -> torch.Tensor:
    """gloo moves no empty message: an empty one travels as one byte (both ends agree)."""
    return data if data.numel() else torch.zeros(1, dtype=torch.uint8)
