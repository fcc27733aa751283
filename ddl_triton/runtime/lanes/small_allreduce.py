"""The small-message allreduce: one-shot over a dedicated shared-memory lane, checked in its flag word.

Semantics: exactly the ``one_shot`` schedule's allreduce (schedules/one_shot.py) for one
chunk: every rank copies its tensor into shared memory, then reduces every rank's copy *in
rank order* (its own in its place) straight into the tensor, with the scale of "avg" applied
once at the end. Same order of operations as one_shot, so the result is bitwise what the
one_shot schedule computes, and identical on every rank.

It serves calls that:
- run on a communicator whose every peer is reached over shm,
- move at most ``LIMIT_BYTES``,
- use fp32, fp64, int32 or int64 (whose numpy arithmetic is the same IEEE / two's-complement
  operation as torch's: 16-bit floats accumulate in fp32 in torch, so they stay on the
  general path),
- and would run one_shot anyway (no other schedule forced or tuned).
Every rank decides from the call's shape alone (numel, dtype, op), so all ranks take it together.

**The lane.** Each rank's shm segment has, besides the general path's slots, two lane buffers
of ``LIMIT_BYTES`` and one lane flag word. Lane call ``k`` (counted per communicator) writes
buffer ``k % 2`` then stores ``k << 24 | code`` in the flag word, where ``code`` is the call's
op, dtype and element count, encoded exactly (not hashed) in 24 bits. Readers wait until a
peer's flag shows call ``k``, then one comparison of the whole word checks both that the data
is there and that the peer is making the same call: the call check rides in the data's own
flag word, so it costs nothing and stays on whatever ``Options.check_calls`` says. A peer
whose flag already shows ``k + 1`` (it finished call ``k`` and started the next) left its
word for ``k`` in buffer ``k % 2``'s header, which the check then reads instead.

Why two buffers suffice without "consumed" flags: a rank overwrites buffer ``k % 2`` in call
``k + 2`` only after it saw every peer's flag reach ``k + 1``, and a peer publishes ``k + 1``
only after it finished reading call ``k``.

A peer that is not on the lane at all (a different collective, or a different allreduce that
takes the general path) never raises the flag. After its spin, a waiting lane call therefore
posts its fingerprint where the general path's call check looks (``ShmTransport.
post_fingerprint``) and waits with the call checker's hook active, so a mismatch is reported on
both sides within a quarter second (ddl_triton/runtime/lanes/call_check.py), and a dead peer within its liveness
period, as on the general path.

Why it exists: below about 100 KiB an allreduce is mostly fixed cost, and the general path spends most of
it in Python (plan lookup, call-check exchange, the step loop, torch's per-op dispatch of about
2 us). Here the data moves with numpy (about 0.2 us per copy or reduction of a few KiB) and the
flags are single memoryview loads and stores (about 30 ns).
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from ...errors import calls_disagree
from ...ops import DTYPES, OPS
from ...transports.waits import wait_until

# An inf from overflow is a result here, as in torch; numpy would also warn about it. Silenced for
# this module's ufunc calls only (np.errstate per call would cost more than the reduction).
warnings.filterwarnings("ignore", category=RuntimeWarning, module=__name__)

LIMIT_BYTES = 128 * 1024
LANE_BYTES = 2 * LIMIT_BYTES  # what ShmTransport reserves per segment for the lane's two buffers
_NUMPY_OPS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum}
_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_CODE_BITS = 24  # op (3 bits) | dtype (4 bits) | element count (17 bits: 128 KiB of 4-byte elements is 2^15)
_NUMEL_BITS = 17


def encode(op: str, dtype: torch.dtype, numel: int) -> int:
    """The call's exact 24-bit code for the flag word (see the module doc)."""
    return (OPS.index(op) << 21) | (DTYPES.index(dtype) << _NUMEL_BITS) | numel


def describe(code: int) -> str:
    """ "allreduce(sum, 4 x float32)" for a code, as calls.describe writes a fingerprint."""
    op, dtype, numel = OPS[code >> 21 & 7], DTYPES[code >> _NUMEL_BITS & 15], code & ((1 << _NUMEL_BITS) - 1)
    return f"allreduce({op}, {numel} x {str(dtype).replace('torch.', '')})"


class _Shape:
    """What a call shape needs, prepared once: its code, the call checker's fingerprint, the
    numpy views of every rank's lane buffers (per buffer parity) and the reduction."""

    __slots__ = ("code", "fingerprint", "own", "operands", "combine", "scale", "numel", "dtype", "peer_bytes")

    def __init__(self, lane: "SmallAllreduce", op: str, dtype: torch.dtype, numel: int, fingerprint):
        self.code = encode(op, dtype, numel)
        self.fingerprint = fingerprint
        self.numel, self.dtype = numel, dtype
        self.peer_bytes = numel * dtype.itemsize * (lane.size - 1)  # sent, and received, per call
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        views = [[lane.shm.lane_buffer(local, parity)[:numel * dtype.itemsize].view(np_dtype)
                  for parity in (0, 1)] for local in lane.locals_in_rank_order]
        self.own = (views[lane.rank][0], views[lane.rank][1])
        self.operands = tuple(tuple(v[parity] for v in views) for parity in (0, 1))
        self.combine = _NUMPY_OPS[op]
        self.scale = np_dtype.type(1.0 / lane.size) if op == "avg" else None


class SmallAllreduce:
    """One-shot allreduce of small tensors for a communicator whose peers are all on shm."""

    def __init__(self, shm, rank: int, size: int, world_of_local, timeout: float, calls=None):
        self.shm = shm
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.calls = calls  # the call checker (fingerprints.py), or None when Options.check_calls is off
        self.limit = min(LIMIT_BYTES, shm.lane_bytes // 2)
        local_of = {w: i for i, w in enumerate(world_of_local)}
        self.locals_in_rank_order = [local_of[r] for r in range(size)]
        # (rank, its flag words, its local rank) for every peer, in rank order
        self._peers = tuple((r, shm.flag_words(local_of[r]), local_of[r]) for r in range(size) if r != rank)
        self._own_words = shm.flag_words(shm.local_rank)
        self._flag, self._heads = shm.LANE_FLAG_WORD, shm.LANE_HEAD_WORDS
        self._calls_made = 0

    def serves(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether an allreduce of ``nbytes`` of ``dtype`` takes this path (any op: the op's
        validity for the dtype is checked before any call gets here)."""
        return dtype in _DTYPES and 0 < nbytes <= self.limit

    def shape(self, op: str, dtype: torch.dtype, numel: int, fingerprint) -> _Shape:
        return _Shape(self, op, dtype, numel, fingerprint)

    def run(self, out: np.ndarray, shape: _Shape, seq: int) -> None:
        """Allreduce ``out`` (1-D, contiguous, ``shape.numel`` elements) in place as this
        communicator's collective number ``seq``. Raises PeerTimeout like a transport, and
        CollectiveMismatch when a peer makes a different call."""
        k = self._calls_made = self._calls_made + 1
        parity = k & 1
        word = k << _CODE_BITS | shape.code
        own_words = self._own_words
        np.copyto(shape.own[parity], out)
        own_words[self._heads[parity]] = word  # for a peer that finds our flag already at k + 1
        own_words[self._flag] = word           # after the data: x86-64's store order keeps it so
        flag, ready = self._flag, k << _CODE_BITS
        for peer, words, local in self._peers:
            seen = words[flag]
            if seen != word:
                if seen < ready:
                    seen = self._wait(peer, words, local, ready, shape, seq)
                if seen >> _CODE_BITS != k:  # the peer is one call ahead: its word for k is in the header
                    seen = words[self._heads[parity]]
                if seen != word:
                    self._mismatch(seq, shape, k)
        shm = self.shm
        shm.bytes_sent += shape.peer_bytes
        shm.bytes_received += shape.peer_bytes
        operands = shape.operands[parity]
        combine = shape.combine
        combine(operands[0], operands[1], out=out)
        for x in operands[2:]:
            combine(out, x, out=out)
        if shape.scale is not None:
            np.multiply(out, shape.scale, out=out)

    def _wait(self, peer: int, words, local: int, ready: int, shape: _Shape, seq: int) -> int:
        """Wait for ``peer``'s flag to reach ``ready``; returns the flag word it shows."""
        shm, flag = self.shm, self._flag
        end = time.perf_counter() + shm.spin
        while time.perf_counter() < end:
            seen = words[flag]
            if seen >= ready:
                return seen
        # Slow: the peer may be in another collective. Post this call where the general path's
        # call check looks, and let the checker's hook compare while we wait.
        calls = self.calls
        if calls is not None:
            shm.post_fingerprint(seq, shape.fingerprint)
            calls.watch(seq, shape.fingerprint)
        try:
            wait_until(lambda: words[flag] >= ready, self.timeout, peer,
                       f"shm lane call {ready >> _CODE_BITS}", spin=0.0,
                       alive=shm.liveness_check(local))
        finally:
            if calls is not None:
                calls.watch(None, None)
        return words[flag]

    def _mismatch(self, seq: int, shape: _Shape, k: int) -> None:
        """Raise CollectiveMismatch listing every rank's lane call ``k`` as far as it is known."""
        mask = (1 << _CODE_BITS) - 1
        calls = {self.rank: describe(shape.code)}
        for peer, words, _ in self._peers:
            seen = words[self._flag]
            if seen >> _CODE_BITS > k:
                seen = words[self._heads[k & 1]]
            calls[peer] = describe(seen & mask) if seen >> _CODE_BITS == k else "(has not reached this call yet)"
        raise calls_disagree(self.rank, seq, calls, self.size)
