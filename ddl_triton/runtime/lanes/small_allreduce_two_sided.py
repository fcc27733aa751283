"""The small-message allreduce across a two-sided transport (MPI, gloo): one-shot, its data in the call lane.

Semantics: exactly the ``one_shot`` schedule's allreduce (schedules/one_shot.py) for one chunk,
as on shm (small_allreduce.py): every rank sends its tensor to every peer, then reduces every
rank's copy *in rank order* (its own in its place) straight into the tensor, with the scale of
"avg" applied once at the end; so the result is bitwise what one_shot computes, and identical on
every rank. It serves the same calls as the shm lane (fp32, fp64, int32, int64; at most
``LIMIT_BYTES``; the planner chose one_shot), on a communicator with a call lane: some peer is
reached over a two-sided transport (ranks on different hosts, or ``Options.transport="mpi"``).
Where a host holds several of its ranks, the lane messages between them go over that transport
too (MPI's own shared memory within a host, gloo's loopback), not over ddl_triton's shm.

The data travels in the call lane's message (call_lane.py), after the call's fingerprint: the
call check costs no message of its own, and stays on whatever ``Options.check_calls`` says. A
peer on the general path (a different call) sends its lane message too, so a mismatch is found
on both sides at once.

Small broadcasts take the same lane (``broadcast``): every rank sends its lane message, the
root's carrying its tensor, and every other rank copies the root's bytes. DDP broadcasts its
buffers (batch-norm statistics, a few KB) at every forward; on the general path across hosts
that cost ddl about 2 points of the CNN's step against gloo (bench/results/train_scaling_across_hosts.md).

Why it exists: across hosts the general path costs a call-check round trip, then the executor's
per-step Python (receive posting, staging, sends, flush): about 130 us at 8 B against MPICH's
14 us on the testbed (bench/results/collectives_across_hosts.md). Here a call is one send and
one receive per peer, and numpy's arithmetic on buffers posted once. Where ranks share a host and
its cores, the general path's shm and MPI phases cost most: 8 B took 812 us at 2 emulated hosts x 2
ranks on 2 cores, and 137 us here.
"""
from __future__ import annotations

import numpy as np
import torch

from .call_lane import CallLane, header

LIMIT_BYTES = 64 * 1024  # the planner's one_shot range across hosts ends about here (bench/results/)
_NUMPY_OPS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum}
_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
# A broadcast only copies bytes: every dtype the collectives take (ddl_triton/ops.py).
_BROADCAST_DTYPES = _DTYPES + (torch.float16, torch.bfloat16)


def lane_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's numpy view in the lane takes: 16-bit floats travel as their bits (numpy
    has no bfloat16), which only a broadcast carries (it copies, never adds)."""
    return torch.int16 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Shape:
    """A call shape's fingerprint and its typed views of the lane's buffers, prepared once."""

    __slots__ = ("head", "nbytes", "own", "operands", "combine", "scale")

    def __init__(self, lane: CallLane, op: str, dtype: torch.dtype, numel: int, fingerprint):
        self.nbytes = numel * dtype.itemsize
        self.head = header(fingerprint, self.nbytes)
        np_dtype = torch.empty(0, dtype=lane_dtype(dtype)).numpy().dtype
        self.own = tuple(lane.data_view(None, parity, self.nbytes).view(np_dtype) for parity in (0, 1))
        peers = {p: lane.data_view(p, 0, self.nbytes).view(np_dtype) for p in lane.peers}
        # every rank's copy in rank order, per send parity (this rank's copy is its send buffer)
        self.operands = tuple(tuple(self.own[parity] if r == lane.rank else peers[r] for r in range(lane.size))
                              for parity in (0, 1))
        self.combine = _NUMPY_OPS[op]
        self.scale = np_dtype.type(1.0 / lane.size) if op == "avg" else None


class SmallAllreduceTwoSided:
    """One-shot allreduce of small tensors through ``lane`` (every peer through the lane's transport)."""

    def __init__(self, lane: CallLane):
        self.lane = lane
        self.limit = min(LIMIT_BYTES, lane.limit)

    def serves(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``nbytes`` of ``dtype`` takes this path (any op valid for the dtype)."""
        return dtype in _DTYPES and 0 < nbytes <= self.limit

    def serves_broadcast(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a broadcast of ``nbytes`` of ``dtype`` takes this path."""
        return dtype in _BROADCAST_DTYPES and 0 < nbytes <= self.limit

    def shape(self, op: str, dtype: torch.dtype, numel: int, fingerprint) -> _Shape:
        return _Shape(self.lane, op, dtype, numel, fingerprint)

    def broadcast(self, out: np.ndarray, shape: _Shape, seq: int, root: int) -> None:
        """Copy rank ``root``'s ``out`` (1-D, contiguous) into every rank's, as collective ``seq``
        (``shape`` from ``shape("sum", ...)`` with the broadcast's fingerprint). Raises as ``run``."""
        lane = self.lane
        parity = lane.claim_send_buffer()
        if lane.rank == root:
            np.copyto(shape.own[parity], out)  # the others' bytes ride along unread
        lane.exchange(seq, shape.head, shape.nbytes)
        if lane.rank != root:
            np.copyto(out, shape.operands[parity][root])
        lane.done_reading()

    def run(self, out: np.ndarray, shape: _Shape, seq: int) -> None:
        """Allreduce ``out`` (1-D, contiguous) in place as collective number ``seq``. Raises
        PeerTimeout like a transport, and CollectiveMismatch when a peer makes a different call."""
        lane = self.lane
        parity = lane.claim_send_buffer()
        np.copyto(shape.own[parity], out)
        lane.exchange(seq, shape.head, shape.nbytes)
        operands = shape.operands[parity]
        combine = shape.combine
        combine(operands[0], operands[1], out=out)
        for x in operands[2:]:
            combine(out, x, out=out)
        lane.done_reading()
        if shape.scale is not None:
            np.multiply(out, shape.scale, out=out)
