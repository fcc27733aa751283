"""MPI's own allreduce of a group step runs in pieces, a bounded number in flight, covering the
tensor exactly once (transports/mpi.py: ``allreduce_group``)."""
from __future__ import annotations

import torch

from transports import mpi


class _Request:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def Test(self):
        self.log.append(("done", self.index))
        return True


class _Sub:
    """Records each Iallreduce's buffer (a numpy view) and the requests in flight when it was posted."""

    def __init__(self):
        self.log, self.views, self.in_flight = [], [], []

    def Iallreduce(self, _in_place, spec, _op):
        done = sum(1 for e in self.log if e[0] == "done")
        self.in_flight.append(len(self.views) - done)
        self.views.append(spec[0])
        spec[0][:] += 1  # stands for the reduction: every element must be touched exactly once
        return _Request(self.log, len(self.views) - 1)


def _transport(sub):
    t = mpi.MpiTransport.__new__(mpi.MpiTransport)
    t.comm = type("C", (), {"Get_rank": staticmethod(lambda: 0)})()
    t._group_comms = {(0, 1): sub}
    t.spin, t.bytes_sent, t.bytes_received = 0.0, 0, 0
    return t


def test_a_large_group_allreduce_runs_in_pieces_each_element_once_and_a_bounded_number_in_flight():
    sub = _Sub()
    n = 5 * (mpi._GROUP_PIECE_BYTES // 4) + 3  # five whole pieces and a short one
    x = torch.zeros(n)
    _transport(sub).allreduce_group((0, 1), x, "sum", 5.0)
    assert len(sub.views) == 6 and all(v.size == mpi._GROUP_PIECE_BYTES // 4 for v in sub.views[:5])
    assert torch.equal(x, torch.ones(n))
    assert max(sub.in_flight) == mpi._GROUP_DEPTH - 1  # the next is posted once the oldest is done


def test_a_small_or_16_bit_group_allreduce_is_one_piece_and_written_back():
    sub = _Sub()
    x = torch.zeros(10, dtype=torch.bfloat16)
    _transport(sub).allreduce_group((0, 1), x, "sum", 5.0)
    assert len(sub.views) == 1 and torch.equal(x, torch.ones(10, dtype=torch.bfloat16))
