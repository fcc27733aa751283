"""MpiTransport.push_sends (transports/mpi.py): a wait on shm keeps the same communicator's MPI sends moving.

Testing a request MPI has already completed runs no progress (MPICH returns at once), so
push_sends must pass over the sends already done, which stay listed until the next acquire
reaps them, and test the first one still in flight. Testing only the first listed send let a
ring over 2 hosts x 2 ranks hang: its later chunk's rendezvous never moved.
"""
from __future__ import annotations

from ddl_triton.transports import mpi


def _transport_with(sends):
    t = mpi.MpiTransport.__new__(mpi.MpiTransport)  # no communicator needed: only the send list
    t._sending = [(reqs, None, 1) for reqs in sends]
    return t


def test_push_sends_tests_the_first_send_still_in_flight(monkeypatch):
    done = {"a", "b"}
    tested = []

    def complete(reqs):
        tested.append(reqs)
        return reqs in done

    monkeypatch.setattr(mpi, "_complete", complete)
    _transport_with(["a", "b", "c", "d"]).push_sends()
    assert tested == ["a", "b", "c"]  # c is in flight: testing it ran MPI's progress, which moves d too


def test_push_sends_with_every_send_done_or_none_in_flight(monkeypatch):
    tested = []
    monkeypatch.setattr(mpi, "_complete", lambda reqs: tested.append(reqs) or True)
    _transport_with(["a", "b"]).push_sends()
    _transport_with([]).push_sends()
    assert tested == ["a", "b"]
