"""The plan cache of a communicator: what each call shape runs, decided once per shape.

Semantics: a call shape (collective, element count, dtype, op, root) always runs the same
thing until ``forget``, so the planner is asked once per shape and the answer is kept:
- ``prepare``: the schedule, the dtype it runs in (16-bit sums on a multi-hop schedule carry
  fp32 partial sums, rounded once at the end) and the reduction context;
- ``takes_small_path`` / ``small_shape``: whether an allreduce takes the small-message path
  (small_allreduce.py: the planner chose one_shot and the path serves the size), and that
  path's prepared shape, which also registers the shape for the synchronous fast entry
  (``fast``: (op, dtype, numel) -> (small-path shape, flight-recorder call));
- ``fast_view``: the numpy view of a tensor that the fast entry hands to the small path.
Each cache is bounded (a training loop uses a few shapes; an entry may keep a tensor alive).
``forget`` drops every entry: the communicator does so whenever the plans may change
(``Communicator.forcing``) and when it closes.
"""
from __future__ import annotations

import sys

import torch

from ... import schedules
from ...ops import SIXTEEN_BIT
from ...planning.planner import Planner
from ...transports.host_arrays import numpy_view
from ..lanes.fingerprint import encode
from .executor import CallContext

_BOUND = 256  # entries per cache before it starts over


class PlanCache:
    """Per call shape, what the communicator of ``rank`` (of ``size``) runs, as ``planner`` decides."""

    def __init__(self, planner: Planner, rank: int, size: int, debug: bool):
        self._planner, self._rank, self._size, self._debug = planner, rank, size, debug
        self._prepared: dict[tuple, tuple] = {}
        self._small_shapes: dict[tuple[int, torch.dtype], bool] = {}  # (numel, dtype) -> takes the small path
        self.fast: dict[tuple, tuple] = {}  # (op, dtype, numel) -> (small-path shape, flight-recorder call)
        self._fast_arrays: dict[int, tuple] = {}  # tensor data_ptr -> (shape, numpy view of the tensor)
        self._broadcast_shapes: dict[tuple, object] = {}  # (dtype, numel, root) -> the call lane's shape

    def forget(self) -> None:
        self._prepared.clear()
        self._small_shapes.clear()
        self.fast.clear()
        self._fast_arrays.clear()
        self._broadcast_shapes.clear()

    def prepare(self, collective: str, count: int, in_numel: int, dtype: torch.dtype, op: str, root: int):
        """(schedule, run dtype, op context) for a call shape, cached: the latency path is one dict lookup."""
        key = (collective, count, dtype, op, root)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        size, elem = self._size, dtype.itemsize
        plan = self._planner.plan(collective, in_numel * elem, dtype)
        schedule = schedules.build(plan.schedule, collective, size, count, chunk_elems=plan.chunk_elems,
                                   root=root, grid=plan.grid, algos=plan.algos)
        scale = 1.0 / size if op == "avg" else None
        reduce_op = "sum" if op == "avg" else op
        run_dtype = dtype
        if (collective in ("allreduce", "reduce_scatter") and dtype in SIXTEEN_BIT and reduce_op == "sum"
                and not schedule.single_pass):
            # Partial sums travel between ranks: carry them in fp32 and round once at the end.
            run_dtype = torch.float32
            schedule = schedules.build(plan.schedule, collective, size, count,
                                       chunk_elems=max(1, plan.chunk_elems * elem // 4), root=root,
                                       grid=plan.grid, algos=plan.algos)
        if self._debug and self._rank == 0:
            print(f"ddl_triton[rank 0]: {collective} of {in_numel} x {str(dtype).replace('torch.', '')}: {plan}",
                  file=sys.stderr, flush=True)
        if len(self._prepared) > _BOUND:
            self._prepared.clear()
        prepared = (schedule, run_dtype, CallContext(collective, reduce_op, scale))
        self._prepared[key] = prepared
        return prepared

    def takes_small_path(self, small, numel: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``numel`` x ``dtype`` runs on ``small`` (the communicator's
        small-message path, or None): the planner chose one_shot and the path serves the size."""
        key = (numel, dtype)
        takes = self._small_shapes.get(key)
        if takes is None:
            nbytes = numel * dtype.itemsize
            plan = self._planner.plan("allreduce", nbytes, dtype)
            takes = small is not None and small.serves(nbytes, dtype) and plan.schedule == "one_shot"
            if takes and self._debug and self._rank == 0:
                print(f"ddl_triton[rank 0]: allreduce of {numel} x {str(dtype).replace('torch.', '')}: {plan}; "
                      "runs the small-message path", file=sys.stderr, flush=True)
            if len(self._small_shapes) > _BOUND:
                self._small_shapes.clear()
            self._small_shapes[key] = takes
        return takes

    def small_shape(self, small, op: str, flat: torch.Tensor, given_op):
        """The small-message path's prepared shape for this allreduce, or None when it takes the
        general path. Registers the shape for the synchronous fast entry under the op as the
        caller spelled it (a string: the fast entry looks it up before normalising)."""
        numel, dtype = flat.numel(), flat.dtype
        if not self.takes_small_path(small, numel, dtype):
            return None
        key = (op, dtype, numel)
        fast = self.fast.get(key)
        if fast is None:
            fingerprint = encode("allreduce", op, dtype, numel, 0)
            fast = (small.shape(op, dtype, numel, fingerprint), ("allreduce", op, numel, dtype, None))
            if len(self.fast) > _BOUND:
                self.fast.clear()
            self.fast[key] = fast
        if isinstance(given_op, str) and given_op != op:
            self.fast[(given_op, dtype, numel)] = fast
        return fast[0]

    def small_broadcast_shape(self, small, flat: torch.Tensor, root: int):
        """The call lane's prepared shape for this broadcast (small_allreduce_two_sided.py), or None
        when it takes the general path: no lane, too large, a dtype the lane does not carry, or a
        plan other than one_shot (whose broadcast the lane's is: the root's bytes straight to all)."""
        serves = getattr(small, "serves_broadcast", None)
        numel, dtype = flat.numel(), flat.dtype
        if serves is None or not serves(numel * dtype.itemsize, dtype):
            return None
        key = ("broadcast", dtype, numel, root)
        shape = self._broadcast_shapes.get(key)
        if shape is None:
            if self._planner.plan("broadcast", numel * dtype.itemsize, dtype).schedule != "one_shot":
                return None
            if len(self._broadcast_shapes) > _BOUND:
                self._broadcast_shapes.clear()
            shape = self._broadcast_shapes[key] = small.shape(
                "sum", dtype, numel, encode("broadcast", None, dtype, numel, root))
        return shape

    def fast_view(self, tensor: torch.Tensor, shape):
        """The numpy view of ``tensor`` (flat, contiguous, on the CPU) for the small path's ``shape``."""
        ptr = tensor.data_ptr()
        cached = self._fast_arrays.get(ptr)
        # The view keeps its tensor alive, so no other tensor can be at ``ptr`` unless it shares that
        # memory; but the storage stays resizable (host_arrays.py), and a resize moves it: then the
        # kept tensor is elsewhere and the view is stale.
        if cached is None or cached[0] is not shape or cached[1].data_ptr() != ptr:
            if len(self._fast_arrays) > 64:  # each entry keeps its tensor alive: stay small
                self._fast_arrays.clear()
            flat = tensor.view(-1)
            cached = self._fast_arrays[ptr] = (shape, flat, numpy_view(flat))
        return cached[2]
