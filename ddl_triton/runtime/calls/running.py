"""Running a call: from a checked call value to the bytes on the transports, one way down.

Semantics: a ``Call`` is what the communicator was asked to run (collective, tensors, op, root),
made once per call after its arguments were checked. ``CallRunner.run(call)`` runs it: it numbers
the call (``seq``, the same on every rank: calls run in issue order), looks up its plan
(plan_cache.py), brackets it with the call check (lanes/call_check.py: ``begin_call`` before,
``end_call`` after) and hands the flat buffers to the small-message path
(lanes/small_allreduce*.py), the executor (executor.py) or the GPU path (gpu_path.py); strided
tensors go through contiguous copies, written back once done. ``run_small`` is the same small
allreduce for the communicator's synchronous fast entry, whose shape was prepared before.

Nothing here calls back up: the issue path (issue.py) calls ``attach`` and ``run``, set once when
the communicator is built; the call check is asked before and after, never handed the call; the
transports learn about the call check only through the wait hook the communicator set on the shm
transport at wiring time (``ShmTransport.wait_hook``: ``CallChecker.look_for_mismatch``).
Errors: a peer lost or silent past the deadline is a ``CollectiveTimeout`` naming the call and the
peer (ddl_triton/errors.py words it); a call that differs between ranks, ``CollectiveMismatch``.
"""
from __future__ import annotations

import torch

from ...errors import call_name, wait_failed
from ...transports.host_arrays import numpy_view
from ...transports.waits import PeerTimeout, wait_until
from ..lanes.small_allreduce_two_sided import lane_dtype

SMALL_PATH = "one_shot (small-message path)"
SMALL_BROADCAST = "one_shot (small-message path across hosts)"
_REDUCING = ("allreduce", "reduce_scatter")


class Call:
    """One collective as the caller asked for it: ``output`` is the tensor written (in place for
    allreduce and broadcast), ``input`` the one read (None: in place); ``op`` normalized (sum, avg,
    min, max) and ``given_op`` as given (the small path keys its shapes on it); ``root`` for broadcast."""

    __slots__ = ("collective", "output", "input", "op", "given_op", "root")

    def __init__(self, collective: str, output: torch.Tensor | None, input: torch.Tensor | None = None,
                 op: str | None = None, given_op=None, root: int = 0):
        self.collective, self.output, self.input = collective, output, input
        self.op, self.given_op, self.root = op, given_op, root

    def summary(self) -> tuple:
        """(collective, op, input numel, dtype, root): what the flight recorder keeps of the call
        (never its tensors) and what names its Work handle."""
        t = self.output if self.input is None else self.input
        if t is None:
            return (self.collective, None, 0, None, None)
        return (self.collective, self.op, t.numel(), t.dtype, self.root if self.collective == "broadcast" else None)


class CallRunner:
    """Runs the calls of the communicator of ``rank`` (of ``size``) on its parts: ``executor``
    (swappable: tests run every call through the GPU path's), ``plans`` (PlanCache), ``small``
    (the small-message path, or None), ``checker`` (CallChecker, or None when calls are not
    checked), ``gpu`` (GpuPath), ``control`` (the communicator with ``Ibarrier``, or None),
    ``timeout`` and ``describe`` (peer -> its name in errors, with its host)."""

    def __init__(self, rank: int, size: int, *, executor, plans, small, checker, gpu, control,
                 timeout: float, describe):
        self.rank, self.size = rank, size
        self.executor, self.plans, self.small, self.checker, self.gpu = executor, plans, small, checker, gpu
        self.control, self.timeout, self.describe = control, timeout, describe
        self.seq = 0  # calls run so far: the number every rank gives the same call

    def attach(self, record) -> None:
        """The issue path's seam: ``record`` is the flight record of the call about to run (None
        once it ran); the executor keeps its step label current."""
        self.executor.record = record

    def run(self, call: Call):
        """Run ``call`` (the issue path calls this in issue order); returns its output tensor."""
        collective = call.collective
        if collective == "allreduce":
            return self._allreduce(call.output, call.op, call.given_op)
        if collective == "broadcast":
            return self._broadcast(call.output, call.root)
        if collective == "barrier":
            return self._barrier()
        return self._staged(collective, call.output, call.input, call.op or "sum")

    def run_small(self, array, shape) -> None:
        """The one_shot allreduce of a small tensor on the shm lane (small_allreduce.py) or the
        call lane across a two-sided transport (small_allreduce_two_sided.py), as call ``seq + 1``."""
        seq = self.seq = self.seq + 1
        try:
            self.small.run(array, shape, seq)
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name("allreduce", seq, SMALL_PATH, "reduce"), e,
                              self.timeout, self.describe) from None

    # -- the collectives -------------------------------------------------------------------
    def _allreduce(self, tensor: torch.Tensor, op: str, given_op) -> torch.Tensor:
        flat = _flat_work(tensor)
        shape = self.plans.small_shape(self.small, op, flat, given_op) if flat.is_cpu else None
        if shape is not None:
            record = self.executor.record
            if record is not None:
                record.schedule = SMALL_PATH
            self.run_small(self.plans.fast_view(flat.detach(), shape), shape)
        else:
            self._execute("allreduce", flat, flat, flat.numel(), op, 0)
        _write_back(tensor, flat)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        flat = _flat_work(tensor)
        shape = self.plans.small_broadcast_shape(self.small, flat, root) if flat.is_cpu else None
        if shape is None:
            return self._staged("broadcast", tensor, None, root=root)
        seq = self.seq = self.seq + 1
        if self.executor.record is not None:
            self.executor.record.schedule = SMALL_BROADCAST
        # One element counts as contiguous whatever its stride: numpy and dtype views need stride 1.
        work = flat if flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)
        array = work.detach().view(lane_dtype(work.dtype))
        try:
            self.small.broadcast(numpy_view(array), shape, seq, root)
        except PeerTimeout as e:
            raise wait_failed(self.rank, call_name("broadcast", seq, SMALL_BROADCAST, "copy"), e,
                              self.timeout, self.describe) from None
        if work is not flat:
            flat.copy_(work)
        _write_back(tensor, flat)
        return tensor

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

    def _execute(self, collective: str, inbuf: torch.Tensor, outbuf: torch.Tensor, count: int, op: str,
                 root: int) -> None:
        """Call ``seq + 1`` through a schedule: checked, planned, run on the CPU or the GPU path."""
        seq = self.seq = self.seq + 1
        checker, on_gpu = self.checker, inbuf.is_cuda
        fingerprint = None if checker is None else checker.begin_call(
            seq, collective, op if collective in _REDUCING else None, inbuf.dtype, inbuf.numel(), root, on_gpu)
        executor = self.executor
        schedule, run_dtype, ctx = self.plans.prepare(collective, count, inbuf.numel(), inbuf.dtype, op, root)
        record = executor.record
        if record is not None:
            record.schedule = schedule.name
        if on_gpu:
            self.gpu.run(schedule, inbuf, outbuf, run_dtype, ctx, seq, record, executor.tracer)
        else:
            executor.run_widened(schedule, inbuf, outbuf, ctx, seq, run_dtype)
        if checker is not None:
            checker.end_call(seq, collective, fingerprint)

    def _barrier(self) -> None:
        seq = self.seq = self.seq + 1
        checker = self.checker
        if checker is not None:
            # Comparing call fingerprints already waits for every rank to arrive: that is a barrier.
            checker.end_call(seq, "barrier", checker.begin_call(seq, "barrier", None, None, 0, 0))
            return
        if self.control is None:
            return  # a store bootstrap of one rank: nobody to wait for
        req = self.control.Ibarrier()  # MPI's, or the gloo transport's on a store bootstrap
        try:
            wait_until(req.Test, self.timeout, -1, "barrier")
        except PeerTimeout as e:  # MPI cannot say who is missing: the placement narrows it, with hosts
            raise wait_failed(self.rank, call_name("barrier", seq), e, self.timeout, self.describe) from None


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
