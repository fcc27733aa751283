"""The "ddl" ProcessGroup: torch.distributed's operations on a ddl_triton Communicator.

Semantics: every operation has torch.distributed's meaning (same arguments, same results,
in place where torch's is), runs on CPU tensors, or on CUDA tensors through the
communicator's GPU path (ddl_triton/runtime/calls/gpu_path.py; not send/recv or uneven all-to-all, which
move host memory), and returns a ``Work`` whose ``get_future()`` resolves with the output
tensors when the operation completes, or carries its error (futures.py). Calls issued with
``async_op=False`` run inline; the others run on the communicator's background thread,
always in issue order.

Supported: allreduce (SUM, AVG, MIN, MAX, PREMUL_SUM with a float factor; PRODUCT, BAND, BOR
and BXOR as an all-gather and a fold in rank order),
allreduce_coalesced, broadcast, allgather (list form, into one tensor, and coalesced),
reduce_scatter (list form, from one tensor, and coalesced), alltoall (list form and single
tensor, even or uneven splits), barrier, reduce, gather, scatter, send and recv (with a
source rank). Any dtype is moved exactly by the copy-only operations; reductions take the
floating types, int32/int64, and bool/int8/uint8/int16 (reduced in int64): staging.py.

Collectives go to the Communicator; send, recv and uneven all-to-all to the group's
point-to-point (point_to_point.py: MPI or gloo, after the bootstrap). Groups are created by
torch through ddl_triton/torch/backend.py, never directly.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch.distributed import ReduceOp

from ..runtime.lanes.farewell import Leaving
from .arguments import (async_opts, chain, check_device, check_same, one_list, one_tensor, pairs, plain_opts,
                        reduce_opts, root_rank, split_rows)
from .compile_boundary import eager_methods
from .futures import completed_work, join_torch_works, then, torch_work
from .level_compression import LevelCompression, buffer_key
from .staging import copy_stage, reduce_stage, shares, unflatten_into

BACKEND_NAME = "ddl"

_RED = ReduceOp.RedOpType
_OP_NAMES = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MIN: "min", _RED.MAX: "max"}
# Reductions ddl_triton's kernels do not run: every rank gathers every contribution and folds them
# in rank order (the same bits everywhere), at size times the traffic. Rarely used; always exact.
_FOLDS = {_RED.PRODUCT: ("product", torch.mul), _RED.BAND: ("band", torch.bitwise_and),
          _RED.BOR: ("bor", torch.bitwise_or), _RED.BXOR: ("bxor", torch.bitwise_xor)}
_FOLD_NAMES = {name: fn for name, fn in _FOLDS.values()}


@eager_methods  # torch.compile runs the group as it would a C++ one: never traced (compile_boundary.py)
class DdlProcessGroup(dist.ProcessGroup):
    """torch.distributed ProcessGroup over a ddl_triton Communicator, and a point-to-point
    (point_to_point.py) for send, recv and uneven all-to-all. Created by torch's
    ``init_process_group``/``new_group`` with backend "ddl" (backend.py); ``owns_comm``: the
    group closes the communicator at shutdown."""

    def __init__(self, comm, p2p, owns_comm: bool):
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._owns_comm = owns_comm
        self._names: dict[str, str] = {}
        self._p2p = p2p
        # Options.compression: DDP-sized float allreduces compressed between hosts only (opt-in: lossy).
        self._compression = LevelCompression(comm, comm.options.compression) \
            if comm.options.compression != "none" else None

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

    @property
    def compression(self):
        """The per-level compression of ``Options.compression`` (level_compression.py: its
        ``explain(nbytes)`` says what a size sends between hosts, and why), or None when "none"."""
        return self._compression

    def __repr__(self) -> str:
        return f"DdlProcessGroup(rank={self._comm.rank}, size={self._comm.size})"

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """Reduce one tensor across ranks in place (``tensors`` is ``[tensor]``)."""
        opts = reduce_opts(opts, _c10d.AllreduceOptions)
        tensor = one_tensor(tensors, "allreduce")
        check_device("allreduce", tensor)
        op, factor = _op(opts.reduceOp, "allreduce")
        if op in _FOLD_NAMES:
            return self._folded(tensor, op, opts, "allreduce")
        wire, finish = reduce_stage(tensor, op, "allreduce")
        _premultiply(wire, factor, "allreduce")
        lc = self._compression
        if lc is not None and lc.takes(wire, op):
            key = buffer_key(tensor)     # DDP's bucket buffers persist: each keeps its residual
            # Here, not in the issue below: a first decision is collective, and one inside backward
            # is stamped with its place there (level_compression.py).
            method = lc.decide(wire.numel() * 4, calling=True).method
            # woken at once: its Work is made outside the queue, so nothing would wake a held call
            return self._run(lambda a: lc.allreduce(wire, key, method, op=op, async_op=a), [tensor], opts, finish,
                             hold=False)
        return self._run(lambda a: self._comm.allreduce(wire, op=op, async_op=a), [tensor], opts, finish)

    def allreduce_coalesced(self, tensors, opts=None):
        """Allreduce every tensor of ``tensors`` (one flat collective per dtype)."""
        opts = reduce_opts(opts, _c10d.AllreduceCoalescedOptions)
        tensors = list(tensors)
        check_device("allreduce_coalesced", *tensors)
        op, factor = _op(opts.reduceOp, "allreduce_coalesced")
        if op in _FOLD_NAMES:
            works = [self._folded(t, op, async_opts(opts, _c10d.AllreduceOptions), "allreduce_coalesced")
                     for t in tensors]
            return join_torch_works(works, tensors)
        calls, finishes = [], []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            wire, finish = reduce_stage(flat, op, "allreduce_coalesced")
            _premultiply(wire, factor, "allreduce_coalesced")
            calls.append(lambda a, w=wire: self._comm.allreduce(w, op=op, async_op=a))
            finishes += [f for f in (finish, lambda g=group, f=flat: unflatten_into(g, f)) if f]
        return self._run_many(calls, tensors, opts, chain(finishes))

    def reduce_scatter_single(self, output, input, opts=None):
        """Rank r receives block r of the reduction of ``input`` (``size`` blocks of ``output``'s size)."""
        opts = reduce_opts(opts, _c10d.ReduceScatterOptions)
        check_device("reduce_scatter_tensor", output, input)
        op, factor = _op(opts.reduceOp, "reduce_scatter_tensor")
        if op in _FOLD_NAMES:
            return self._folded(input, op, opts, "reduce_scatter_tensor", output=output)
        inp, _ = reduce_stage(input, op, "reduce_scatter_tensor", copy=factor is not None or shares(output, input))
        _premultiply(inp, factor, "reduce_scatter_tensor")
        out, finish = reduce_stage(output, op, "reduce_scatter_tensor", fresh=True)
        return self._run(lambda a: self._comm.reduce_scatter(out, inp, op=op, async_op=a), [output], opts, finish)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """List form: ``input_tensors[0][q]`` is this rank's contribution to rank q's ``output_tensors[0]``."""
        output = one_tensor(output_tensors, "reduce_scatter")
        inputs = one_list(input_tensors, "reduce_scatter", self._comm.size)
        check_same("reduce_scatter", output, inputs)
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return self.reduce_scatter_single(output, flat, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``reduce_scatter_single`` on each (output, input) pair, in order, as one Work."""
        opts = reduce_opts(opts, _c10d.ReduceScatterOptions)
        return self._pairwise(self.reduce_scatter_single, outputs, inputs, opts, _c10d.ReduceScatterOptions,
                              "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors, opts=None):
        """Reduce into rank ``opts.rootRank``'s tensor; other ranks' tensors are left unchanged."""
        opts = reduce_opts(opts, _c10d.ReduceOptions)
        tensor = one_tensor(tensors, "reduce")
        root = root_rank(opts.rootRank, self._comm.size, "reduce")
        work_copy = tensor.clone()
        ar = _c10d.AllreduceOptions()
        ar.reduceOp, ar.asyncOp = opts.reduceOp, getattr(opts, "asyncOp", True)
        finish = (lambda: tensor.copy_(work_copy)) if self._comm.rank == root else None
        return then(self.allreduce([work_copy], ar), [tensor], finish)

    # -- copies --------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        """Copy rank ``opts.rootRank``'s tensor into every rank's, in place."""
        opts = plain_opts(opts, _c10d.BroadcastOptions)
        tensor = one_tensor(tensors, "broadcast")
        check_device("broadcast", tensor)
        root = root_rank(opts.rootRank, self._comm.size, "broadcast")
        if opts.rootTensor != 0:
            raise ValueError(f"ddl backend: broadcast rootTensor must be 0, got {opts.rootTensor}")
        wire, finish = copy_stage(tensor)
        return self._run(lambda a: self._comm.broadcast(wire, root=root, async_op=a), [tensor], opts, finish)

    def all_gather_single(self, output, input, opts=None):
        """Block r of ``output`` (``input.numel()`` elements) becomes rank r's ``input``."""
        opts = plain_opts(opts, _c10d.AllgatherOptions)
        check_device("all_gather_into_tensor", output, input)
        inp, _ = copy_stage(input, copy=shares(output, input))  # FSDP2 gathers in place
        out, finish = copy_stage(output, fresh=True)
        return self._run(lambda a: self._comm.all_gather(out, inp, async_op=a), [output], opts, finish)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        """List form: ``output_tensors[0][q]`` becomes rank q's ``input_tensors[0]``."""
        input = one_tensor(input_tensors, "allgather")
        outputs = one_list(output_tensors, "allgather", self._comm.size)
        check_same("allgather", input, outputs)
        flat = torch.empty(self._comm.size * input.numel(), dtype=input.dtype, device=input.device)
        work = self.all_gather_single(flat, input, opts)
        return then(work, outputs, lambda: unflatten_into(outputs, flat))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_single`` on each (output, input) pair, in order, as one Work."""
        opts = plain_opts(opts, _c10d.AllgatherOptions)
        return self._pairwise(self.all_gather_single, outputs, inputs, opts, _c10d.AllgatherOptions,
                              "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``output_lists[q][i]`` becomes rank q's ``input_tensors[i]``, for every input i, as one Work."""
        opts = plain_opts(opts, _c10d.AllgatherOptions)
        size = self._comm.size
        output_lists, inputs = [list(outs) for outs in output_lists], list(input_tensors)
        if len(output_lists) != size or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(f"ddl backend: allgather_coalesced needs {size} output lists (one per rank) of "
                             f"{len(inputs)} tensors (one per input), got {[len(o) for o in output_lists]}")
        works = [self.allgather([[output_lists[q][i] for q in range(size)]], [inp],
                                async_opts(opts, _c10d.AllgatherOptions))
                 for i, inp in enumerate(inputs)]
        return join_torch_works(works, [t for outs in output_lists for t in outs])

    def gather(self, output_tensors, input_tensors, opts=None):
        """Rank ``opts.rootRank`` receives every rank's tensor in ``output_tensors[0]``."""
        opts = plain_opts(opts, _c10d.GatherOptions)
        input = one_tensor(input_tensors, "gather")
        root = root_rank(opts.rootRank, self._comm.size, "gather")
        outputs = one_list(output_tensors, "gather", self._comm.size) if self._comm.rank == root else []
        check_same("gather", input, outputs)
        flat = torch.empty(self._comm.size * input.numel(), dtype=input.dtype, device=input.device)
        work = self.all_gather_single(flat, input, async_opts(opts, _c10d.AllgatherOptions))
        return then(work, outputs, lambda: unflatten_into(outputs, flat))

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Rank q receives ``input_tensors[0][q]`` of rank ``opts.rootRank`` in ``output_tensors[0]``."""
        opts = plain_opts(opts, _c10d.ScatterOptions)
        output = one_tensor(output_tensors, "scatter")
        root = root_rank(opts.rootRank, self._comm.size, "scatter")
        if self._comm.rank == root:
            inputs = one_list(input_tensors, "scatter", self._comm.size)
            check_same("scatter", output, inputs)
            flat = torch.cat([t.reshape(-1) for t in inputs])
        else:
            flat = torch.empty(self._comm.size * output.numel(), dtype=output.dtype, device=output.device)
        bc = _c10d.BroadcastOptions()
        bc.rootRank, bc.asyncOp = root, getattr(opts, "asyncOp", True)
        n, r = output.numel(), self._comm.rank
        return then(self.broadcast([flat], bc), [output],
                     lambda: output.copy_(flat[r * n:(r + 1) * n].view(output.shape)))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Dim-0 slice q of ``input`` goes to rank q; slice q of ``output`` comes from rank q.

        Empty split lists mean equal slices (one ddl_triton all_to_all); uneven splits run as one
        all-to-all of bytes on the group's point-to-point (MPI or gloo)."""
        opts = plain_opts(opts, _c10d.AllToAllOptions)
        check_device("all_to_all_single", output, input)
        size = self._comm.size
        out_splits = split_rows(output_split_sizes, output, size, "output")
        in_splits = split_rows(input_split_sizes, input, size, "input")
        if len(set(out_splits + in_splits)) <= 1 and output.numel() == input.numel():
            inp, _ = copy_stage(input, copy=shares(output, input))
            out, finish = copy_stage(output, fresh=True)
            return self._run(lambda a: self._comm.all_to_all(out, inp, async_op=a), [output], opts, finish)
        check_device("all_to_all_single with uneven splits", output, input, gpu=False)
        return self._alltoallv([output], [input], [out_splits], [in_splits], opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """List form: ``input_tensors[q]`` goes to rank q; ``output_tensors[q]`` comes from rank q."""
        opts = plain_opts(opts, _c10d.AllToAllOptions)
        size = self._comm.size
        outputs, inputs = list(output_tensors), list(input_tensors)
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"ddl backend: alltoall needs {size} input and {size} output tensors, "
                             f"got {len(inputs)} and {len(outputs)}")
        check_device("alltoall", *outputs, *inputs)
        if len({t.numel() for t in outputs + inputs}) == 1 and len({t.dtype for t in outputs + inputs}) == 1:
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty_like(flat_in)
            work = self.all_to_all_single(flat_out, flat_in, [], [], opts)
            return then(work, outputs, lambda: unflatten_into(outputs, flat_out))
        check_device("alltoall of unequal tensors", *outputs, *inputs, gpu=False)
        return self._alltoallv(outputs, inputs, [[1] * size], [[1] * size], opts, per_tensor=True)

    # -- synchronisation and point to point ----------------------------------------------------
    def barrier(self, opts=None):
        """Complete once every rank of the group has entered the barrier."""
        opts = plain_opts(opts, _c10d.BarrierOptions)
        return self._run(lambda a: self._comm.barrier(async_op=a), [], opts)

    def send(self, tensors, dst_rank, tag=0):
        """Send ``tensors[0]`` to group rank ``dst_rank``; matched by the receiver's (source, tag)."""
        tensor = one_tensor(tensors, "send")
        check_device("send", tensor, gpu=False)
        return torch_work(self._p2p.send(tensor, root_rank(dst_rank, self._comm.size, "send"), tag), [tensor])

    def recv(self, tensors, src_rank, tag=0):
        """Receive into ``tensors[0]`` from group rank ``src_rank`` (the message must match in bytes)."""
        tensor = one_tensor(tensors, "recv")
        check_device("recv", tensor, gpu=False)
        return torch_work(self._p2p.recv(tensor, root_rank(src_rank, self._comm.size, "recv"), tag), [tensor])

    def recv_anysource(self, tensors, tag=0):
        """Receive into ``tensors[0]`` the first message with ``tag`` from any rank; the Work's
        ``_source_rank()`` names the sender."""
        tensor = one_tensor(tensors, "recv")
        check_device("recv", tensor, gpu=False)
        work, source = self._p2p.recv_anysource(tensor, tag)
        result = torch_work(work, [tensor])
        result.source = lambda: source[0]
        return result

    def shutdown(self) -> None:
        """Release the point-to-point communicator, and the Communicator if this group created it."""
        self._p2p.close()
        if self._compression is not None:
            self._compression.close(Leaving.DESTROYED_GROUP)
        if self._owns_comm:
            _close_communicator(self._comm)
            self._owns_comm = False

    def abort(self) -> None:
        self.shutdown()

    # -- plumbing --------------------------------------------------------------------------------
    def _folded(self, input, op: str, opts, what: str, output=None):
        """A reduction by ``op`` (see _FOLDS) as an all-gather, then a fold in rank order: the
        whole ``input`` when ``output`` is None (allreduce, in place), else block ``rank`` of
        it into ``output`` (reduce_scatter)."""
        if op != "product" and (input.is_floating_point() or input.is_complex()):
            raise ValueError(f"ddl backend: {what} with ReduceOp.{op.upper()} needs an integer or bool dtype, "
                             f"got {input.dtype}")
        size, rank = self._comm.size, self._comm.rank
        flat = input.detach().reshape(-1).clone()
        gathered = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
        work = self.all_gather_single(gathered, flat, async_opts(opts, _c10d.AllgatherOptions))
        fold = _FOLD_NAMES[op]

        def finish():
            rows = gathered.view(size, -1)
            acc = rows[0].clone()
            for q in range(1, size):
                acc = fold(acc, rows[q])
            if output is None:
                input.copy_(acc.view(input.shape))
            else:
                n = output.numel()
                output.copy_(acc[rank * n:(rank + 1) * n].view(output.shape))

        return then(work, [input if output is None else output], finish)

    def _pairwise(self, single, outputs, inputs, opts, options_type, what: str):
        """``single(output, input, opts)`` on each pair, in order, joined into one Work."""
        works = [single(o, i, async_opts(opts, options_type)) for o, i in pairs(outputs, inputs, what)]
        return join_torch_works(works, list(outputs))

    def _run(self, call, outputs, opts, finish=None, hold: bool = True):
        """Run ``call(async_op)`` inline when ``opts.asyncOp`` is false, else in the background."""
        return self._run_many([call], outputs, opts, finish, hold)

    def _run_many(self, calls, outputs, opts, finish=None, hold: bool = True):
        if not getattr(opts, "asyncOp", True):
            for call in calls:
                call(False)
            if finish is not None:
                finish()
            return completed_work(outputs)
        # DDP's reducer asks for the Work's future right after this returns, through a second
        # call into Python. Woken now, the communicator's thread would take the GIL and backward
        # would wait for it (0.4-0.7 ms per bucket on a busy core); get_future wakes it instead
        # (as do wait, is_completed and any later call).
        issuing = self._comm.waking_later() if hold and _called_from_cpp_backward() else contextlib.nullcontext()
        with issuing:
            return torch_work(lambda: [call(True) for call in calls], outputs, finish)

    def _alltoallv(self, outputs, inputs, out_splits, in_splits, opts, per_tensor=False):
        """Uneven all-to-all as one all-to-all of bytes on the group's point-to-point."""
        work = torch_work(self._p2p.alltoallv(outputs, inputs, out_splits, in_splits, per_tensor), outputs)
        if not getattr(opts, "asyncOp", True):
            work.wait()
        return work


def _called_from_cpp_backward() -> bool:
    """Whether the backend method running was called by C++ code inside autograd's backward
    (DDP's reducer, from a gradient hook), not through torch.distributed's Python API: the first
    Python frame outside this module is the autograd engine's entry, or there is none (an
    autograd thread of its own)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame is None or frame.f_globals.get("__name__") == "torch.autograd.graph"


def _op(op, what: str) -> tuple[str, float | None]:
    """(ddl op name, premultiplier or None) for a torch ReduceOp; ValueError naming others."""
    kind = getattr(op, "op", op)  # a ReduceOp carries its RedOpType in .op
    if kind in _OP_NAMES:
        return _OP_NAMES[kind], None
    if kind in _FOLDS:
        return _FOLDS[kind][0], None
    if kind == _RED.PREMUL_SUM and isinstance(getattr(op, "factor", None), (int, float)):
        return "sum", float(op.factor)
    name = getattr(kind, "name", repr(kind))
    raise ValueError(f"ddl backend: {what} does not support ReduceOp.{name}; supported: SUM, AVG, MIN, MAX, "
                     "PRODUCT, BAND, BOR, BXOR (and PREMUL_SUM with a float factor)")


def _premultiply(wire: torch.Tensor, factor: float | None, what: str) -> None:
    """PREMUL_SUM: scale this rank's contribution (floating dtypes only) before summing."""
    if factor is None:
        return
    if not wire.is_floating_point():
        raise ValueError(f"ddl backend: {what} with ReduceOp.PREMUL_SUM needs a floating dtype, got {wire.dtype}")
    wire.mul_(factor)


def _close_communicator(comm) -> None:
    """Close the group's communicator; its peers hear that this rank destroyed its process group."""
    from ..runtime import world

    if comm is world.current():
        world.finalize(Leaving.DESTROYED_GROUP)
    else:
        comm.close(Leaving.DESTROYED_GROUP)
