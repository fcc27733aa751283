"""The Communicator: validate a call, plan a schedule, run it on the transports.

Every collective follows one path, one way down (no layer calls back into a layer above it):

    Communicator.allreduce(...)   checks the arguments (calls/arguments.py: errors name the rank and
                                  the problem, before any communication) and makes a ``Call`` value
      -> IssuePath.issue          issue order, flight record, trace span, poisoning (calls/issue.py;
                                  async calls on a background thread: calls/work.py)
      -> CallRunner.run           numbers the call, stages it (flat contiguous buffers; 16-bit sums
                                  on a multi-hop schedule in fp32), plans it once per shape
                                  (calls/plan_cache.py over ddl_triton/planning/planner.py), brackets
                                  it with the call check (lanes/call_check.py), and runs it on the
                                  small-message path (lanes/), the executor or the GPU path
                                  (calls/running.py)
      -> the transports           (transports/; shm's long waits run the call check's wait hook,
                                  set here when the transports are wired)

This module composes the pieces, once per communicator: where each rank sits and how each peer is
reached (setup/placement.py), the transports per peer (setup/wiring.py), the tuning table every
rank agrees on (setup/table_agreement.py), and what a new communicator turns on to be observed
(calls/observing.py). The synchronous fast entry of ``allreduce`` (the latency path) skips the
queue for a shape the small path served before, with the same records and protocol.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import weakref

import torch

from .lanes.call_check import CallChecker
from .lanes.farewell import Farewell, Leaving
from .calls import gpu_path
from .. import kernels, schedules
from ..ops import check_op_dtype, normalize_op
from ..options import Options
from ..planning.planner import Plan, Planner
from ..transports import failure_notice
from .setup.bootstrap import MpiBootstrap, StoreBootstrap
from .calls.executor import Executor
from .calls.issue import IssuePath, peers_lost
from .setup.mpich_segment import release_init_segment
from .calls.observing import start_observing
from .setup.option_agreement import agree_on_options
from .setup.placement import place
from .calls.plan_cache import PlanCache
from .calls.running import SMALL_PATH, Call, CallRunner
from .lanes.small_allreduce import SmallAllreduce
from .lanes.small_allreduce_two_sided import SmallAllreduceTwoSided
from .setup import link_probe
from .setup.table_agreement import agree_on_planner
from .calls.arguments import check_output_input, check_root, check_tensor
from .arrays import IN_PLACE, READ, WRITTEN, as_tensor, handed_back, torch_dtype
from .setup.wiring import connect

_PROFILER = torch.autograd  # .profiler._is_profiler_enabled: torch's own fast "is it recording" flag
_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # communicators not yet closed (for exit)


def farewell_at_exit() -> None:
    """Every communicator still open says that its rank reached exit (farewell.py), so that a peer
    waiting for this rank in a collective it never issued raises now, naming it, instead of waiting
    out the deadline while this rank waits at exit. Idempotent; run at interpreter exit (before any
    exit rendezvous: world.py's exit guard calls it too)."""
    for comm in list(_OPEN):
        comm._leave(Leaving.EXIT, at_exit=True)


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
        if self.size > 1 and not link_probe.before_wiring(self.placement) and \
                not link_probe.wanted(self.placement, self.options, self._planner.table):
            # A store bootstrap had no data path to measure the link on until now: over gloo's.
            self._planner.use_link(link_probe.measure(self._bootstrap, self.placement, self.options, wiring.control))
        self._lane = wiring.lane  # the call lane over MPI or gloo (call_lane.py), or None
        every_peer_on_shm = self.placement.every_peer_on_shm
        checker = CallChecker(self._lane, self.rank, self.size, shm if every_peer_on_shm else None, options.timeout,
                              describe=self.placement.describe) if options.check_calls else None
        if checker is not None and every_peer_on_shm and shm is not None:
            shm.wait_hook = checker.look_for_mismatch  # long waits on shm look for a peer on another call
        executor = Executor(self.rank, self.size, route, timeout=options.timeout, depth=options.pipeline_depth)
        executor.describe = self.placement.describe  # errors name a lost peer's host
        # hierarchical_native is a candidate where the inter-node transport runs group steps itself.
        self._planner.group_engines = not every_peer_on_shm and executor.group_engines
        self._gpu = gpu_path.GpuPath(self.placement, self.options, self._comm)  # built on the first CUDA collective
        small = SmallAllreduce(shm, self.rank, self.size, self.placement.on_node, options.timeout, checker) \
            if every_peer_on_shm and shm is not None else \
            SmallAllreduceTwoSided(self._lane) if self._lane is not None else None
        if small is not None:
            self._planner.small_path = small.serves
        # The call path, one way down: the issue path orders and records the calls and hands each to
        # the runner, which checks, plans and runs it (calls/running.py).
        self._runner = CallRunner(self.rank, self.size, executor=executor,
                                  plans=PlanCache(self._planner, self.rank, self.size, self.options.debug),
                                  small=small, checker=checker, gpu=self._gpu, control=self._comm,
                                  timeout=options.timeout, describe=self.placement.describe)
        self._issuer = IssuePath(self.rank, comm_id, self._runner.attach, timeout=options.timeout)
        self.tracer = start_observing(self._bootstrap, self.placement, self.options, self._planner, self._comm,
                                      comm_id)
        self._shm = shm if self.size > 1 else None  # where this rank's farewell goes on this host
        self._left = False
        _OPEN.add(self)
        # Run before the exit hooks of anything this communicator made (the call lane's closes its
        # MPI lanes without a word): atexit runs the last registered first, so register again.
        atexit.unregister(farewell_at_exit)
        atexit.register(farewell_at_exit)

    # -- public collectives -----------------------------------------------------------
    def allreduce(self, tensor, op="sum", async_op: bool = False):
        """Reduce ``tensor`` across ranks in place; every rank gets the same bits. Returns the result:
        ``tensor`` itself (a torch tensor, numpy or CuPy array), or a new array of its type where it
        is immutable (a JAX array: arrays.py); with ``async_op``, a Work whose ``wait()`` returns it."""
        if not async_op and type(tensor) is torch.Tensor:
            # The synchronous fast entry (the latency path): a shape the small path has served
            # before, with nothing queued, running, failed or recording in the way.
            runner = self._runner
            fast = runner.plans.fast.get((op, tensor.dtype, tensor.numel()))
            if fast is not None and tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
                issuer = self._issuer
                if issuer.runner.idle and issuer.poison is None and not issuer.closed \
                        and not _PROFILER.profiler._is_profiler_enabled:
                    # Recorded and validated like every call, without the issue machinery; the
                    # same protocol as the general entry's small path, so ranks may mix the two.
                    shape, summary = fast
                    issuer.run_inline(summary, SMALL_PATH, runner.run_small, runner.plans.fast_view(tensor, shape),
                                      shape)
                    return tensor
        if not isinstance(tensor, torch.Tensor):  # numpy, DLPack: the torch path on a view (arrays.py)
            given = as_tensor(self.rank, tensor, "tensor", IN_PLACE)
            return handed_back(self.allreduce(given.tensor, op, async_op), given, async_op)
        given_op, op = op, normalize_op(op, self.rank)
        self._issuer.check_usable()
        check_tensor(self.rank, tensor, "tensor", writable=True)
        check_op_dtype(op, tensor.dtype, self.rank)
        return self._issue(Call("allreduce", tensor, None, op, given_op), async_op)

    def reduce_scatter(self, output, input, op="sum", async_op: bool = False):
        """Rank r receives block r of the reduction of ``input`` (``size`` blocks of ``output.numel()``).
        Returns ``output`` (with ``async_op``, a Work whose ``wait()`` returns it), as for all_gather
        and all_to_all: ``output`` a writable torch tensor, numpy or CuPy array; ``input`` any array."""
        if not (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)):
            return self._with_arrays(self.reduce_scatter, output, input, async_op, op=op)
        op = normalize_op(op, self.rank)
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "reduce_scatter", output, input)
        check_op_dtype(op, output.dtype, self.rank)
        return self._issue(Call("reduce_scatter", output, input, op), async_op)

    def all_gather(self, output, input, async_op: bool = False):
        """Block r of ``output`` (``input.numel()`` elements) is rank r's ``input``."""
        if not (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)):
            return self._with_arrays(self.all_gather, output, input, async_op)
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "all_gather", output, input)
        return self._issue(Call("all_gather", output, input), async_op)

    def all_to_all(self, output, input, async_op: bool = False):
        """Block q of ``input`` goes to rank q; block q of ``output`` comes from rank q (equal blocks)."""
        if not (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)):
            return self._with_arrays(self.all_to_all, output, input, async_op)
        self._issuer.check_usable()
        check_output_input(self.rank, self.size, "all_to_all", output, input)
        return self._issue(Call("all_to_all", output, input), async_op)

    def broadcast(self, tensor, root: int = 0, async_op: bool = False):
        """Copy ``tensor`` from rank ``root`` to every rank, in place. Returns the result, as allreduce."""
        if not isinstance(tensor, torch.Tensor):
            given = as_tensor(self.rank, tensor, "tensor", IN_PLACE)
            return handed_back(self.broadcast(given.tensor, root, async_op), given, async_op)
        self._issuer.check_usable()
        check_tensor(self.rank, tensor, "tensor", writable=True)
        check_root(self.rank, self.size, root)
        return self._issue(Call("broadcast", tensor, root=root), async_op)

    def barrier(self, async_op: bool = False):
        """Return once every rank has entered the barrier (deadline-bounded)."""
        self._issuer.check_usable()
        return self._issue(Call("barrier", None), async_op)

    def explain(self, collective: str, nbytes: int, dtype=torch.float32) -> Plan:
        """The schedule this communicator would run for ``collective`` on ``nbytes`` of ``dtype``, and why.
        ``dtype``: any spelling the collectives' arrays carry (torch.float32, "float32", np.float32,
        jnp.bfloat16, tf.float16, ...: arrays.torch_dtype)."""
        if collective not in schedules.COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(schedules.COLLECTIVES)}")
        dtype = torch_dtype(self.rank, dtype)
        plan = self._planner.plan(collective, nbytes, dtype)
        small = self._runner.small
        world = self._bootstrap.launcher  # the launcher line: how this world was found
        if collective == "allreduce" and self._runner.plans.takes_small_path(small, nbytes // dtype.itemsize, dtype):
            where = ("every peer on shm", "small_allreduce.py") if isinstance(small, SmallAllreduce) else \
                (f"every peer through the call lane on {self._lane.counter.name}", "small_allreduce_two_sided.py")
            return Plan(plan.schedule, plan.chunk_elems, plan.reason + f"; runs the small-message path "
                        f"({where[0]} and {nbytes} B <= {small.limit} B: ddl_triton/runtime/lanes/{where[1]})",
                        estimates=plan.estimates, world=world)
        return dataclasses.replace(plan, world=world)

    def close(self, how: Leaving = Leaving.CLOSED) -> None:
        """Finish queued work, tell the peers that this rank left (``how``: farewell.py; a peer waiting
        in a collective this rank never issued raises ``CollectiveSkipped`` naming it), then release
        the transports and the private MPI communicator."""
        if self._issuer.closed:
            return
        try:
            self._issuer.close()
        finally:
            self._leave(how)
        if self.tracer is not None:
            self.tracer.flush()
        self._gpu.close()
        self._runner.plans.forget()
        self._runner.small = None  # its views of the segments go before the segments
        for t in self._transports:
            t.close()
        self._bootstrap.close()  # the private MPI communicator, if any

    def _leave(self, how: Leaving, at_exit: bool = False) -> None:
        """Say this rank's farewell once (farewell.py): how it left, after how many collectives, and
        whether the last failed; on shm in its segment's header, across hosts as its last call-lane
        message (which closes the lane: it goes before the bootstrap's MPI communicator). At exit
        the communicator refuses every later call."""
        if self._left:
            return
        self._left = True
        _OPEN.discard(self)
        said = Farewell(how, self._runner.seq, self._issuer.poison is not None)
        if self._shm is not None:
            self._shm.post_farewell(said.shm_word())
        if self._lane is not None:
            # Once a peer of this process is lost, the job is failing and every peer finds out by
            # itself: no farewell crosses the wire then. MPICH, which is not fault tolerant, crashed
            # (SIGSEGV) sending one at exit after the launcher reported a dead rank.
            self._lane.close(None if peers_lost() else said)
        if at_exit:
            self._issuer.closed = True

    # -- seams for the tuner, the torch backend, benchmarks and the world -----------------
    @property
    def planner(self) -> Planner:
        """The Planner this communicator plans with (read-only: its table and cost model are fixed)."""
        return self._planner

    @contextlib.contextmanager
    def forcing(self, plan: Plan):
        """Run every collective inside the block with ``plan`` (the tuner's way to time a candidate)."""
        self._runner.plans.forget()
        try:
            with self._planner.overriding(plan):
                yield
        finally:
            self._runner.plans.forget()

    @property
    def tracer(self):
        """The timeline this communicator records to (observability/tracer.py), or None. Setting it
        (a benchmark comparing tracing on and off) takes effect from the next collective."""
        return self._issuer.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self._issuer.tracer = self._runner.executor.tracer = tracer

    def waking_later(self):
        """Context manager: calls this thread issues inside the block do not wake the background
        thread until their Work is waited on or released, or a later call comes (work.py)."""
        return self._issuer.runner.waking_later()

    def peers_gone(self) -> list[int]:
        """Ranks whose process is known to have ended: seen gone by a wait, or their call-lane
        connection closed (ranks that met through a store). An elastic job tells the others
        (ddl_triton/elastic/membership.py), so that nobody waits for their word."""
        closed = self._lane.closed_peers() if self._lane is not None else []
        return sorted(failure_notice.gone() | set(closed))

    @property
    def failure(self) -> BaseException | None:
        """The error that made this communicator unusable (its first failed collective), or None."""
        return self._issuer.poison

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

    # -- issuing -------------------------------------------------------------------------
    def _with_arrays(self, collective, output, input, async_op: bool, **kwargs):
        """``collective`` on torch views of arrays (arrays.py); returns ``output`` as the caller passed it."""
        out = as_tensor(self.rank, output, "output", WRITTEN)
        inp = as_tensor(self.rank, input, "input", READ)
        return handed_back(collective(out.tensor, inp.tensor, async_op=async_op, **kwargs), out, async_op)

    def _issue(self, call: Call, async_op: bool):
        """Hand a checked call down: the issue path runs it in issue order through the runner."""
        return self._issuer.issue(functools.partial(self._runner.run, call), async_op, call.summary())
