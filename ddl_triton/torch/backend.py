"""The "ddl" torch.distributed backend: a Python ProcessGroup whose collectives run on a ddl_triton Communicator.

Semantics: every collective has torch.distributed's meaning (same arguments,
same results, in place where torch's is), runs on CPU tensors, or on CUDA
tensors through the communicator's GPU path (ddl_triton/gpu_path.py; not
send/recv or uneven all-to-all, which use MPI on host memory), and
returns a ``Work`` whose ``get_future()`` resolves with the output tensors
when the collective completes (or carries its error). Calls issued with
``async_op=False`` run inline; the others run on the communicator's
background thread, always in issue order. Ranks of a group are its MPI
ranks: the default group must be launched by ``mpiexec``/``ddlrun`` and its
torch rank and world size must equal MPI's.

Supported: allreduce (SUM, AVG, MIN, MAX, PREMUL_SUM with a float factor),
allreduce_coalesced, broadcast, allgather (list form, into one tensor, and
coalesced), reduce_scatter (list form, from one tensor, and coalesced),
alltoall (list form and single tensor, even or uneven splits), barrier,
reduce, gather, scatter, send and recv (with a source rank). Any dtype is
moved exactly by the copy-only collectives; reductions take the floating
types, int32/int64, and bool/int8/uint8/int16 (reduced in int64).

Rendezvous: the default group needs a key/value store, which torch builds
from ``init_method``. Under ``mpiexec`` with no ``MASTER_ADDR`` set, the
``env://`` method (torch's default) and the explicit ``ddl://`` method build
it over MPI instead: rank 0 starts a TCPStore on a free port and broadcasts
its address, so ``dist.init_process_group("ddl")`` needs no environment.
"""
from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch.distributed import ReduceOp

from .. import gpu_path
from ..errors import CollectiveTimeout
from ..ops import DTYPES
from ..work import OrderedRunner, Work

BACKEND_NAME = "ddl"
RENDEZVOUS_SCHEME = "ddl"

_RED = ReduceOp.RedOpType
_OP_NAMES = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MIN: "min", _RED.MAX: "max"}
_WIDENED = (torch.bool, torch.int8, torch.uint8, torch.int16)  # reduced in int64, exactly
_MPI_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
_P2P_TAG_BOUND = 32767  # the least MPI_TAG_UB the MPI standard guarantees


class DdlProcessGroup(dist.ProcessGroup):
    """torch.distributed ProcessGroup over a ddl_triton Communicator (and a private MPI comm for
    point-to-point and uneven all-to-all). Created by ``init_process_group``/``new_group`` with
    backend "ddl"; not meant to be constructed directly."""

    def __init__(self, comm, p2p_mpi_comm, owns_comm: bool):
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._owns_comm = owns_comm
        self._names: dict[str, str] = {}
        self._p2p = _PointToPoint(p2p_mpi_comm, comm.options.timeout, comm.rank)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name and description on its C++ backends, which a Python group has
    # none of: keep them here (C++ reaches these through the ProcessGroup trampoline).
    def getGroupName(self) -> str:
        return self._names.get("name", "")

    def setGroupName(self, name: str) -> None:
        self._names["name"] = name

    def getGroupDesc(self) -> str:
        return self._names.get("desc", "")

    def setGroupDesc(self, desc: str) -> None:
        self._names["desc"] = desc

    @property
    def group_name(self) -> str:
        return self.getGroupName()

    @property
    def group_desc(self) -> str:
        return self.getGroupDesc()

    @property
    def communicator(self):
        """The ddl_triton Communicator this group runs on."""
        return self._comm

    def __repr__(self) -> str:
        return f"DdlProcessGroup(rank={self._comm.rank}, size={self._comm.size})"

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """Reduce one tensor across ranks in place (``tensors`` is ``[tensor]``)."""
        opts = _reduce_opts(opts, _c10d.AllreduceOptions)
        tensor = _single(tensors, "allreduce")
        _check_device("allreduce", tensor)
        op, factor = _op(opts.reduceOp, "allreduce")
        wire, finish = _reduce_stage(tensor, op, "allreduce")
        _premultiply(wire, factor, "allreduce")
        return self._run(lambda a: self._comm.allreduce(wire, op=op, async_op=a), [tensor], opts, finish)

    def allreduce_coalesced(self, tensors, opts=None):
        """Allreduce every tensor of ``tensors`` (one flat collective per dtype)."""
        opts = _reduce_opts(opts, _c10d.AllreduceCoalescedOptions)
        tensors = list(tensors)
        _check_device("allreduce_coalesced", *tensors)
        op, factor = _op(opts.reduceOp, "allreduce_coalesced")
        calls, finishes = [], []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            wire, finish = _reduce_stage(flat, op, "allreduce_coalesced")
            _premultiply(wire, factor, "allreduce_coalesced")
            calls.append(lambda a, w=wire: self._comm.allreduce(w, op=op, async_op=a))
            finishes += [f for f in (finish, lambda g=group, f=flat: _unflatten_into(g, f)) if f]
        return self._run_many(calls, tensors, opts, _chain(finishes))

    def reduce_scatter_single(self, output, input, opts=None):
        """Rank r receives block r of the reduction of ``input`` (``size`` blocks of ``output``'s size)."""
        opts = _reduce_opts(opts, _c10d.ReduceScatterOptions)
        _check_device("reduce_scatter_tensor", output, input)
        op, factor = _op(opts.reduceOp, "reduce_scatter_tensor")
        inp, _ = _reduce_stage(input, op, "reduce_scatter_tensor", copy=factor is not None or _shares(output, input))
        _premultiply(inp, factor, "reduce_scatter_tensor")
        out, finish = _reduce_stage(output, op, "reduce_scatter_tensor", fresh=True)
        return self._run(lambda a: self._comm.reduce_scatter(out, inp, op=op, async_op=a), [output], opts, finish)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """List form: ``input_tensors[0][q]`` is this rank's contribution to rank q's ``output_tensors[0]``."""
        output = _single(output_tensors, "reduce_scatter")
        inputs = _single_list(input_tensors, "reduce_scatter", self._comm.size)
        _check_same("reduce_scatter", output, inputs)
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return self.reduce_scatter_single(output, flat, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``reduce_scatter_single`` on each (output, input) pair, in order, as one Work."""
        opts = _reduce_opts(opts, _c10d.ReduceScatterOptions)
        works = [self.reduce_scatter_single(o, i, _async(opts, _c10d.ReduceScatterOptions))
                 for o, i in _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")]
        return _join_torch_works(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors, opts=None):
        """Reduce into rank ``opts.rootRank``'s tensor; other ranks' tensors are left unchanged."""
        opts = _reduce_opts(opts, _c10d.ReduceOptions)
        tensor = _single(tensors, "reduce")
        root = _root(opts.rootRank, self._comm.size, "reduce")
        work_copy = tensor.clone()
        ar = _c10d.AllreduceOptions()
        ar.reduceOp, ar.asyncOp = opts.reduceOp, getattr(opts, "asyncOp", True)
        finish = (lambda: tensor.copy_(work_copy)) if self._comm.rank == root else None
        return _then(self.allreduce([work_copy], ar), [tensor], finish)

    # -- copies --------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        """Copy rank ``opts.rootRank``'s tensor into every rank's, in place."""
        opts = _plain_opts(opts, _c10d.BroadcastOptions)
        tensor = _single(tensors, "broadcast")
        _check_device("broadcast", tensor)
        root = _root(opts.rootRank, self._comm.size, "broadcast")
        if opts.rootTensor != 0:
            raise ValueError(f"ddl backend: broadcast rootTensor must be 0, got {opts.rootTensor}")
        wire, finish = _copy_stage(tensor)
        return self._run(lambda a: self._comm.broadcast(wire, root=root, async_op=a), [tensor], opts, finish)

    def all_gather_single(self, output, input, opts=None):
        """Block r of ``output`` (``input.numel()`` elements) becomes rank r's ``input``."""
        opts = _plain_opts(opts, _c10d.AllgatherOptions)
        _check_device("all_gather_into_tensor", output, input)
        inp, _ = _copy_stage(input, copy=_shares(output, input))  # FSDP2 gathers in place
        out, finish = _copy_stage(output, fresh=True)
        return self._run(lambda a: self._comm.all_gather(out, inp, async_op=a), [output], opts, finish)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        """List form: ``output_tensors[0][q]`` becomes rank q's ``input_tensors[0]``."""
        input = _single(input_tensors, "allgather")
        outputs = _single_list(output_tensors, "allgather", self._comm.size)
        _check_same("allgather", input, outputs)
        flat = torch.empty(self._comm.size * input.numel(), dtype=input.dtype, device=input.device)
        work = self.all_gather_single(flat, input, opts)
        return _then(work, outputs, lambda: _unflatten_into(outputs, flat))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_single`` on each (output, input) pair, in order, as one Work."""
        opts = _plain_opts(opts, _c10d.AllgatherOptions)
        works = [self.all_gather_single(o, i, _async(opts, _c10d.AllgatherOptions))
                 for o, i in _pairs(outputs, inputs, "all_gather_into_tensor_coalesced")]
        return _join_torch_works(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``allgather`` of each input into its output list, in order, as one Work."""
        opts = _plain_opts(opts, _c10d.AllgatherOptions)
        works = [self.allgather([outs], [inp], _async(opts, _c10d.AllgatherOptions))
                 for outs, inp in _pairs(output_lists, input_tensors, "allgather_coalesced")]
        return _join_torch_works(works, [t for outs in output_lists for t in outs])

    def gather(self, output_tensors, input_tensors, opts=None):
        """Rank ``opts.rootRank`` receives every rank's tensor in ``output_tensors[0]``."""
        opts = _plain_opts(opts, _c10d.GatherOptions)
        input = _single(input_tensors, "gather")
        root = _root(opts.rootRank, self._comm.size, "gather")
        outputs = _single_list(output_tensors, "gather", self._comm.size) if self._comm.rank == root else []
        _check_same("gather", input, outputs)
        flat = torch.empty(self._comm.size * input.numel(), dtype=input.dtype, device=input.device)
        work = self.all_gather_single(flat, input, _async(opts, _c10d.AllgatherOptions))
        return _then(work, outputs, lambda: _unflatten_into(outputs, flat))

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Rank q receives ``input_tensors[0][q]`` of rank ``opts.rootRank`` in ``output_tensors[0]``."""
        opts = _plain_opts(opts, _c10d.ScatterOptions)
        output = _single(output_tensors, "scatter")
        root = _root(opts.rootRank, self._comm.size, "scatter")
        if self._comm.rank == root:
            inputs = _single_list(input_tensors, "scatter", self._comm.size)
            _check_same("scatter", output, inputs)
            flat = torch.cat([t.reshape(-1) for t in inputs])
        else:
            flat = torch.empty(self._comm.size * output.numel(), dtype=output.dtype, device=output.device)
        bc = _c10d.BroadcastOptions()
        bc.rootRank, bc.asyncOp = root, getattr(opts, "asyncOp", True)
        n, r = output.numel(), self._comm.rank
        return _then(self.broadcast([flat], bc), [output],
                     lambda: output.copy_(flat[r * n:(r + 1) * n].view(output.shape)))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Dim-0 slice q of ``input`` goes to rank q; slice q of ``output`` comes from rank q.

        Empty split lists mean equal slices (one ddl_triton all_to_all); uneven splits run as an
        MPI all-to-all on the group's private MPI communicator."""
        opts = _plain_opts(opts, _c10d.AllToAllOptions)
        _check_device("all_to_all_single", output, input)
        size = self._comm.size
        out_splits = _splits(output_split_sizes, output, size, "output")
        in_splits = _splits(input_split_sizes, input, size, "input")
        if len(set(out_splits + in_splits)) <= 1 and output.numel() == input.numel():
            inp, _ = _copy_stage(input, copy=_shares(output, input))
            out, finish = _copy_stage(output, fresh=True)
            return self._run(lambda a: self._comm.all_to_all(out, inp, async_op=a), [output], opts, finish)
        _check_device("all_to_all_single with uneven splits", output, input, gpu=False)
        return self._alltoallv([output], [input], [out_splits], [in_splits], opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """List form: ``input_tensors[q]`` goes to rank q; ``output_tensors[q]`` comes from rank q."""
        opts = _plain_opts(opts, _c10d.AllToAllOptions)
        size = self._comm.size
        outputs, inputs = list(output_tensors), list(input_tensors)
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"ddl backend: alltoall needs {size} input and {size} output tensors, "
                             f"got {len(inputs)} and {len(outputs)}")
        _check_device("alltoall", *outputs, *inputs)
        if len({t.numel() for t in outputs + inputs}) == 1 and len({t.dtype for t in outputs + inputs}) == 1:
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty_like(flat_in)
            work = self.all_to_all_single(flat_out, flat_in, [], [], opts)
            return _then(work, outputs, lambda: _unflatten_into(outputs, flat_out))
        _check_device("alltoall of unequal tensors", *outputs, *inputs, gpu=False)
        return self._alltoallv(outputs, inputs, [[1] * size], [[1] * size], opts, per_tensor=True)

    # -- synchronisation and point to point ----------------------------------------------------
    def barrier(self, opts=None):
        """Complete once every rank of the group has entered the barrier."""
        opts = _plain_opts(opts, _c10d.BarrierOptions)
        return self._run(lambda a: self._comm.barrier(async_op=a), [], opts)

    def send(self, tensors, dst_rank, tag=0):
        """Send ``tensors[0]`` to group rank ``dst_rank``; matched by the receiver's (source, tag)."""
        tensor = _single(tensors, "send")
        _check_device("send", tensor, gpu=False)
        return _torch_work(self._p2p.send(tensor, _root(dst_rank, self._comm.size, "send"), tag), [tensor])

    def recv(self, tensors, src_rank, tag=0):
        """Receive into ``tensors[0]`` from group rank ``src_rank`` (the message must match in bytes)."""
        tensor = _single(tensors, "recv")
        _check_device("recv", tensor, gpu=False)
        return _torch_work(self._p2p.recv(tensor, _root(src_rank, self._comm.size, "recv"), tag), [tensor])

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("ddl backend: recv without a source rank is not supported; pass src=")

    def shutdown(self) -> None:
        """Release the point-to-point communicator, and the Communicator if this group created it."""
        self._p2p.close()
        if self._owns_comm:
            _close_communicator(self._comm)
            self._owns_comm = False

    def abort(self) -> None:
        self.shutdown()

    # -- plumbing --------------------------------------------------------------------------------
    def _run(self, call, outputs, opts, finish=None):
        """Run ``call(async_op)`` inline when ``opts.asyncOp`` is false, else in the background."""
        return self._run_many([call], outputs, opts, finish)

    def _run_many(self, calls, outputs, opts, finish=None):
        if not getattr(opts, "asyncOp", True):
            for call in calls:
                call(False)
            if finish is not None:
                finish()
            return _completed_work(outputs)
        works = [call(True) for call in calls]
        return _torch_work(works, outputs, finish)

    def _alltoallv(self, outputs, inputs, out_splits, in_splits, opts, per_tensor=False):
        """Uneven all-to-all as one MPI Ialltoallv in bytes on the private MPI communicator."""
        work = self._p2p.alltoallv(outputs, inputs, out_splits, in_splits, per_tensor)
        torch_work = _torch_work(work, outputs)
        if not getattr(opts, "asyncOp", True):
            torch_work.wait()
        return torch_work


# -- point to point ----------------------------------------------------------------------------------
class _PointToPoint:
    """Buffer-method MPI messages on a private communicator: requests are posted on the caller's
    thread (so MPI matches them in program order) and completed by one background thread."""

    def __init__(self, mpi_comm, timeout: float, rank: int):
        self._mpi = mpi_comm
        self._timeout = timeout
        self._rank = rank
        self._runner = OrderedRunner(f"ddl_triton-p2p-rank{rank}")
        self._closed = False

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        from mpi4py import MPI

        data = _as_bytes(tensor.detach().contiguous())
        req = self._mpi.Isend([data.numpy(), data.numel(), MPI.BYTE], dest=dst, tag=_tag(tag))
        return self._complete(req, None, f"send to {dst} (tag {tag})", keep=(data,))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        from mpi4py import MPI

        staging = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = _as_bytes(staging)
        req = self._mpi.Irecv([data.numpy(), data.numel(), MPI.BYTE], source=src, tag=_tag(tag))
        return self._complete(req, lambda: tensor.copy_(staging), f"recv from {src} (tag {tag})", keep=(data,))

    def alltoallv(self, outputs, inputs, out_splits, in_splits, per_tensor: bool) -> Work:
        """Slices (per dim-0 row, or whole tensors when ``per_tensor``) exchanged as bytes."""
        from mpi4py import MPI

        send = torch.cat([_as_bytes(t.detach().contiguous()) for t in inputs])
        stagings = [torch.empty(t.shape, dtype=t.dtype) for t in outputs]
        recv = torch.empty(sum(_nbytes(t) for t in outputs), dtype=torch.uint8)
        scounts = _byte_counts(inputs, in_splits, per_tensor)
        rcounts = _byte_counts(outputs, out_splits, per_tensor)
        req = self._mpi.Ialltoallv([send.numpy(), (scounts, _displs(scounts)), MPI.BYTE],
                                   [recv.numpy(), (rcounts, _displs(rcounts)), MPI.BYTE])

        def finish():
            offset = 0
            for out, st in zip(outputs, stagings):
                n = _nbytes(st)
                _as_bytes(st).copy_(recv[offset:offset + n])
                out.copy_(st)
                offset += n

        return self._complete(req, finish, "all_to_all (uneven splits)", keep=(send,))

    def _complete(self, req, finish, what: str, keep=()) -> Work:
        def job():
            _ = keep  # the message buffers live until the request completes
            self._wait(req, what)
            if finish is not None:
                finish()
        return self._runner.submit(job, what)

    def _wait(self, req, what: str) -> None:
        deadline = time.monotonic() + self._timeout
        pause = 0.0
        while not req.Test():
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"rank {self._rank}: {what} timed out after {self._timeout:g} s")
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


# -- Work and futures ---------------------------------------------------------------------------------
class _Promise:
    """A torch Future to complete from Python with a result or a real (C++-visible) error.

    ``torch.futures.Future.set_exception`` only stores the exception as the value, so C++ waiters
    (Work.wait, DDP) would take it for a result; an error raised in a ``then`` callback is a true
    future error. So: complete ``_source`` with the outputs or a ``_Failure``; ``future`` unwraps."""

    def __init__(self):
        self._source = torch.futures.Future()
        self.future = self._source.then(_unwrap)
        self.error: BaseException | None = None  # as raised, for Work.wait to re-raise

    def settle(self, error, finish=None, outputs=()) -> None:
        """Run ``finish`` (copy-back) then resolve with ``outputs``, or fail with ``error`` (or what
        ``finish`` raised). Never raises: it runs on ddl_triton's background threads, which must
        survive a failing callback."""
        try:
            if error is None and finish is not None:
                finish()
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            error = e
        self.error = error
        try:
            self._source.set_result(_Failure(error) if error is not None else outputs)
        except BaseException:  # noqa: BLE001 - a failing torch callback is torch's to report
            pass

    def work(self):
        return _FutureWork(self.future, self)


class _FutureWork(dist.Work):
    """The torch Work of one call: ``wait()`` blocks until ``future`` resolves and re-raises its
    error as raised (a Work from ``_create_work_from_future`` would swallow it; the future itself
    carries it as a RuntimeError quoting it); ``get_future()`` is ``future``."""

    def __init__(self, future, promise: _Promise | None = None):
        super().__init__()
        self._future = future
        self._promise = promise

    def wait(self, timeout=None) -> bool:
        """Block until done (ddl_triton's own deadline, DDL_TIMEOUT, bounds the wait); raise its error."""
        try:
            self._future.wait()
        except Exception:
            original = self._promise.error if self._promise is not None else None
            if isinstance(original, Exception):
                raise original from None
            raise
        return True

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:  # noqa: BLE001
            return False
        return True

    def result(self):
        return self._future.wait()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(source):
    value = source.value()
    if isinstance(value, _Failure):
        raise value.error if isinstance(value.error, Exception) else RuntimeError(repr(value.error))
    return value


def _torch_work(works, outputs, finish=None):
    """A torch Work whose future gets ``outputs`` once every ddl Work of ``works`` is done and
    ``finish()`` (copy-back) has run; any error goes to the future instead."""
    works = works if isinstance(works, list) else [works]
    promise = _Promise()

    def done():
        error = next((w.exception() for w in works if w.exception() is not None), None)
        promise.settle(error, finish, outputs)

    _when_all(works, done)
    return promise.work()


def _when_all(works, callback) -> None:
    """Call ``callback()`` once every ddl Work in ``works`` is complete (at once if none)."""
    if not works:
        callback()
        return
    remaining = [len(works)]
    lock = threading.Lock()

    def one(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for w in works:
        w.add_done_callback(one)


def _completed_work(outputs):
    fut = torch.futures.Future()
    fut.set_result(outputs)
    return _FutureWork(fut)


def _then(torch_work, outputs, finish=None):
    """A Work completed after ``torch_work`` and ``finish()``, with ``outputs`` as its result."""
    promise = _Promise()

    def done(_):
        try:
            torch_work.wait()  # done already: this only re-raises its error, as raised
        except Exception as e:  # noqa: BLE001
            promise.settle(e)
            return
        promise.settle(None, finish, outputs)

    torch_work.get_future().add_done_callback(done)
    return promise.work()


def _join_torch_works(torch_works, outputs):
    """One Work for several torch Works: done when all are, with ``outputs`` as its result."""
    if not torch_works:
        return _completed_work(outputs)
    promise = _Promise()

    def done(_):
        error = None
        for w in torch_works:
            try:
                w.wait()  # done already: this only re-raises its error, as raised
            except Exception as e:  # noqa: BLE001
                error = error or e
        promise.settle(error, None, outputs)

    torch.futures.collect_all([w.get_future() for w in torch_works]).add_done_callback(done)
    return promise.work()


# -- argument helpers -----------------------------------------------------------------------------------
def _reduce_opts(opts, kind):
    """Accept an options object, a ReduceOp, or None (torch's pybind overloads allow all three)."""
    if opts is None:
        return kind()
    if isinstance(opts, (ReduceOp, _RED)):
        o = kind()
        o.reduceOp = opts
        return o
    return opts


def _plain_opts(opts, kind):
    return kind() if opts is None else opts


def _async(opts, kind):
    o = kind()
    o.asyncOp = getattr(opts, "asyncOp", True)
    return o


def _op(op, what: str) -> tuple[str, float | None]:
    """(ddl op name, premultiplier or None) for a torch ReduceOp; ValueError naming others."""
    kind = getattr(op, "op", op)  # a ReduceOp carries its RedOpType in .op
    if kind in _OP_NAMES:
        return _OP_NAMES[kind], None
    if kind == _RED.PREMUL_SUM and isinstance(getattr(op, "factor", None), (int, float)):
        return "sum", float(op.factor)
    name = getattr(kind, "name", repr(kind))
    raise ValueError(f"ddl backend: {what} does not support ReduceOp.{name}; supported: SUM, AVG, MIN, MAX "
                     "(and PREMUL_SUM with a float factor)")


def _premultiply(wire: torch.Tensor, factor: float | None, what: str) -> None:
    """PREMUL_SUM: scale this rank's contribution (floating dtypes only) before summing."""
    if factor is None:
        return
    if not wire.is_floating_point():
        raise ValueError(f"ddl backend: {what} with ReduceOp.PREMUL_SUM needs a floating dtype, got {wire.dtype}")
    wire.mul_(factor)


def _single(tensors, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    tensors = list(tensors)
    if len(tensors) != 1:
        raise ValueError(f"ddl backend: {what} takes exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _single_list(lists, what: str, size: int) -> list[torch.Tensor]:
    lists = list(lists)
    if len(lists) != 1:
        raise ValueError(f"ddl backend: {what} takes one tensor list per rank, got {len(lists)}")
    tensors = list(lists[0])
    if len(tensors) != size:
        raise ValueError(f"ddl backend: {what} needs a list of {size} tensors (the group size), got {len(tensors)}")
    return tensors


def _pairs(outputs, inputs, what: str):
    outputs, inputs = list(outputs), list(inputs)
    if len(outputs) != len(inputs):
        raise ValueError(f"ddl backend: {what} got {len(outputs)} outputs for {len(inputs)} inputs")
    return list(zip(outputs, inputs))


def _check_same(what: str, ref: torch.Tensor, others) -> None:
    for t in others:
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            raise ValueError(f"ddl backend: {what} needs every tensor to match {ref.numel()} x {ref.dtype}, "
                             f"got {t.numel()} x {t.dtype} (uneven sizes are not supported)")


def _check_device(what: str, *tensors, gpu: bool = True) -> None:
    """Tensors on the CPU, or on CUDA when this process has the GPU path and ``what`` runs on it
    (the collectives do; point-to-point and uneven all-to-all go through MPI on host memory)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ddl backend: {what} expects tensors, got {type(t).__name__}")
        if t.device.type == "cpu":
            continue
        if t.is_cuda and gpu and gpu_path.available():
            continue
        where = ("it runs on CPU tensors only" if t.is_cuda and not gpu else
                 "this process has no GPU path" if t.is_cuda else "only CPU and CUDA tensors are supported")
        raise ValueError(f"ddl backend: {what} got a tensor on {t.device}; {where}: move the tensor to the CPU")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"ddl backend: {what} got tensors on several devices: {sorted(map(str, devices))}")


def _root(root: int, size: int, what: str) -> int:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"ddl backend: {what} rank {root!r} is not a rank of this group (size {size})")
    return root


def _tag(tag: int) -> int:
    if not 0 <= tag <= _P2P_TAG_BOUND:
        raise ValueError(f"ddl backend: tag {tag} outside 0..{_P2P_TAG_BOUND}")
    return tag


def _splits(split_sizes, t: torch.Tensor, size: int, what: str) -> list[int]:
    """Rows per rank along dim 0; an empty list means ``size`` equal slices."""
    rows = t.shape[0] if t.dim() else 1
    if not split_sizes:
        if rows % size:
            raise ValueError(f"ddl backend: all_to_all_single {what} has {rows} rows, not divisible "
                             f"by the group size {size}; pass split sizes")
        return [rows // size] * size
    splits = [int(s) for s in split_sizes]
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(f"ddl backend: all_to_all_single {what} splits {splits} must be {size} sizes "
                         f"summing to {rows}")
    return splits


# -- staging: ddl_triton moves DTYPES; anything else is staged through them exactly -----------------
def _copy_stage(t: torch.Tensor, fresh: bool = False, copy: bool = False):
    """(wire tensor, finish) for a copy-only collective. Supported dtypes go as they are (a copy when
    ``copy``); others as their raw bytes, widened into int32 (or viewed as int32/int64 when the
    element size allows). ``fresh``: an output whose current contents do not matter."""
    if t.dtype in DTYPES:
        return (t.clone() if copy else t), None
    item = t.element_size()
    flat = t.detach().contiguous().reshape(-1)
    if fresh:
        flat = torch.empty(flat.shape, dtype=t.dtype, device=t.device)
    raw = _as_bytes(flat)
    wire = raw.view(torch.int64) if item % 8 == 0 else raw.view(torch.int32) if item % 4 == 0 else raw.to(torch.int32)

    def finish():
        back = wire.view(torch.uint8) if item % 4 == 0 else wire.to(torch.uint8)
        t.copy_(back.view(t.dtype).view(t.shape))

    return wire, finish


def _reduce_stage(t: torch.Tensor, op: str, what: str, fresh: bool = False, copy: bool = False):
    """(wire tensor, finish) for a reduction: supported dtypes as they are (a copy when ``copy``),
    bool/int8/uint8/int16 widened to int64 (exact; narrowing back wraps like native overflow)."""
    if t.dtype in DTYPES:
        return (t.clone() if copy else t), None
    if t.dtype not in _WIDENED:
        raise TypeError(f"ddl backend: {what} cannot reduce dtype {t.dtype}; supported: "
                        f"{', '.join(str(d).replace('torch.', '') for d in DTYPES + _WIDENED)}")
    wire = torch.empty(t.shape, dtype=torch.int64, device=t.device) if fresh else t.to(torch.int64)

    def finish():
        t.copy_(wire)

    return wire, finish


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage (an in-place collective: the input is a slice of the output)."""
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous ``t``."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _byte_counts(tensors, splits, per_tensor: bool) -> list[int]:
    if per_tensor:
        return [_nbytes(t) for t in tensors]
    t = tensors[0]
    row = _nbytes(t) // max(1, t.shape[0] if t.dim() else 1)
    return [s * row for s in splits[0]]


def _displs(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _unflatten_into(tensors, flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


def _chain(fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None

    def run():
        for f in fns:
            f()
    return run


def _close_communicator(comm) -> None:
    import ddl_triton as ddl

    if comm is getattr(ddl, "_world", None):
        ddl.finalize()
    else:
        comm.close()


# -- creation -----------------------------------------------------------------------------------------
def create_process_group(common_opts, backend_opts=None) -> DdlProcessGroup:
    """torch's creator hook (extended API): the group over MPI ranks ``global_ranks_in_group`` (all of
    COMM_WORLD for the default group), after checking torch's rank and size agree with MPI's."""
    from mpi4py import MPI

    import ddl_triton as ddl

    world = MPI.COMM_WORLD
    rank, size = common_opts.group_rank, common_opts.group_size
    members = list(common_opts.global_ranks_in_group)
    if not members:  # the default group
        _check_matches_mpi(rank, size, world)
        owns = getattr(ddl, "_world", None) is None
        comm = ddl.init()
        return DdlProcessGroup(comm, world.Dup(), owns_comm=owns)
    if dist.get_rank() != world.Get_rank():
        raise ValueError(f"ddl backend: the default process group's rank {dist.get_rank()} differs from the "
                         f"MPI rank {world.Get_rank()}; a 'ddl' subgroup needs them equal")
    world_group = world.Get_group()
    sub_group = world_group.Incl(members)
    sub = world.Create_group(sub_group)
    world_group.Free()
    sub_group.Free()
    try:
        comm = ddl.init(sub)
        p2p = sub.Dup()
    finally:
        sub.Free()
    if comm.rank != rank or comm.size != size:
        raise ValueError(f"ddl backend: subgroup {members}: torch expects rank {rank} of {size}, "
                         f"MPI gives {comm.rank} of {comm.size}")
    return DdlProcessGroup(comm, p2p, owns_comm=True)


def _check_matches_mpi(rank: int, size: int, comm) -> None:
    """Raise ValueError on every rank of ``comm`` if any rank's torch (rank, size) is not its MPI one.

    Collective: a rank that raised alone would leave the others waiting in the next collective."""
    from mpi4py import MPI

    mine = (rank, size) != (comm.Get_rank(), comm.Get_size())
    if not comm.allreduce(int(mine), op=MPI.MAX):  # control path: one int
        return
    what = (f"torch.distributed was given rank {rank} of world size {size}, but MPI launched this process "
            f"as rank {comm.Get_rank()} of {comm.Get_size()}") if mine else \
        "another rank was given a rank or world size that is not its MPI one"
    raise ValueError(f"ddl backend: {what}; the 'ddl' backend's ranks are MPI's (launch with mpiexec/ddlrun, "
                     "and pass matching rank/world_size, or none)")


# -- rendezvous ----------------------------------------------------------------------------------------
def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpiexec, ddlrun, srun with PMI) started this process."""
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """Rendezvous handler for ``ddl://``: yields (TCPStore, MPI rank, MPI size).

    Rank 0 starts the store on a free port and broadcasts host and port over MPI; ranks on rank
    0's host connect to 127.0.0.1. ``rank``/``world_size`` in the URL (torch puts explicit
    arguments there) must agree with MPI's."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
        given_rank = int(query.get("rank", os.environ.get("RANK", rank)))
        given_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", size)))
        if given_size == -1:
            given_size = size
        if given_rank == -1:
            given_rank = rank
        _check_matches_mpi(given_rank, given_size, comm)
        host = socket.gethostname()
        store = None
        if rank == 0:
            store = dist.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
            address = (host, store.port)
        else:
            address = None
        address = comm.bcast(address, root=0)  # control path: one small object, once
        if rank != 0:
            peer_host = "127.0.0.1" if address[0] == host else address[0]
            store = dist.TCPStore(peer_host, address[1], size, False, timeout)
    finally:
        comm.Free()
    yield store, rank, size
    raise RuntimeError("ddl:// rendezvous cannot re-rendezvous")


def _env_or_mpi(original):
    """Wrap torch's ``env://`` handler: unchanged when MASTER_ADDR is set or MPI did not launch this
    process; otherwise (where torch would fail) rendezvous over MPI."""
    def handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
        if os.environ.get("MASTER_ADDR") or not launched_by_mpi():
            yield from original(url, timeout=timeout, **kwargs)
        else:
            yield from mpi_rendezvous(url, timeout=timeout, **kwargs)
    handler._ddl_wraps = original
    return handler


def register() -> None:
    """Register backend "ddl" (CPU and CUDA) and the ``ddl://`` rendezvous, and let ``env://`` fall back to MPI.

    Idempotent."""
    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    if plugin is None or plugin.creator_fn is not create_process_group:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (dist.rendezvous is a function)
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if handlers is None:
        return
    if RENDEZVOUS_SCHEME not in handlers:
        rdzv.register_rendezvous_handler(RENDEZVOUS_SCHEME, mpi_rendezvous)
    env = handlers.get("env")
    if env is not None and not hasattr(env, "_ddl_wraps"):
        handlers["env"] = _env_or_mpi(env)
