"""The call lane over its own TCP connections (ddl_triton/runtime/lanes/lane_sockets.py), ranks as threads
of one process meeting in a torch HashStore: messages with and without data, in order; a
mismatch raising on every rank; a closed peer and a silent peer as PeerTimeout; a peer that left
(its farewell) named by the others at once."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from ddl_triton.errors import CollectiveMismatch, CollectiveTimeout, DDLError
from ddl_triton.runtime.lanes import call_lane
from ddl_triton.transports.job_network import host_addresses as _addresses
from ddl_triton.runtime.lanes.lane_sockets import LaneSockets
from ddl_triton.transports.waits import PeerTimeout


class _Counter:
    bytes_sent = 0
    bytes_received = 0


def _on_threads(size: int, body, timeout: float = 10.0):
    """body(rank, lane) on ``size`` threads, each with a CallLane over LaneSockets; what each
    returned or raised, by rank."""
    store = dist.HashStore()
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            sockets = LaneSockets(store, rank, size, timeout)
            lane = call_lane.CallLane(sockets, rank, size, 1024, timeout, 0.0, _Counter())
            try:
                out[rank] = body(rank, lane)
            finally:
                lane.close()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def _head(numel: int, nbytes: int = 0) -> bytes:
    return call_lane.header((0, 0, 0, numel, 0, 0), nbytes)


def test_messages_with_and_without_data_arrive_in_order():
    def body(rank, lane):
        got = []
        for call in range(1, 6):
            nbytes = 8 * call if call % 2 else 0  # data on odd calls, a bare check on even ones
            if nbytes:
                parity = lane.claim_send_buffer()
                lane.data_view(None, parity, nbytes)[:] = np.full(nbytes, rank * 10 + call, dtype=np.uint8)
            lane.exchange(call, _head(call, nbytes), nbytes)
            if nbytes:
                got.append({p: lane.data_view(p, 0, nbytes).tolist() for p in lane.peers})
                lane.done_reading()
        return got

    out = _on_threads(3, body)
    for rank in range(3):
        assert not isinstance(out[rank], BaseException), out[rank]
        for i, call in enumerate((1, 3, 5)):
            assert out[rank][i] == {p: [p * 10 + call] * (8 * call) for p in range(3) if p != rank}


def test_a_mismatch_raises_on_every_rank():
    def body(rank, lane):
        lane.exchange(1, _head(10))
        lane.exchange(2, _head(10 + (rank == 2)))  # the last rank calls another size

    out = _on_threads(3, body)
    for rank in range(3):
        assert isinstance(out[rank], CollectiveMismatch), out[rank]
        assert "rank 2: " in str(out[rank]) and f"rank {rank}:" in str(out[rank])


def _timed_exchange(lane, call: int):
    """(the PeerTimeout call ``call``'s exchange raised, seconds it took), or "nothing raised"."""
    t0 = time.monotonic()
    try:
        lane.exchange(call, _head(4))
    except PeerTimeout as e:
        return e, time.monotonic() - t0
    return "nothing raised"


def test_a_closed_peer_is_lost_at_once_and_a_silent_one_times_out():
    def body(rank, lane):
        lane.exchange(1, _head(4))
        if rank == 1:
            lane.close()  # gone: rank 0 must hear of it now
            return "closed"
        return _timed_exchange(lane, 2)

    out = _on_threads(2, body, timeout=20.0)
    assert out[1] == "closed"
    err, seconds = out[0]
    assert err.dead and err.peer == 1 and seconds < 5, (err, seconds)

    def silent(rank, lane):
        if rank == 1:
            time.sleep(1.5)  # never sends: rank 0 waits out its 0.5 s deadline
            return "silent"
        return _timed_exchange(lane, 1)

    out = _on_threads(2, silent, timeout=0.5)
    err, seconds = out[0]
    assert not err.dead and err.peer == 1 and 0.4 < seconds < 1.4, (err, seconds)


def test_the_addresses_follow_gloo_socket_ifname(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _addresses() == ["127.0.0.1"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface")
    assert _addresses() == ["127.0.0.1"]  # nothing found: loopback, and a peer elsewhere fails to connect
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert all(not a.startswith("127.") for a in _addresses()) or _addresses() == ["127.0.0.1"]


@pytest.mark.parametrize("size", [1, 2])
def test_a_lane_of_one_or_two_ranks_connects_and_closes(size):
    out = _on_threads(size, lambda rank, lane: sorted(lane.wire.sockets.socks))
    assert out == {r: [p for p in range(size) if p != r] for r in range(size)}


def test_a_peer_that_never_connects_is_a_timeout_naming_it():
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"rank 1: rank 0 \(host unknown\) did not publish the call lane's secret "
                                                r"and address within 0.5 s"):
        LaneSockets(dist.HashStore(), 1, 2, 0.5)  # rank 0 never gets there (no placement: no host to name)
    assert time.monotonic() - t0 < 3
    with pytest.raises(CollectiveTimeout, match=r"rank 0: rank 1 \(host unknown\) did not connect to the call lane within 0.5 s"):
        LaneSockets(dist.HashStore(), 0, 2, 0.5)


def test_addresses_that_do_not_answer_are_listed():
    store = dist.HashStore()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there now
    store.set("lane-secret", bytes(32))
    store.set("lane-0", f"127.0.0.1:{port}")
    with pytest.raises(DDLError, match=f"rank 1: the call lane cannot reach rank 0 at any of its addresses: 127.0.0.1:{port}"):
        LaneSockets(store, 1, 2, 2.0)


def test_a_stranger_connecting_first_is_ignored():
    store = dist.HashStore()
    out = {}

    def rank0():
        out[0] = sorted(LaneSockets(store, 0, 2, 10.0).socks)

    t = threading.Thread(target=rank0)
    t.start()
    store.wait(["lane-0"])
    host, port = store.get("lane-0").decode().split(",")[0].rsplit(":", 1)
    socket.create_connection((host, int(port))).close()  # connects, names no rank, leaves
    with socket.create_connection((host, int(port))) as liar:
        liar.sendall(struct.pack("<q", 7))  # names a rank that is not in the job
        out[1] = sorted(LaneSockets(store, 1, 2, 10.0).socks)
        t.join(10)
    assert out == {0: [1], 1: [0]}


def test_closed_peers_tells_a_closed_connection_from_an_idle_one_without_waiting():
    """An elastic job asks which lane peers have gone (their process ended: the connection is at its
    end); an idle but open connection must not make it wait for the socket's timeout."""
    import socket
    import time

    from ddl_triton.runtime.lanes.lane_sockets import LaneSockets

    a1, b1 = socket.socketpair()
    a2, b2 = socket.socketpair()
    for s in (a1, a2):
        s.settimeout(5.0)  # as the lane's sockets carry the deadline
    lane = object.__new__(LaneSockets)
    lane.socks = {1: a1, 2: a2}
    b2.close()  # peer 2's process ended; peer 1 is alive and silent
    start = time.monotonic()
    assert lane.closed_peers() == [2]
    assert time.monotonic() - start < 1.0
    assert a1.gettimeout() == 5.0  # the socket is left as it was
    for s in (a1, a2, b1):
        s.close()


def test_a_peer_that_leaves_instead_of_calling_is_named_at_once_and_a_clean_close_raises_nothing():
    """Rank 1 closes its lane with a farewell (it finalized after call 1); ranks 0 and 2 exchange call 2:
    both raise CollectiveSkipped naming rank 1 and what it did, long before the 10 s deadline. Then
    every rank closing after the same calls (each a farewell to the others) raises nothing."""
    from ddl_triton.errors import CollectiveSkipped
    from ddl_triton.runtime.lanes.farewell import Farewell, Leaving

    def body(rank, lane):
        lane.exchange(1, _head(4))
        if rank == 1:
            lane.close(Farewell(Leaving.FINALIZED, 1))
            return "left"
        t0 = time.monotonic()
        try:
            lane.exchange(2, _head(4))
        except CollectiveSkipped as e:
            return e, time.monotonic() - t0
        return "nothing raised"

    out = _on_threads(3, body)
    assert out[1] == "left"
    for rank in (0, 2):
        error, seconds = out[rank]
        assert str(error).startswith(f"rank {rank}: rank 1 (host unknown) called finalize while rank {rank} waits in "
                                     "allreduce #2 (rank 1 had issued 1 collective on this communicator)"), error
        assert seconds < 2.0, seconds

    def clean(rank, lane):
        for call in (1, 2):
            lane.exchange(call, _head(4))
        lane.close(Farewell(Leaving.EXIT, 2))
        return "closed"

    assert _on_threads(3, clean) == {0: "closed", 1: "closed", 2: "closed"}
