"""The Communicator: validate a call, plan a schedule, run it on the transports.

Every collective follows one path:

    validate (before any communication, errors name the rank and the problem)
      -> plan    (schedule name + chunking, and the reason for the choice)
      -> stage   (flatten; non-contiguous data goes through a contiguous copy;
                  sum/avg of 16-bit data on a multi-hop schedule runs in fp32)
      -> run     (executor, in issue order; async calls on a background thread)
      -> unstage (copy back into the caller's tensor, rounding 16-bit once)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from mpi4py import MPI

from . import kernels, schedules
from .errors import CollectiveTimeout, CommunicatorPoisoned, DDLError
from .executor import CallContext, Executor
from .ops import DTYPES, SIXTEEN_BIT, check_op_dtype, normalize_op
from .options import Options
from .transports.base import PeerTimeout, wait_until
from .transports.mpi import MpiTransport
from .transports.self import SelfTransport
from .transports.shm import ShmTransport
from .work import OrderedRunner


@dataclass(frozen=True)
class Plan:
    """What ``explain`` reports: the schedule, its parameters and why it was chosen."""

    schedule: str
    chunk_elems: int
    reason: str


class Communicator:
    """A group of ranks that run collectives together. Create it with ``ddl_triton.init``."""

    def __init__(self, mpi_comm, options: Options):
        self.options = options
        self._comm = mpi_comm.Dup()  # private: our messages never meet the application's
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self._seq = 0
        self._prepared: dict[tuple, tuple] = {}
        self._poison: BaseException | None = None
        self._closed = False
        kernels.set_backend(options.kernels)
        self._transports, route = self._connect()
        self._executor = Executor(self.rank, self.size, route, timeout=options.timeout,
                                  depth=options.pipeline_depth)
        self._runner = OrderedRunner(f"ddl_triton-rank{self.rank}")

    def _connect(self):
        """Choose a transport per peer: shm inside the node, MPI between nodes (or everywhere)."""
        if self.size == 1:
            loop = SelfTransport()
            return [loop], [loop]
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            on_node = node.allgather(self.rank)
        except BaseException:
            node.Free()
            raise
        transports: list = []
        route: list = [None] * self.size
        mpi = MpiTransport(self._comm)
        transports.append(mpi)
        use_shm = self.options.transport == "auto" and len(on_node) > 1
        if use_shm:
            shm = ShmTransport(node, on_node, slot_bytes=self.options.chunk_bytes, depth=self.options.pipeline_depth)
            transports.append(shm)
        node.Free()
        if len(on_node) > len(os.sched_getaffinity(0)):
            # More ranks than cores here: a spinning wait would hold the core its peer needs.
            for t in transports:
                t.spin = 0.0
        for p in range(self.size):
            if p != self.rank:
                route[p] = shm if use_shm and p in on_node else mpi
        return transports, route

    # -- public collectives -----------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op="sum", async_op: bool = False):
        """Reduce ``tensor`` across ranks in place; every rank gets the same bits. Returns it."""
        op = normalize_op(op, self.rank)
        self._check_usable()
        self._check_tensor(tensor, "tensor", writable=True)
        check_op_dtype(op, tensor.dtype, self.rank)
        job = lambda: self._allreduce(tensor, op)  # noqa: E731
        return self._issue(job, lambda: f"allreduce({op}, {tensor.numel()} x {tensor.dtype})", async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum", async_op: bool = False):
        """Rank r receives block r of the reduction of ``input`` (``size`` blocks of ``output.numel()``)."""
        op = normalize_op(op, self.rank)
        self._check_usable()
        self._check_tensor(output, "output", writable=True)
        self._check_tensor(input, "input")
        self._check_pair(output, input)
        if input.numel() != self.size * output.numel():
            raise ValueError(f"rank {self.rank}: reduce_scatter needs input.numel() == size * output.numel() "
                             f"({self.size} * {output.numel()}), got {input.numel()}")
        check_op_dtype(op, output.dtype, self.rank)
        job = lambda: self._reduce_scatter(output, input, op)  # noqa: E731
        return self._issue(job, lambda: f"reduce_scatter({op}, {output.numel()} x {output.dtype})", async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Block r of ``output`` (``input.numel()`` elements) is rank r's ``input``."""
        self._check_usable()
        self._check_tensor(output, "output", writable=True)
        self._check_tensor(input, "input")
        self._check_pair(output, input)
        if output.numel() != self.size * input.numel():
            raise ValueError(f"rank {self.rank}: all_gather needs output.numel() == size * input.numel() "
                             f"({self.size} * {input.numel()}), got {output.numel()}")
        job = lambda: self._all_gather(output, input)  # noqa: E731
        return self._issue(job, lambda: f"all_gather({input.numel()} x {input.dtype})", async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False):
        """Copy ``tensor`` from rank ``root`` to every rank, in place. Returns it."""
        self._check_usable()
        self._check_tensor(tensor, "tensor", writable=True)
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"rank {self.rank}: broadcast root {root!r} is not a rank of this "
                             f"communicator (size {self.size})")
        job = lambda: self._broadcast(tensor, root)  # noqa: E731
        return self._issue(job, lambda: f"broadcast(root {root}, {tensor.numel()} x {tensor.dtype})", async_op)

    def barrier(self, async_op: bool = False):
        """Return once every rank has entered the barrier (deadline-bounded)."""
        self._check_usable()
        return self._issue(self._barrier, lambda: "barrier", async_op)

    def explain(self, collective: str, nbytes: int, dtype=torch.float32) -> Plan:
        """The schedule this communicator would run for ``collective`` on ``nbytes`` of ``dtype``, and why."""
        if collective not in schedules.COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(schedules.COLLECTIVES)}")
        return self._plan(collective, nbytes, torch.empty(0, dtype=dtype).element_size())

    def close(self) -> None:
        """Finish queued work, then release the transports and the private MPI communicator."""
        if self._closed:
            return
        self._runner.close()
        self._closed = True
        for t in self._transports:
            t.close()
        if not MPI.Is_finalized():
            self._comm.Free()

    @property
    def transport_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received so far, per transport name (payload only)."""
        return {t.name: {"sent": t.bytes_sent, "received": t.bytes_received} for t in self._transports}

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- validation ----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise DDLError(f"rank {self.rank}: communicator is closed")
        if self._poison is not None:
            raise CommunicatorPoisoned(f"rank {self.rank}: communicator unusable after an earlier failure: "
                                       f"{self._poison}") from self._poison

    def _check_tensor(self, t, name: str, writable: bool = False) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rank {self.rank}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"rank {self.rank}: {name} has unsupported dtype {t.dtype}; "
                            f"supported: {', '.join(str(d).replace('torch.', '') for d in DTYPES)}")
        if not t.is_cpu:
            raise ValueError(f"rank {self.rank}: {name} is on {t.device}, but this communicator has no "
                             "GPU path; move it to the CPU")
        # Only a non-contiguous tensor can have a stride of 0 over a dimension longer than 1.
        if writable and not t.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
            raise ValueError(f"rank {self.rank}: {name} has overlapping elements (a stride of 0, e.g. "
                             "from expand()); writing a result into it is ambiguous: pass a .clone()")

    def _check_pair(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.dtype != input.dtype:
            raise TypeError(f"rank {self.rank}: output is {output.dtype} but input is {input.dtype}")
        if output.numel() and input.numel():
            o0 = output.data_ptr()
            o1 = o0 + output.untyped_storage().nbytes()
            i0 = input.data_ptr()
            i1 = i0 + input.untyped_storage().nbytes()
            if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr() or (o0 < i1 and i0 < o1):
                raise ValueError(f"rank {self.rank}: output and input share memory; pass separate tensors")

    # -- planning ------------------------------------------------------------------------
    def _plan(self, collective: str, nbytes: int, elem: int) -> Plan:
        """Choose a schedule by size (or the forced one) and say why."""
        chunk_elems = max(1, self.options.chunk_bytes // elem)
        forced = self.options.schedule
        if forced:
            if forced not in schedules.names():
                raise ValueError(f"rank {self.rank}: unknown schedule {forced!r} (DDL_SCHEDULE); "
                                 f"valid: {', '.join(schedules.names())}")
            return Plan(forced, chunk_elems, "forced by DDL_SCHEDULE / Options.schedule")
        if nbytes <= self.options.small_bytes:
            return Plan("one_shot", chunk_elems,
                        f"{nbytes} B <= small_bytes {self.options.small_bytes}: one flag wait beats 2(n-1) hops")
        return Plan("ring", chunk_elems,
                    f"{nbytes} B > small_bytes {self.options.small_bytes}: ring moves the bandwidth-optimal "
                    "2(n-1)/n of the data, pipelined in chunks")

    def _prepare(self, collective: str, count: int, in_numel: int, dtype: torch.dtype, op: str, root: int):
        """(schedule, run dtype, op context) for a call shape, cached: the latency path is one dict lookup."""
        key = (collective, count, dtype, op, root)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        elem = dtype.itemsize
        plan = self._plan(collective, in_numel * elem, elem)
        schedule = schedules.build(plan.schedule, collective, self.size, count, chunk_elems=plan.chunk_elems,
                                   root=root)
        scale = 1.0 / self.size if op == "avg" else None
        reduce_op = "sum" if op == "avg" else op
        run_dtype = dtype
        if (collective in ("allreduce", "reduce_scatter") and dtype in SIXTEEN_BIT and reduce_op == "sum"
                and not schedule.single_pass):
            # Partial sums travel between ranks: carry them in fp32 and round once at the end.
            run_dtype = torch.float32
            schedule = schedules.build(plan.schedule, collective, self.size, count,
                                       chunk_elems=max(1, self.options.chunk_bytes // 4), root=root)
        if len(self._prepared) > 4096:
            self._prepared.clear()
        prepared = (schedule, run_dtype, CallContext(collective, reduce_op, scale))
        self._prepared[key] = prepared
        return prepared

    # -- execution -----------------------------------------------------------------------
    def _issue(self, job, describe, async_op: bool):
        """Run ``job`` in issue order; ``describe()`` names it for Work handles (built only when needed)."""
        if async_op:
            return self._runner.submit(lambda: self._guarded(job), describe())
        return self._runner.run_sync(lambda: self._guarded(job), describe)

    def _guarded(self, job):
        self._check_usable()  # an earlier queued collective may have failed
        try:
            return job()
        except DDLError as e:
            self._poison = e
            raise
        except Exception as e:
            self._poison = e
            raise DDLError(f"rank {self.rank}: collective failed: {e!r}") from e

    def _execute(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int,
                 op: str = "sum", root: int = 0) -> None:
        self._seq += 1
        schedule, run_dtype, ctx = self._prepare(collective, count, inbuf.numel(), inbuf.dtype, op, root)
        if run_dtype is inbuf.dtype:
            self._executor.run(schedule, inbuf, outbuf, ctx, self._seq)
            return
        wide_in = inbuf.to(run_dtype)
        wide_out = wide_in if outbuf is inbuf else torch.empty(outbuf.shape, dtype=run_dtype)
        self._executor.run(schedule, wide_in, wide_out, ctx, self._seq)
        outbuf.copy_(wide_out)  # the one rounding back to 16 bits

    def _allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        flat = _flat_work(tensor)
        self._execute("allreduce", flat, flat, flat.numel(), op)
        _write_back(tensor, flat)
        return tensor

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> torch.Tensor:
        inp = input.contiguous().view(-1)
        out = _flat_work(output)
        self._execute("reduce_scatter", inp, out, out.numel(), op)
        _write_back(output, out)
        return output

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        inp = input.contiguous().view(-1)
        out = _flat_work(output)
        self._execute("all_gather", inp, out, inp.numel())
        _write_back(output, out)
        return output

    def _broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        flat = _flat_work(tensor)
        self._execute("broadcast", flat, flat, flat.numel(), root=root)
        _write_back(tensor, flat)
        return tensor

    def _barrier(self) -> None:
        self._seq += 1
        req = self._comm.Ibarrier()
        try:
            wait_until(req.Test, self.options.timeout, -1, "barrier")
        except PeerTimeout:
            raise CollectiveTimeout(f"rank {self.rank}: barrier #{self._seq} timed out after "
                                    f"{self.options.timeout:g} s") from None


def _flat_work(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous view of ``t``, or a contiguous copy when ``t`` is strided."""
    if t.dim() == 1 and t.is_contiguous():
        return t  # already flat: a view would cost microseconds on the latency path
    if t.is_contiguous():
        return t.view(-1)
    return t.contiguous().view(-1)


def _write_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    if t.is_contiguous():
        return  # flat is a view of t: the result is already in place
    t.copy_(flat.view(t.shape))

