"""The elastic control plane's store traffic does not grow with the world (ddl_triton/elastic/membership.py):
members in one process, each with its own client of a real TCPStore, whose calls are counted.

What must hold: while nothing fails, a member's watcher sends (next to) nothing, at 2 members as at 6
(it used to poll the store 20 times a second each); to agree after a loss, a member makes as many
store requests in a world of 8 as in a world of 2 (it used to read two keys per member per poll).
Counts only: the idle window's length is not asserted, nor how long anything took."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddl_triton.elastic.membership import Membership
from ddl_triton.transports import failure_notice


@pytest.fixture(autouse=True)
def _no_revocation_left():
    yield
    failure_notice.clear_revocation()


class _Counting:
    """A store client that counts the calls made through it (its clones count into the same box)."""

    def __init__(self, store, box=None):
        self._store, self._box = store, box if box is not None else [0]

    @property
    def calls(self) -> int:
        return self._box[0]

    def clone(self):
        self._box[0] += 1
        return _Counting(self._store.clone(), self._box)

    def __getattr__(self, name):
        attr = getattr(self._store, name)

        def counted(*args, **kwargs):
            self._box[0] += 1
            return attr(*args, **kwargs)
        return counted


def _world(size: int, grace: float = 0.5) -> tuple[object, list[Membership]]:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=20), wait_for_workers=False)
    members = []
    for rank in range(size):
        client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=20), wait_for_workers=False)
        m = Membership(_Counting(client), rank, f"h{rank}", 20.0, grace)
        m.start(rank, size)
        members.append(m)
    return server, members


def _idle_calls(size: int) -> list[int]:
    """Each member's store calls during one second of a world where nothing fails."""
    server, members = _world(size)
    try:
        for m in members:
            m.watch()
        end = time.monotonic() + 10  # every watcher armed (blocked on its notice) before counting
        while any(getattr(m, "_watching", "armed") == "" for m in members) and time.monotonic() < end:
            time.sleep(0.01)
        before = [m.store.calls for m in members]
        time.sleep(1.0)
        return [m.store.calls - b for m, b in zip(members, before)]
    finally:
        for m in members:
            m.close()


def test_an_idle_member_sends_next_to_nothing_whatever_the_worlds_size():
    two, six = _idle_calls(2), _idle_calls(6)
    # At most one re-armed wait each (a deadline's worth of idling); the old watcher polled 20 times a second.
    assert max(two) <= 2 and max(six) <= 2, (two, six)


def _agreement_calls(size: int) -> list[int]:
    """Each survivor's store calls to agree on a new world after the last member died (another
    survivor saw its sockets close and said so)."""
    server, members = _world(size, grace=5.0)
    survivors = members[:-1]
    survivors[0].mark_gone([size - 1])
    before = [m.store.calls for m in survivors]
    results = {}
    threads = [threading.Thread(target=lambda m=m: results.setdefault(m.member, m.agree("lost"))) for m in survivors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {tuple(d.members) for d in results.values()} == {tuple(range(size - 1))}, results
    return [m.store.calls - b for m, b in zip(survivors, before)]


def test_agreeing_costs_a_member_as_many_requests_in_a_large_world_as_in_a_small_one():
    small, large = _agreement_calls(2), _agreement_calls(8)
    # The old agreement read two keys per member per poll: 8 members, at least 16 a poll.
    assert max(large) <= max(small) + 4, (small, large)
