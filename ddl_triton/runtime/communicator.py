"""The Communicator: validate a call, plan a schedule, run it on the transports.

Every collective follows one path:

    validate (before any communication, errors name the rank and the problem: validation.py)
      -> plan    (ddl_triton/planning/planner.py: forced, else tuning table, else cost model;
                  decided once per call shape: plan_cache.py)
      -> stage   (flatten; non-contiguous data goes through a contiguous copy;
                  sum/avg of 16-bit data on a multi-hop schedule runs in fp32)
      -> run     (executor, in issue order; async calls on a background thread: issue.py)
      -> unstage (copy back into the caller's tensor, rounding 16-bit once)

This module wires the pieces together and runs the calls. Where each rank sits and how each
peer is reached is the placement (placement.py), the transports per peer the wiring
(wiring.py), the tuning table every rank agrees on table_agreement.py, and what a new
communicator turns on to be observed observing.py.
"""
from __future__ import annotations

import contextlib

import torch

from .lanes import call_check as calls
from .calls import gpu_path
from .. import kernels, schedules
from ..errors import call_name, wait_failed
from ..ops import check_op_dtype, normalize_op
from ..options import Options
from ..planning.planner import Plan, Planner
from ..transports.waits import PeerTimeout, wait_until
from .setup.bootstrap import MpiBootstrap, StoreBootstrap
from .calls.executor import Executor
from .calls.issue import IssuePath
from .setup.mpich_segment import release_init_segment
from .calls.observing import start_observing
from .setup.option_agreement import agree_on_options
from .setup.placement import place
from .calls.plan_cache import PlanCache
from .lanes.small_allreduce import SmallAllreduce
from .lanes.small_allreduce_two_sided import SmallAllreduceTwoSided, lane_dtype
from .setup.table_agreement import agree_on_planner
from .calls.arguments import check_output_input, check_root, check_tensor
from .setup.wiring import connect

_PROFILER = torch.autograd  # .profiler._is_profiler_enabled: torch's own fast "is it recording" flag
_SMALL_PATH = "one_shot (small-message path)"
_SMALL_BROADCAST = "one_shot (small-message path across hosts)"


class Communicator:
    """A group of ranks that run collectives together. Create it with ``ddl_triton.init``.

    Public state: ``rank``, ``size``, ``topology``, ``placement`` (placement.py), ``options``
    (in force: a tuning table may bring its slot layout) and ``requested_options`` (as given:
    init compares later requests with these)."""

    _count = 0  # communicators created in this process

    def __init__(self, bootstrap, options: Options):
        """``bootstrap``: how the ranks find each other (ddl_triton/runtime/setup/bootstrap.py), or an mpi4py
        communicator, which is duplicated (our messages never meet the application's)."""
        self.options = options
        self.requested_options = options
        # MPI is initialized (issue.py imports it, under torchrun too: a singleton), so MPICH's
        # segment has every rank of the host on it: unlink it before any way of ending can skip
        # that, a failed init (options that differ, a rank that never arrives) included.
        release_init_segment()
        is_bootstrap = isinstance(bootstrap, (MpiBootstrap, StoreBootstrap))
        self._bootstrap = bootstrap if is_bootstrap else MpiBootstrap(bootstrap, timeout=options.timeout)
        try:
            # The first exchange: ranks given different options learn it here, by name, before
            # anything is built whose layout the options decide (option_agreement.py).
            agree_on_options(self._bootstrap, options)
            if options.schedule and options.schedule not in schedules.names():
                raise ValueError(f"rank {self._bootstrap.rank}: unknown schedule {options.schedule!r} "
                                 f"(DDL_SCHEDULE); valid: {', '.join(schedules.names())}")
        except BaseException:
            if not is_bootstrap:
                self._bootstrap.close()  # the duplicate made here; a caller's bootstrap stays the caller's
            raise
        self.rank: int = self._bootstrap.rank
        self.size: int = self._bootstrap.size
        self._seq = 0
        Communicator._count += 1
        comm_id = Communicator._count  # tells this communicator's records from others' in a dump
        kernels.set_backend(options.kernels)
        self.placement = place(self._bootstrap, options)  # who is where; how each peer is reached
        self.topology = self.placement.topology
        self._planner, self.options = agree_on_planner(self._bootstrap, self.placement, options)
        wiring = connect(self.placement, self._bootstrap, self.options)
        # The control channel (fingerprint exchange, barrier, clock alignment): the private MPI
        # communicator, or, on a store bootstrap, the gloo transport.
        self._transports, route, shm, self._comm = wiring.transports, wiring.route, wiring.shm, wiring.control
        self._lane = wiring.lane  # the call lane over MPI or gloo (call_lane.py), or None
        every_peer_on_shm = self.placement.every_peer_on_shm
        self._calls = calls.CallChecker(self._lane, self.rank, self.size,
                                        shm if every_peer_on_shm else None, options.timeout,
                                        describe=self.placement.describe) if options.check_calls else None
        self._executor = Executor(self.rank, self.size, route, timeout=options.timeout,
                                  depth=options.pipeline_depth)
        self._executor.describe = self.placement.describe  # errors name a lost peer's host
        # hierarchical_native is a candidate where the inter-node transport runs group steps itself.
        self._planner.group_engines = not every_peer_on_shm and self._executor.group_engines
        self._gpu = gpu_path.GpuPath(self.placement, self.options, self._comm)  # built on the first CUDA collective
        self._small = SmallAllreduce(shm, self.rank, self.size, self.placement.on_node, options.timeout, self._calls) \
            if every_peer_on_shm and shm is not None else \
            SmallAllreduceTwoSided(self._lane) if self._lane is not None else None
        self._plans = PlanCache(self._planner, self.rank, self.size, self.options.debug)
        if self._small is not None:
            self._planner.small_path = self._small.serves
        self._issuer = IssuePath(self.rank, comm_id, self._attach, timeout=options.timeout)
        self.tracer = start_observing(self._bootstrap, self.placement, self.options, self._planner, self._comm,
                                      comm_id)

    # -- public collectives -----------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op="sum", async_op: bool = False):
        """Reduce ``tensor`` across ranks in place; every rank gets the same bits. Returns it."""
        if not async_op and type(tensor) is torch.Tensor:
            # The synchronous fast entry (the latency path): a shape the small path has served
            # before, with nothing queued, running, failed or recording in the way.
            fast = self._plans.fast.get((op, tensor.dtype, tensor.numel()))
            if fast is not None and tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
                issuer = self._issuer
                runner = issuer.runner
                if not (runner._queue or runner._running or issuer.poison is not None or issuer.closed
                        or _PROFILER.profiler._is_profiler_enabled):
                    # Recorded and validated like every call, without the issue machinery; the
                    # same protocol as the general entry's small path, so ranks may mix the two.
                    shape, call = fast
                    seq = self._seq = self._seq + 1
                    issuer.run_inline(call, _SMALL_PATH, self._run_small, self._plans.fast_view(tensor, shape),
                                      shape, seq)
                    return tensor
        given_op, op = op, normalize_op(op, self.rank)
        self._issuer.check_usable()
        check_tensor(self.rank, tensor, "tensor", writable=True)
        check_op_dtype(op, tensor.dtype, self.rank)
        job = lambda: self._allreduce(tensor, op, given_op)  # noqa: E731
        return self._issuer.issue(job, async_op, ("allreduce", op, tensor.numel(), tensor.dtype, None))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum", async_op: bool = False):
        """Rank r receives block r of the reduction of ``input`` (``size`` blocks of ``output.numel()``)."""
        op = normalize_op(op, self.rank)
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "reduce_scatter", output, input)
        check_op_dtype(op, output.dtype, self.rank)
        job = lambda: self._staged("reduce_scatter", output, input, op)  # noqa: E731
        return self._issuer.issue(job, async_op, ("reduce_scatter", op, input.numel(), input.dtype, None))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Block r of ``output`` (``input.numel()`` elements) is rank r's ``input``."""
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "all_gather", output, input)
        job = lambda: self._staged("all_gather", output, input)  # noqa: E731
        return self._issuer.issue(job, async_op, ("all_gather", None, input.numel(), input.dtype, None))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Block q of ``input`` goes to rank q; block q of ``output`` comes from rank q (equal blocks)."""
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "all_to_all", output, input)
        job = lambda: self._staged("all_to_all", output, input)  # noqa: E731
        return self._issuer.issue(job, async_op, ("all_to_all", None, input.numel(), input.dtype, None))

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False):
        """Copy ``tensor`` from rank ``root`` to every rank, in place. Returns it."""
        self._issuer.check_usable()
        check_tensor(self.rank, tensor, "tensor", writable=True)
        check_root(self.rank, self.size, root)
        job = lambda: self._broadcast(tensor, root)  # noqa: E731
        return self._issuer.issue(job, async_op, ("broadcast", None, tensor.numel(), tensor.dtype, root))

    def barrier(self, async_op: bool = False):
        """Return once every rank has entered the barrier (deadline-bounded)."""
        self._issuer.check_usable()
        return self._issuer.issue(self._barrier, async_op, ("barrier", None, 0, None, None))

    def explain(self, collective: str, nbytes: int, dtype=torch.float32) -> Plan:
        """The schedule this communicator would run for ``collective`` on ``nbytes`` of ``dtype``, and why."""
        if collective not in schedules.COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(schedules.COLLECTIVES)}")
        plan = self._planner.plan(collective, nbytes, dtype)
        if collective == "allreduce" and self._plans.takes_small_path(self._small, nbytes // dtype.itemsize, dtype):
            where = ("every peer on shm", "small_allreduce.py") if isinstance(self._small, SmallAllreduce) else \
                (f"every peer through the call lane on {self._lane.counter.name}", "small_allreduce_two_sided.py")
            return Plan(plan.schedule, plan.chunk_elems, plan.reason + f"; runs the small-message path "
                        f"({where[0]} and {nbytes} B <= {self._small.limit} B: ddl_triton/runtime/{where[1]})",
                        estimates=plan.estimates)
        return plan

    def close(self) -> None:
        """Finish queued work, then release the transports and the private MPI communicator."""
        if self._issuer.closed:
            return
        self._issuer.close()
        if self.tracer is not None:
            self.tracer.flush()
        self._gpu.close()
        self._plans.forget()
        self._small = None  # its views of the segments go before the segments
        if self._lane is not None:
            self._lane.close()  # the MPI lane's communicator goes before the bootstrap's
        for t in self._transports:
            t.close()
        self._bootstrap.close()  # the private MPI communicator, if any

    # -- seams for the tuner, the torch backend, benchmarks and the world -----------------
    @property
    def planner(self) -> Planner:
        """The Planner this communicator plans with (read-only: its table and cost model are fixed)."""
        return self._planner

    @contextlib.contextmanager
    def forcing(self, plan: Plan):
        """Run every collective inside the block with ``plan`` (the tuner's way to time a candidate)."""
        self._plans.forget()
        try:
            with self._planner.overriding(plan):
                yield
        finally:
            self._plans.forget()

    @property
    def tracer(self):
        """The timeline this communicator records to (observability/tracer.py), or None. Setting it
        (a benchmark comparing tracing on and off) takes effect from the next collective."""
        return self._issuer.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self._issuer.tracer = self._executor.tracer = tracer

    def waking_later(self):
        """Context manager: calls this thread issues inside the block do not wake the background
        thread until their Work is waited on or released, or a later call comes (work.py)."""
        return self._issuer.runner.waking_later()

    @property
    def bootstrap(self):
        """How the ranks found each other (bootstrap.py); ``bootstrap.kind`` is "mpi" or "store"."""
        return self._bootstrap

    @property
    def transport_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received so far, per transport name (payload only)."""
        out: dict[str, dict[str, int]] = {}
        for t in self._transports + self._gpu.transports:
            entry = out.setdefault(t.name, {"sent": 0, "received": 0})
            entry["sent"] += t.bytes_sent
            entry["received"] += t.bytes_received
        return out

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- running -------------------------------------------------------------------------
    def _attach(self, record) -> None:
        """Tell the executor in use (tests swap ``_executor``) which call's record it runs."""
        self._executor.record = record

    def _checked(self, collective: str, op, dtype, numel: int, root: int, run, on_gpu: bool = False) -> None:
        """Run ``run()`` between the call checker's begin and end (see fingerprints.py)."""
        if self._calls is None:
            run()
        else:
            self._calls.checked(self._seq, collective, op, dtype, numel, root, run, on_gpu)

    def _execute(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int,
                 op: str = "sum", root: int = 0) -> None:
        self._seq += 1
        self._checked(collective, op if collective in ("allreduce", "reduce_scatter") else None, inbuf.dtype,
                      inbuf.numel(), root, lambda: self._run(collective, inbuf, outbuf, count, op, root),
                      on_gpu=inbuf.is_cuda)

    def _run(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int, op: str,
             root: int) -> None:
        record = self._executor.record
        schedule, run_dtype, ctx = self._plans.prepare(collective, count, inbuf.numel(), inbuf.dtype, op, root)
        if record is not None:
            record.schedule = schedule.name
        if inbuf.is_cuda:
            self._gpu.run(schedule, inbuf, outbuf, run_dtype, ctx, self._seq, record, self.tracer)
        else:
            self._executor.run_widened(schedule, inbuf, outbuf, ctx, self._seq, run_dtype)

    def _allreduce(self, tensor: torch.Tensor, op: str, given_op=None) -> torch.Tensor:
        flat = _flat_work(tensor)
        shape = self._plans.small_shape(self._small, op, flat, given_op) if flat.is_cpu else None
        if shape is not None:
            self._seq += 1
            if self._executor.record is not None:
                self._executor.record.schedule = _SMALL_PATH
            self._run_small(flat.detach().numpy(), shape, self._seq)
        else:
            self._execute("allreduce", flat, flat, flat.numel(), op)
        _write_back(tensor, flat)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        flat = _flat_work(tensor)
        shape = self._plans.small_broadcast_shape(self._small, flat, root) if flat.is_cpu else None
        if shape is None:
            return self._staged("broadcast", tensor, None, root=root)
        self._seq += 1
        if self._executor.record is not None:
            self._executor.record.schedule = _SMALL_BROADCAST
        # One element counts as contiguous whatever its stride: numpy and dtype views need stride 1.
        work = flat if flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)
        array = work.detach().view(lane_dtype(work.dtype))
        try:
            self._small.broadcast(array.numpy(), shape, self._seq, root)  # type: ignore[union-attr]
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name("broadcast", self._seq, _SMALL_BROADCAST, "copy"), e,
                              self.options.timeout, self.placement.describe) from None
        if work is not flat:
            flat.copy_(work)
        _write_back(tensor, flat)
        return tensor

    def _run_small(self, array, shape, seq: int) -> None:
        """The one_shot allreduce of a small tensor on the shm lane (small_allreduce.py) or the
        call lane across a two-sided transport (small_allreduce_two_sided.py)."""
        try:
            self._small.run(array, shape, seq)  # type: ignore[union-attr]
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name("allreduce", seq, _SMALL_PATH, "reduce"), e,
                              self.options.timeout, self.placement.describe) from None

    def _staged(self, collective: str, output: torch.Tensor, input: torch.Tensor | None, op: str = "sum",
                root: int = 0) -> torch.Tensor:
        """Run ``collective`` from ``input`` (None: in place) into ``output`` through flat
        contiguous views, or copies of strided tensors, written back once done."""
        out = _flat_work(output)
        inp = out if input is None else input.contiguous().view(-1)
        count = inp.numel() // self.size if collective == "all_to_all" else \
            inp.numel() if collective == "all_gather" else out.numel()
        self._execute(collective, inp, out, count, op, root)
        _write_back(output, out)
        return output

    def _barrier(self) -> None:
        self._seq += 1
        if self._calls is not None:
            # Comparing call fingerprints already waits for every rank to arrive: that is a barrier.
            self._checked("barrier", None, None, 0, 0, lambda: None)
        else:
            self._mpi_barrier()

    def _mpi_barrier(self) -> None:
        if self._comm is None:
            return  # a store bootstrap of one rank: nobody to wait for
        req = self._comm.Ibarrier()  # MPI's, or the gloo transport's on a store bootstrap
        try:
            wait_until(req.Test, self.options.timeout, -1, "barrier")
        except PeerTimeout as e:  # MPI cannot say who is missing: the placement narrows it, with hosts
            raise wait_failed(self.rank, call_name("barrier", self._seq), e, self.options.timeout,
                              self.placement.describe) from None


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


