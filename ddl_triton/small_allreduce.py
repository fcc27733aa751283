"""The small-message allreduce: one-shot over shared memory, without the schedule machinery.

Semantics: exactly the ``one_shot`` schedule's allreduce (schedules/one_shot.py) for one
chunk: every rank copies its tensor into its shm slot as its next message, then reduces
every rank's copy *in rank order* (its own in its place) straight into the tensor, with
the scale of "avg" applied once at the end. Same messages, same message numbering (each
rank sends one message, read by every peer), same order of operations: the result is
bitwise what the one_shot schedule computes, and identical on every rank.

Why it exists: below a few KiB an allreduce is all fixed cost, and the general path spends
most of it in Python (plan lookup, the step loop, torch's per-op dispatch of ~2 us). Here
the reduction is numpy on the slot views (about 0.5 us per operation instead of 2) and
nothing is looked up per call. It serves calls that:
- run on a communicator whose every peer is reached over shm,
- move at most ``LIMIT_BYTES`` (and fit one slot),
- use fp32, fp64, int32 or int64 (whose numpy arithmetic is the same IEEE / two's-complement
  operation as torch's: 16-bit floats accumulate in fp32 in torch, so they stay on the
  general path),
- and would run one_shot anyway (no other schedule forced).
Every rank decides from the call's arguments alone, so all ranks take the same path.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

# An inf from overflow is a result here, as in torch; numpy would also warn about it. Silenced for
# this module's ufunc calls only (np.errstate per call would cost more than the reduction).
warnings.filterwarnings("ignore", category=RuntimeWarning, module=__name__)

LIMIT_BYTES = 16 * 1024
_NUMPY_OPS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum}
_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


class SmallAllreduce:
    """One-shot allreduce of small tensors for a communicator whose peers are all on shm."""

    def __init__(self, shm, executor, rank: int, size: int, timeout: float):
        self.shm = shm
        self.executor = executor
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.peers = tuple(p for p in range(size) if p != rank)
        self.limit = min(LIMIT_BYTES, shm.slot_bytes)
        # Scales as numpy scalars of the tensor's dtype: one multiply in that dtype, as torch's mul_.
        self._scale = {torch.float32: np.float32(1.0 / size), torch.float64: np.float64(1.0 / size)}

    def serves(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``nbytes`` of ``dtype`` takes this path (any op: the op's
        validity for the dtype is checked before any call gets here)."""
        return dtype in _DTYPES and 0 < nbytes <= self.limit

    def run(self, flat: torch.Tensor, op: str) -> None:
        """Allreduce ``flat`` (contiguous, 1-D) in place. Raises PeerTimeout like a transport."""
        shm, base, timeout, n, dtype = self.shm, self.executor.next_msg, self.timeout, flat.numel(), flat.dtype
        me = self.rank
        out = flat.numpy()
        msg_id = base[me]
        shm.acquire(msg_id, self.peers, n, dtype, timeout)
        own = shm.slot_array(shm.local_rank, msg_id, n, dtype)
        np.copyto(own, out)
        shm.publish(msg_id)
        # Operands in rank order, this rank's in its place (as one_shot's local_pos). Its own is
        # read from its published slot, which stays put until every peer has released it, so
        # the result can be accumulated straight into the tensor.
        operands = [own if q == me else shm.recv_array(q, base[q], n, dtype, timeout) for q in range(self.size)]
        combine = _NUMPY_OPS[op]
        combine(operands[0], operands[1], out=out)
        for x in operands[2:]:
            combine(out, x, out=out)
        if op == "avg":
            np.multiply(out, self._scale[dtype], out=out)
        for q in self.peers:
            shm.release(q, base[q])
            base[q] += 1
        base[me] += 1
