"""The Communicator: validate a call, plan a schedule, run it on the transports.

Every collective follows one path:

    validate (before any communication, errors name the rank and the problem)
      -> plan    (ddl_triton/planning/planner.py: forced, else tuning table, else cost model)
      -> stage   (flatten; non-contiguous data goes through a contiguous copy;
                  sum/avg of 16-bit data on a multi-hop schedule runs in fp32)
      -> run     (executor, in issue order; async calls on a background thread)
      -> unstage (copy back into the caller's tensor, rounding 16-bit once)
"""
from __future__ import annotations

import os
import contextlib
import sys
import time

import torch
from mpi4py import MPI

from . import fingerprints as calls, gpu_path, placement as placement_mod
from ..observability import flight
from .. import kernels, schedules
from ..launch import status
from ..tuning import table as tuning
from ..observability import tracer as tracer_mod
from ..planning.planner import Plan, Planner
from .small_allreduce import LANE_BYTES, SmallAllreduce
from ..errors import CollectiveMismatch, CollectiveTimeout, CommunicatorPoisoned, DDLError
from .executor import CallContext, Executor, step_error
from ..ops import DTYPES, SIXTEEN_BIT, check_op_dtype, normalize_op
from ..planning import topology as topology_mod
from ..options import Options
from ..planning.topology import Topology
from ..transports import failure_notice
from ..transports.base import PeerTimeout, wait_until
from ..transports import link_emulation
from .bootstrap import MpiBootstrap, StoreBootstrap
from ..transports.gloo import GlooTransport
from ..transports.mpi import MpiTransport
from ..transports.self import SelfTransport
from ..transports.shm import ShmTransport
from .wiring import connect
from .work import OrderedRunner

_PROFILER = torch.autograd  # .profiler._is_profiler_enabled: torch's own fast "is it recording" flag
_SMALL_PATH = "one_shot (small-message path)"


class Communicator:
    """A group of ranks that run collectives together. Create it with ``ddl_triton.init``."""

    _count = 0  # communicators created in this process

    def __init__(self, bootstrap, options: Options):
        """``bootstrap``: how the ranks find each other (ddl_triton/runtime/bootstrap.py), or an mpi4py
        communicator, which is duplicated (our messages never meet the application's)."""
        self.options = options              # in force (a tuning table may bring its slot layout)
        self._requested_options = options   # as given (init compares later requests with these)
        is_bootstrap = isinstance(bootstrap, (MpiBootstrap, StoreBootstrap))
        if options.schedule and options.schedule not in schedules.names():
            rank = bootstrap.rank if is_bootstrap else bootstrap.Get_rank()
            raise ValueError(f"rank {rank}: unknown schedule {options.schedule!r} (DDL_SCHEDULE); "
                             f"valid: {', '.join(schedules.names())}")
        self._bootstrap = bootstrap if is_bootstrap else MpiBootstrap(bootstrap)
        # The control channel (fingerprint exchange, barrier, clock alignment): the private MPI
        # communicator, or, on a store bootstrap, the gloo transport (set in _connect).
        self._comm = self._bootstrap.comm if self._bootstrap.kind == "mpi" else None
        self.rank: int = self._bootstrap.rank
        self.size: int = self._bootstrap.size
        self._seq = 0
        self._issued = 0                       # collectives issued (the flight recorder's sequence numbers)
        Communicator._count += 1
        self._id = Communicator._count         # tells this communicator's records from others' in a dump
        self._prepared: dict[tuple, tuple] = {}
        self._fingerprints: dict[tuple, tuple[int, ...]] = {}
        self._poison: BaseException | None = None
        self._closed = False
        kernels.set_backend(options.kernels)
        self.placement = placement_mod.place(self._bootstrap, options)  # who is where; how each peer is reached
        self.topology = self.placement.topology
        self._planner = self._make_planner()  # may adopt the table's slot layout into self.options
        wiring = connect(self.placement, self._bootstrap, self.options)
        self._transports, route, shm, self._comm = wiring.transports, wiring.route, wiring.shm, wiring.control
        every_peer_on_shm = self.placement.every_peer_on_shm
        self._calls = calls.CallChecker(self._comm, self.rank, self.size,
                                        shm if every_peer_on_shm else None, options.timeout) \
            if options.check_calls else None
        self._executor = Executor(self.rank, self.size, route, timeout=options.timeout,
                                  depth=options.pipeline_depth)
        self._gpu = gpu_path.GpuPath(self.placement, self.options, self._comm)  # built on the first CUDA collective
        self._small = SmallAllreduce(shm, self.rank, self.size, self.placement.on_node, options.timeout, self._calls) \
            if every_peer_on_shm and shm is not None else None
        self._small_shapes: dict[tuple[int, torch.dtype], bool] = {}  # (numel, dtype) -> takes the small path
        # (op, dtype, numel) -> (small-path shape, flight-recorder call) for the synchronous fast entry
        # (allreduce); filled by the first call of each shape on the general entry
        self._fast_shapes: dict[tuple, tuple] = {}
        self._fast_arrays: dict[int, tuple] = {}  # tensor data_ptr -> (shape, numpy view of the tensor)
        if self._small is not None:
            self._planner.small_path = self._small.serves
        self._runner = OrderedRunner(f"ddl_triton-rank{self.rank}")
        self._tracer = self._start_observing()
        self._executor.tracer = self._tracer

    def _start_observing(self):
        """Configure the flight recorder (always on), the timeline (Options.trace) and debug
        output (Options.debug) for this communicator; returns the tracer or None."""
        world_rank, world_size = self._bootstrap.world_rank, self._bootstrap.world_size
        if flight.RECORDER.rank < 0 or self.size == world_size:
            flight.RECORDER.configure(rank=world_rank, size=world_size, capacity=self.options.flight_entries,
                                      dump_dir=self.options.dump_dir)
            flight.RECORDER.install_sigusr2()
        tracer = None
        if self.options.trace:
            tracer = tracer_mod.TRACERS.get(self.options.trace)
            if tracer is None:
                tracer = tracer_mod.Tracer(self.options.trace, world_rank, world_size)
                if self._comm is not None:  # (none on a store bootstrap of one rank: nothing to align)
                    tracer_mod.measure_clock_offset(self._comm, tracer)  # collective: every rank starts tracing here
                tracer_mod.TRACERS[self.options.trace] = tracer
        if self.options.debug:
            peers = ", ".join(f"{p}: {name}" for p, name in enumerate(self.placement.links))
            print(f"ddl_triton[rank {self.rank}]: communicator #{self._id} of {self.size} ranks, topology "
                  f"{self.topology.signature}; transport per peer: {peers}", file=sys.stderr, flush=True)
            if self.rank == 0:
                table = self._planner.table
                print(f"ddl_triton[rank 0]: tuning table: {self._planner.table_source if table else 'none'}; "
                      f"planning with {self._planner.model_source}", file=sys.stderr, flush=True)
        return tracer

    def _make_planner(self) -> Planner:
        """The planner, with the tuning table this communicator uses (ddl_triton/tuning/table.py).

        Every rank must plan alike, so the ranks compare their tables' digests and refuse
        to start when they differ. A table measured with another shm slot layout brings its
        own (chunk_bytes, pipeline_depth) unless the options set non-default ones."""
        table, source = None, ""
        if self.size > 1:
            key = tuning.machine_key(world_size=self.size, topology=self.topology.signature,
                                     transport=self.options.transport)
            failure = ""
            try:
                resolved = tuning.resolve(self.options.tuning_file, key, self.options.tuning_dir)
                table, source = resolved.table, resolved.source
                if self.rank == 0:
                    tuning.warn_once(resolved.note)
            except tuning.TuningTableError as e:
                failure = str(e)  # raised below on every rank: a rank leaving alone would hang the others
            digests = self._bootstrap.allgather((table.digest() if table else "none", source or "no table", failure))
            failed = [(r, f) for r, (_, _, f) in enumerate(digests) if f]
            if failed:
                raise tuning.TuningTableError(f"rank {self.rank}: cannot use the tuning table (DDL_TUNING_FILE): "
                                              + "; ".join(f"rank {r}: {f}" for r, f in failed))
            if len(set(d for d, _, _ in digests)) > 1:
                listing = "; ".join(f"rank {r}: {src} ({d})" for r, (d, src, _) in enumerate(digests))
                raise ValueError(f"rank {self.rank}: the ranks loaded different tuning tables, so they could "
                                 f"choose different schedules for one call: {listing}. Give every rank the same "
                                 "DDL_TUNING_FILE (or DDL_TUNING_FILE=off)")
            defaults = Options()
            if table is not None and (self.options.chunk_bytes, self.options.pipeline_depth) == \
                    (defaults.chunk_bytes, defaults.pipeline_depth):
                self.options = self.options.replace(chunk_bytes=table.options["chunk_bytes"],
                                                    pipeline_depth=table.options["pipeline_depth"])
        if table is not None and table.kernels:
            from ..kernels import launch_configs
            launch_configs.apply(table.kernels)  # tuned Triton launch configurations (GPU path)
        return Planner(rank=self.rank, size=self.size, topology=self.topology, link_of=self.placement.link,
                       forced=self.options.schedule, slot_bytes=self.options.chunk_bytes, table=table,
                       table_source=source)

    # -- public collectives -----------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op="sum", async_op: bool = False):
        """Reduce ``tensor`` across ranks in place; every rank gets the same bits. Returns it."""
        if not async_op and type(tensor) is torch.Tensor:
            fast = self._fast_shapes.get((op, tensor.dtype, tensor.numel()))
            if fast is not None and tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
                runner = self._runner
                if not (runner._queue or runner._running or self._poison is not None or self._closed
                        or _PROFILER.profiler._is_profiler_enabled):
                    return self._fast_allreduce(tensor, fast)
        given_op, op = op, normalize_op(op, self.rank)
        self._check_usable()
        self._check_tensor(tensor, "tensor", writable=True)
        check_op_dtype(op, tensor.dtype, self.rank)
        job = lambda: self._allreduce(tensor, op, given_op)  # noqa: E731
        return self._issue(job, async_op, ("allreduce", op, tensor.numel(), tensor.dtype, None))

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
        return self._issue(job, async_op, ("reduce_scatter", op, input.numel(), input.dtype, None))

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
        return self._issue(job, async_op, ("all_gather", None, input.numel(), input.dtype, None))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Block q of ``input`` goes to rank q; block q of ``output`` comes from rank q (equal blocks)."""
        self._check_usable()
        self._check_tensor(output, "output", writable=True)
        self._check_tensor(input, "input")
        self._check_pair(output, input)
        if output.numel() != input.numel() or input.numel() % self.size:
            raise ValueError(f"rank {self.rank}: all_to_all needs output.numel() == input.numel(), divisible by "
                             f"size {self.size}; got {output.numel()} and {input.numel()}")
        job = lambda: self._all_to_all(output, input)  # noqa: E731
        return self._issue(job, async_op, ("all_to_all", None, input.numel(), input.dtype, None))

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False):
        """Copy ``tensor`` from rank ``root`` to every rank, in place. Returns it."""
        self._check_usable()
        self._check_tensor(tensor, "tensor", writable=True)
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"rank {self.rank}: broadcast root {root!r} is not a rank of this "
                             f"communicator (size {self.size})")
        job = lambda: self._broadcast(tensor, root)  # noqa: E731
        return self._issue(job, async_op, ("broadcast", None, tensor.numel(), tensor.dtype, root))

    def barrier(self, async_op: bool = False):
        """Return once every rank has entered the barrier (deadline-bounded)."""
        self._check_usable()
        return self._issue(self._barrier, async_op, ("barrier", None, 0, None, None))

    def explain(self, collective: str, nbytes: int, dtype=torch.float32) -> Plan:
        """The schedule this communicator would run for ``collective`` on ``nbytes`` of ``dtype``, and why."""
        if collective not in schedules.COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(schedules.COLLECTIVES)}")
        plan = self._planner.plan(collective, nbytes, dtype)
        if collective == "allreduce" and self._takes_small_path(nbytes // dtype.itemsize, dtype):
            return Plan(plan.schedule, plan.chunk_elems, plan.reason + f"; runs the small-message path (every peer "
                        f"on shm and {nbytes} B <= {self._small.limit} B: ddl_triton/runtime/small_allreduce.py)",
                        estimates=plan.estimates)
        return plan

    def close(self) -> None:
        """Finish queued work, then release the transports and the private MPI communicator."""
        if self._closed:
            return
        self._runner.close()
        self._closed = True
        if self._tracer is not None:
            self._tracer.flush()
        self._gpu.close()
        self._forget_plans()
        self._small = None  # its views of the segments go before the segments
        for t in self._transports:
            t.close()
        self._bootstrap.close()  # the private MPI communicator, if any

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
        if not t.is_cpu and not (t.is_cuda and gpu_path.available()):
            raise ValueError(f"rank {self.rank}: {name} is on {t.device}, but this process has no GPU path "
                             f"({gpu_path.unavailable_reason(t)}); move it to the CPU")
        if writable and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"rank {self.rank}: {name} requires grad; collectives are not autograd operations "
                             "and write in place: pass tensor.detach() or run under torch.no_grad()")
        # Only a non-contiguous tensor can have a stride of 0 over a dimension longer than 1.
        if writable and not t.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
            raise ValueError(f"rank {self.rank}: {name} has overlapping elements (a stride of 0, e.g. "
                             "from expand()); writing a result into it is ambiguous: pass a .clone()")

    def _check_pair(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.dtype != input.dtype:
            raise TypeError(f"rank {self.rank}: output is {output.dtype} but input is {input.dtype}")
        if output.device != input.device:
            raise ValueError(f"rank {self.rank}: output is on {output.device} but input is on {input.device}")
        if output.numel() and input.numel():
            o0 = output.data_ptr()
            o1 = o0 + output.untyped_storage().nbytes()
            i0 = input.data_ptr()
            i1 = i0 + input.untyped_storage().nbytes()
            if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr() or (o0 < i1 and i0 < o1):
                raise ValueError(f"rank {self.rank}: output and input share memory; pass separate tensors")

    # -- planning ------------------------------------------------------------------------
    def _link(self, a: int, b: int) -> str:
        return self.placement.link(a, b)  # (until the tuner reads comm.placement.link)

    def _takes_small_path(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``numel`` x ``dtype`` runs small_allreduce.py: the planner
        chose one_shot and the path serves the size. Cached per shape (the latency path)."""
        key = (numel, dtype)
        takes = self._small_shapes.get(key)
        if takes is None:
            nbytes = numel * dtype.itemsize
            plan = self._planner.plan("allreduce", nbytes, dtype)
            takes = self._small is not None and self._small.serves(nbytes, dtype) and plan.schedule == "one_shot"
            if takes and self.options.debug and self.rank == 0:
                print(f"ddl_triton[rank 0]: allreduce of {numel} x {str(dtype).replace('torch.', '')}: {plan}; "
                      "runs the small-message path", file=sys.stderr, flush=True)
            if len(self._small_shapes) > 256:
                self._small_shapes.clear()
            self._small_shapes[key] = takes
        return takes

    @property
    def planner(self) -> Planner:
        """The Planner this communicator plans with (read-only: its table and cost model are fixed)."""
        return self._planner

    @contextlib.contextmanager
    def forcing(self, plan: Plan):
        """Run every collective inside the block with ``plan`` (the tuner's way to time a candidate)."""
        self._forget_plans()
        try:
            with self._planner.overriding(plan):
                yield
        finally:
            self._forget_plans()

    _with_plan = forcing  # (until the tuner calls comm.forcing)

    def _forget_plans(self) -> None:
        self._prepared.clear()
        self._small_shapes.clear()
        self._fast_shapes.clear()
        self._fast_arrays.clear()

    def _prepare(self, collective: str, count: int, in_numel: int, dtype: torch.dtype, op: str, root: int):
        """(schedule, run dtype, op context) for a call shape, cached: the latency path is one dict lookup."""
        key = (collective, count, dtype, op, root)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        elem = dtype.itemsize
        plan = self._planner.plan(collective, in_numel * elem, dtype)
        schedule = schedules.build(plan.schedule, collective, self.size, count, chunk_elems=plan.chunk_elems,
                                   root=root, grid=plan.grid, algos=plan.algos)
        scale = 1.0 / self.size if op == "avg" else None
        reduce_op = "sum" if op == "avg" else op
        run_dtype = dtype
        if (collective in ("allreduce", "reduce_scatter") and dtype in SIXTEEN_BIT and reduce_op == "sum"
                and not schedule.single_pass):
            # Partial sums travel between ranks: carry them in fp32 and round once at the end.
            run_dtype = torch.float32
            schedule = schedules.build(plan.schedule, collective, self.size, count,
                                       chunk_elems=max(1, plan.chunk_elems * elem // 4), root=root,
                                       grid=plan.grid, algos=plan.algos)
        if self.options.debug and self.rank == 0:
            print(f"ddl_triton[rank 0]: {collective} of {in_numel} x {str(dtype).replace('torch.', '')}: {plan}",
                  file=sys.stderr, flush=True)
        if len(self._prepared) > 256:  # bounded: a training loop uses a few call shapes
            self._prepared.clear()
        prepared = (schedule, run_dtype, CallContext(collective, reduce_op, scale))
        self._prepared[key] = prepared
        return prepared

    # -- execution -----------------------------------------------------------------------
    def _issue(self, job, async_op: bool, call: tuple):
        """Run ``job`` in issue order. ``call`` = (collective, op, input numel, dtype, root): what
        the flight recorder keeps (never the tensors: 2,000 records must not hold 2,000
        buckets alive), and what names the Work handle (ddl_triton/observability/flight.py formats it)."""
        self._issued += 1
        record = flight.RECORDER.issue(self._id, self._issued, call)
        if async_op:
            tracer = self._tracer
            flow = tracer.async_issue(f"{call[0]} #{record.seq}", id(record), self._id) if tracer is not None else 0
            return self._runner.submit(lambda: self._guarded(job, record, flow), flight.describe(call))
        return self._runner.run_sync(lambda: self._guarded(job, record, 0), lambda: flight.describe(call))

    def _fast_allreduce(self, tensor: torch.Tensor, fast: tuple) -> torch.Tensor:
        """A synchronous small allreduce with nothing queued before it, validated and recorded
        like every call but without the issue machinery (the latency path: see allreduce).
        Same protocol as the general entry's small path, so ranks may mix the two entries."""
        shape, call = fast
        ptr = tensor.data_ptr()
        cached = self._fast_arrays.get(ptr)
        if cached is None or cached[0] is not shape:
            if len(self._fast_arrays) > 64:  # each entry keeps its tensor alive: stay small
                self._fast_arrays.clear()
            cached = self._fast_arrays[ptr] = (shape, tensor.view(-1).numpy())
        self._issued += 1
        seq = self._seq = self._seq + 1
        record = flight.RECORDER.issue(self._id, self._issued, call)
        record.state, record.t_start, record.schedule = "started", record.t_issue, _SMALL_PATH
        try:
            self._run_small(cached[1], shape, seq)
        except Exception as e:
            self._raise_failure(record, e)
        finally:
            record.t_end = time.time()
        record.state = "done"
        return tensor

    def _guarded(self, job, record, flow: int = 0):
        """Run one collective with its record kept current; errors poison the communicator
        (timeouts and mismatches also dump the flight recorder)."""
        record.state = "started"
        record.t_start = time.time()
        self._executor.record = record
        tracer = self._tracer
        t0 = 0.0 if tracer is None else time.perf_counter()
        try:
            self._check_usable()  # an earlier queued collective may have failed
            if tracer is not None and flow:
                tracer.async_start(flow)
            if _PROFILER.profiler._is_profiler_enabled:  # torch.profiler is recording: appear in its trace
                with torch.autograd.profiler.record_function(f"ddl:{flight.describe(record.call)} #{record.seq}"):
                    result = job()
            else:
                result = job()
        except Exception as e:
            self._raise_failure(record, e)
        else:
            record.state = "done"
            return result
        finally:
            record.t_end = time.time()
            self._executor.record = None
            if tracer is not None:
                self._trace_call(tracer, record, t0, flow)

    def _raise_failure(self, record, e: Exception):
        """Mark ``record``'s collective failed with ``e``, poison the communicator, and raise
        ``e`` (a DDLError wrapping it when it is unexpected). Timeouts and mismatches also
        dump the flight recorder."""
        self._fail(record, e)
        if isinstance(e, (CollectiveTimeout, CollectiveMismatch)):
            if isinstance(e, CollectiveTimeout):
                record.waiting = flight.stuck_wait()
                _LOST_PEERS.append(self.rank)  # MPI_Finalize would wait for the lost rank: skip it at exit
            path = flight.RECORDER.dump(f"{type(e).__name__}: {e}")
            if path:
                e.args = (f"{e.args[0]} [flight recorder: {path}]",) + e.args[1:]
        if isinstance(e, DDLError):
            status.error(str(e))
            raise e
        raise DDLError(f"rank {self.rank}: collective failed: {e!r}") from e

    def _fail(self, record, error: BaseException) -> None:
        self._poison = error
        record.state = "failed"
        record.error = str(error)

    def _trace_call(self, tracer, record, t0: float, flow: int) -> None:
        info = record.to_json()
        tracer.span(f"{info['collective']} #{record.seq}", tracer.us(t0), tracer.now(), "ddl.collective",
                    {"seq": record.seq, "bytes": info["bytes"], "schedule": record.schedule, "call": info["call"],
                     "dtype": info["dtype"], "site": info["site"], "state": record.state, "comm": self._id})
        if flow:
            tracer.async_done(f"{info['collective']} #{record.seq}", id(record))

    def _checked(self, collective: str, op, dtype, numel: int, root: int, run, on_gpu: bool = False) -> None:
        """Run ``run()`` between the call checker's begin and end (see fingerprints.py)."""
        if self._calls is None:
            run()
            return
        key = (collective, op, dtype, numel, root, on_gpu)
        fp = self._fingerprints.get(key)
        if fp is None:
            if len(self._fingerprints) > 256:
                self._fingerprints.clear()
            fp = self._fingerprints[key] = calls.encode(collective, op, dtype, numel, root, on_gpu)
        try:
            self._calls.begin(self._seq, fp)
            run()
            self._calls.end(self._seq, fp)
        except PeerTimeout as e:
            raise CollectiveTimeout(f"rank {self.rank}: {collective} #{self._seq} timed out: "
                                    f"{'lost' if e.dead else 'not heard from'} {e.who} ({e.what})") from None

    def _execute(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int,
                 op: str = "sum", root: int = 0) -> None:
        self._seq += 1
        self._checked(collective, op if collective in ("allreduce", "reduce_scatter") else None, inbuf.dtype,
                      inbuf.numel(), root, lambda: self._run(collective, inbuf, outbuf, count, op, root),
                      on_gpu=inbuf.is_cuda)

    def _run(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int, op: str,
             root: int) -> None:
        record = self._executor.record
        schedule, run_dtype, ctx = self._prepare(collective, count, inbuf.numel(), inbuf.dtype, op, root)
        if record is not None:
            record.schedule = schedule.name
        if not inbuf.is_cuda:
            self._run_widened(self._executor, schedule, inbuf, outbuf, run_dtype, ctx)
            return
        executor = self._gpu.executor(inbuf.device)
        executor.record, executor.tracer = record, self._tracer
        if self._tracer is None:
            self._run_widened(executor, schedule, inbuf, outbuf, run_dtype, ctx)
            return
        # Traced: a span timed by CUDA events, resolved when the trace is written (no host
        # synchronisation added). Not yet run on a GPU.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._run_widened(executor, schedule, inbuf, outbuf, run_dtype, ctx)
        end.record()
        info = record.to_json()
        self._tracer.cuda_span(f"{info['collective']} #{record.seq} (GPU)", start, end,
                               {"schedule": schedule.name, "bytes": info["bytes"]})

    def _run_widened(self, executor, schedule, inbuf: torch.Tensor, outbuf: torch.Tensor, run_dtype, ctx) -> None:
        """Run ``schedule``; when ``run_dtype`` is wider than the data (16-bit sums carried in
        fp32), through a wide copy, rounded back once at the end."""
        if run_dtype is inbuf.dtype:
            executor.run(schedule, inbuf, outbuf, ctx, self._seq)
            return
        wide_in = inbuf.to(run_dtype)
        wide_out = wide_in if outbuf is inbuf else torch.empty(outbuf.shape, dtype=run_dtype, device=outbuf.device)
        executor.run(schedule, wide_in, wide_out, ctx, self._seq)
        outbuf.copy_(wide_out)  # the one rounding back to 16 bits

    def _allreduce(self, tensor: torch.Tensor, op: str, given_op=None) -> torch.Tensor:
        flat = _flat_work(tensor)
        shape = self._small_shape(op, flat, given_op) if flat.is_cpu else None
        if shape is not None:
            self._seq += 1
            if self._executor.record is not None:
                self._executor.record.schedule = _SMALL_PATH
            self._run_small(flat.detach().numpy(), shape, self._seq)
        else:
            self._execute("allreduce", flat, flat, flat.numel(), op)
        _write_back(tensor, flat)
        return tensor

    def _small_shape(self, op: str, flat: torch.Tensor, given_op):
        """The small-message path's prepared shape for this allreduce, or None when it takes the
        general path. Registers the shape for the synchronous fast entry under the op as the
        caller spelled it (a string: the fast entry looks it up before normalising)."""
        numel, dtype = flat.numel(), flat.dtype
        if not self._takes_small_path(numel, dtype):
            return None
        key = (op, dtype, numel)
        fast = self._fast_shapes.get(key)
        if fast is None:
            fingerprint = calls.encode("allreduce", op, dtype, numel, 0)
            fast = (self._small.shape(op, dtype, numel, fingerprint), ("allreduce", op, numel, dtype, None))
            if len(self._fast_shapes) > 256:
                self._fast_shapes.clear()
            self._fast_shapes[key] = fast
        if isinstance(given_op, str) and given_op != op:
            self._fast_shapes[(given_op, dtype, numel)] = fast
        return fast[0]

    def _run_small(self, array, shape, seq: int) -> None:
        """The one_shot allreduce of a small tensor on the shm lane (small_allreduce.py)."""
        try:
            self._small.run(array, shape, seq)  # type: ignore[union-attr]
        except PeerTimeout as e:
            raise step_error(self.rank, "allreduce", seq, _SMALL_PATH, "reduce", e, self.options.timeout) from None

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

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        inp = input.contiguous().view(-1)
        out = _flat_work(output)
        self._execute("all_to_all", inp, out, inp.numel() // self.size)
        _write_back(output, out)
        return output

    def _broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        flat = _flat_work(tensor)
        self._execute("broadcast", flat, flat, flat.numel(), root=root)
        _write_back(tensor, flat)
        return tensor

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
        except PeerTimeout:
            raise CollectiveTimeout(f"rank {self.rank}: barrier #{self._seq} timed out after "
                                    f"{self.options.timeout:g} s") from None


_LOST_PEERS: list[int] = []  # appended when any communicator of this process lost a peer


def peers_lost() -> bool:
    """True once a collective of this process timed out or lost a peer, or the launcher
    reported that a process of the job ended while this process had not finalized MPI.

    Either way MPI_Finalize, which waits for every rank, would wait for the lost one
    forever. A notice received after MPI_Finalize is not a loss: MPI_Finalize is
    collective, and a peer that passed it and exited cleanly is announced too
    (failure_notice explains hydra's behaviour)."""
    return bool(_LOST_PEERS) or (failure_notice.received_at() is not None and not MPI.Is_finalized())


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


