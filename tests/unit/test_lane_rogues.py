"""Strangers on the call lane's port (ddl_triton/runtime/lanes/lane_sockets.py, lane_handshake.py): a client
that connects first and names a rank, one that stays silent, one that sends garbage, a real rank with
another secret, a squatter on a published address; and where the lane listens. Ranks are threads of
one process meeting in a torch HashStore; each genuine pair then adds known integers over the lane,
so a stranger taken for a peer shows as a wrong sum or a lost peer."""
from __future__ import annotations

import re
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

from ddl_triton.errors import CollectiveTimeout, DDLError
from ddl_triton.runtime.lanes import call_lane, lane_handshake
from ddl_triton.runtime.lanes.lane_sockets import LaneSockets

_N = 8  # int64 elements per call


class _Counter:
    bytes_sent = 0
    bytes_received = 0


def _head(nbytes: int) -> bytes:
    return call_lane.header((0, 0, 0, _N, 0, 0), nbytes)


def _sums(rank: int, lane) -> list[list[int]]:
    """Three calls of a 2-rank allreduce-like exchange: own values plus the peer's, per call."""
    sums = []
    for call in range(1, 4):
        parity = lane.claim_send_buffer()
        lane.data_view(None, parity, 8 * _N).view(np.int64)[:] = (rank + 1) * call * np.arange(_N)
        lane.exchange(call, _head(8 * _N), 8 * _N)
        peer = lane.data_view(1 - rank, 0, 8 * _N).view(np.int64)
        sums.append(((rank + 1) * call * np.arange(_N) + peer).tolist())
        lane.done_reading()
    return sums


_EXACT = [(3 * call * np.arange(_N)).tolist() for call in range(1, 4)]


def _two_ranks(rogue, timeout: float = 10.0, store_of_rank1=None):
    """Rank 0 starts alone; once it has published its address, ``rogue(store)`` runs and returns the
    sockets it opened (kept open until both ranks are done), then rank 1 starts. Returns (per rank:
    (seconds from the rogue's start until its LaneSockets were ready, _sums) or what it raised; the
    rogue's sockets' own addresses)."""
    store = dist.HashStore()
    out: dict[int, object] = {}
    ready: dict[int, float] = {}

    def run(rank: int, st) -> None:
        try:
            sockets = LaneSockets(st, rank, 2, timeout)
            ready[rank] = time.monotonic()
            lane = call_lane.CallLane(sockets, rank, 2, 1024, timeout, 0.0, _Counter())
            try:
                out[rank] = _sums(rank, lane)
            finally:
                lane.close()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out[rank] = e

    first = threading.Thread(target=run, args=(0, store))
    first.start()
    store.wait(["lane-0"], timedelta(seconds=10))
    rogue_start = time.monotonic()
    kept = rogue(store)
    second = threading.Thread(target=run, args=(1, store_of_rank1(store) if store_of_rank1 else store))
    second.start()
    for t in (first, second):
        t.join(30)
    names = [s.getsockname() for s in kept]
    for s in kept:
        s.close()
    assert not first.is_alive() and not second.is_alive(), "a rank hung"
    timed = {r: got if isinstance(got, BaseException) else (ready[r] - rogue_start, got) for r, got in out.items()}
    return timed, names


def _rank0_address(store) -> tuple[str, int]:
    host, port = store.get("lane-0").decode().split(",")[0].rsplit(":", 1)
    return host, int(port)


def _assert_exact(out, within: float) -> None:
    for rank in (0, 1):
        assert not isinstance(out[rank], BaseException), out[rank]
        took, sums = out[rank]
        assert sums == _EXACT, (rank, sums)
        assert took < within, (rank, took)


def _assert_dropped(err: str, name: tuple[str, int], why: str) -> None:
    """The one stderr line naming the stranger's address (as rank 0 saw it) and why."""
    host, port = name
    line = f"ddl_triton: rank 0: call lane: dropped a connection from {host}:{port}: {why}"
    assert line in err, err


def test_a_stranger_naming_a_rank_first_is_refused_and_cannot_inject_data(capfd):
    def rogue(store):
        liar = socket.create_connection(_rank0_address(store))
        forged = np.full(_N, 1000, dtype=np.int64).tobytes()
        liar.sendall(struct.pack("<q", 1) + 3 * (_head(8 * _N) + forged))  # "I am rank 1", then 3 calls' data
        time.sleep(0.2)  # first in the queue, well before the real rank 1
        return [liar]

    out, kept = _two_ranks(rogue, timeout=5.0)
    _assert_exact(out, within=3.0)
    _assert_dropped(capfd.readouterr().err, kept[0], "sent bytes that are not a call lane handshake")


def test_a_silent_stranger_does_not_delay_init():
    def rogue(store):
        return [socket.create_connection(_rank0_address(store))]  # connects, says nothing, stays

    out, _ = _two_ranks(rogue, timeout=8.0)
    _assert_exact(out, within=2.0)  # not the lane's 8 s, nor the stranger's 5 s handshake deadline


def test_a_silent_stranger_is_dropped_at_its_own_deadline(monkeypatch, capfd):
    monkeypatch.setattr(lane_handshake, "HANDSHAKE_SECONDS", 0.3)
    seen = {}

    def rogue(store):
        mute = socket.create_connection(_rank0_address(store))
        mute.settimeout(3.0)
        t0 = time.monotonic()
        seen["greeting"] = mute.recv(64)
        seen["then"] = mute.recv(64)  # b"": rank 0 gave up on it, before rank 1 even started
        seen["after"] = time.monotonic() - t0
        return [mute]

    out, kept = _two_ranks(rogue, timeout=10.0)
    _assert_exact(out, within=5.0)
    assert seen["greeting"].startswith(lane_handshake.MAGIC) and seen["then"] == b"", seen
    assert 0.2 < seen["after"] < 1.5, seen
    _assert_dropped(capfd.readouterr().err, kept[0], "no handshake within 0.3 s")


def test_a_stranger_sending_garbage_is_dropped_and_logged(capfd):
    def rogue(store):
        junk = socket.create_connection(_rank0_address(store))
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + secrets.token_bytes(64))
        time.sleep(0.2)
        return [junk]

    out, kept = _two_ranks(rogue, timeout=5.0)
    _assert_exact(out, within=3.0)
    _assert_dropped(capfd.readouterr().err, kept[0], "sent bytes that are not a call lane handshake: b'GET / HTTP")


def test_a_flood_of_silent_strangers_does_not_keep_the_real_peer_out(capfd):
    from ddl_triton.runtime.lanes import lane_sockets

    def rogue(store):
        flood = [socket.create_connection(_rank0_address(store)) for _ in range(lane_sockets._MAX_HANDSHAKES + 8)]
        time.sleep(0.3)  # all accepted and greeted before the real rank 1 comes
        return flood

    out, names = _two_ranks(rogue, timeout=8.0)
    _assert_exact(out, within=3.0)
    err = capfd.readouterr().err
    for name in names[:8]:  # the oldest gave way to the newer ones (and these to rank 1)
        _assert_dropped(err, name, f"{lane_sockets._MAX_HANDSHAKES} connections were handshaking at once")


def test_a_flood_of_garbage_is_logged_at_a_bounded_rate_with_a_count(capfd):
    # 300 strangers, each dropped at once for its garbage: ten lines one by one, then counts, which
    # add up to every connection dropped (a flood once printed 2,246 lines in 6 s).
    def rogue(store):
        flood = []
        for _ in range(300):
            s = socket.create_connection(_rank0_address(store))
            s.sendall(b"\x00" * 64)
            flood.append(s)
        time.sleep(0.5)
        return flood

    out, _ = _two_ranks(rogue, timeout=10.0)
    _assert_exact(out, within=8.0)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "rank 0: call lane: dropped" in ln]
    one_by_one = [ln for ln in lines if "dropped a connection from" in ln]
    counts = [int(m) for ln in lines for m in re.findall(r"dropped (\d+) more connection", ln)]
    assert len(one_by_one) == lane_handshake.DropLog.FIRST and len(lines) <= lane_handshake.DropLog.FIRST + 3, lines
    assert len(one_by_one) + sum(counts) == 300, (len(one_by_one), counts)


class _OtherSecret:
    """The store as a rank of another job sees it: its own lane secret, everything else shared."""

    def __init__(self, store):
        self._store, self._secret = store, secrets.token_bytes(lane_handshake.SECRET_BYTES)

    def get(self, key):
        return self._secret if key == "lane-secret" else self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_rank_with_another_secret_is_refused_naming_both_ranks(capfd):
    out, _ = _two_ranks(lambda store: [], timeout=1.5, store_of_rank1=_OtherSecret)
    assert isinstance(out[1], DDLError) and not isinstance(out[1], CollectiveTimeout), out[1]
    assert "rank 1: the call lane cannot reach rank 0 at any of its addresses" in str(out[1]), out[1]
    assert "rank 0 refused it (the two ranks hold different lane secrets)" in str(out[1]), out[1]
    assert isinstance(out[0], CollectiveTimeout), out[0]
    assert re.fullmatch(r"rank 0: rank 1 \(host unknown\) did not connect to the call lane within 1\.5 s; "
                        r"a connection from [0-9.]+:\d+ named rank 1 but its proof is wrong \(it holds another "
                        r"secret than this job's\)", str(out[0])), out[0]
    assert "rank 0: call lane: dropped a connection from " in capfd.readouterr().err


def test_a_squatter_on_a_published_address_is_not_taken_for_the_peer():
    store = dist.HashStore()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    store.set("lane-secret", secrets.token_bytes(lane_handshake.SECRET_BYTES))
    store.set("lane-0", f"127.0.0.1:{squatter.getsockname()[1]}")

    def play_rank0() -> None:  # greets like a lane, cannot prove it is rank 0
        conn, _ = squatter.accept()
        with conn:
            conn.sendall(lane_handshake.MAGIC + bytes(16))
            conn.recv(64)
            conn.sendall(bytes(32))
            conn.recv(1)

    t = threading.Thread(target=play_rank0)
    t.start()
    try:
        with pytest.raises(DDLError, match="rank 1: the call lane cannot reach rank 0 at any of its addresses: "
                                           r"127\.0\.0\.1:\d+ \(answered with a wrong proof: not rank 0 of this job\)"):
            LaneSockets(store, 1, 2, 5.0)
    finally:
        t.join(5)
        squatter.close()


class _SquatterFirst:
    """The store as rank 0 writes it, with a silent squatter's address ahead of rank 0's own."""

    def __init__(self, store, squatter: str):
        self._store, self._squatter = store, squatter

    def set(self, key, value):
        self._store.set(key, f"{self._squatter},{value}" if key == "lane-0" else value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_silent_squatter_ahead_of_the_peer_costs_one_handshake_deadline(monkeypatch):
    monkeypatch.setattr(lane_handshake, "HANDSHAKE_SECONDS", 0.3)
    store = dist.HashStore()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)  # the kernel completes the connection; nobody ever answers on it
    out = {}

    def rank0() -> None:
        try:
            published = _SquatterFirst(store, f"127.0.0.1:{squatter.getsockname()[1]}")
            out[0] = sorted(LaneSockets(published, 0, 2, 10.0).socks)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out[0] = e

    t = threading.Thread(target=rank0)
    t.start()
    try:
        t0 = time.monotonic()
        sockets = LaneSockets(store, 1, 2, 10.0)
        took = time.monotonic() - t0
        sockets.close()
    finally:
        t.join(10)
        squatter.close()
    assert out.get(0) == [1] and 0.25 < took < 3.0, (out, took)  # rank 1 took the squatter for rank 0?


def _listening(port: int) -> list[str]:
    """The local addresses of the listening TCP sockets on ``port`` (from /proc/net/tcp)."""
    found = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_the_lane_listens_on_its_published_addresses_only():
    store = dist.HashStore()
    seen = {}

    def rank0() -> None:
        LaneSockets(store, 0, 2, 10.0).close()

    t = threading.Thread(target=rank0)
    t.start()
    try:
        store.wait(["lane-0"], timedelta(seconds=10))
        for entry in store.get("lane-0").decode().split(","):
            host, port = entry.rsplit(":", 1)
            seen[entry] = _listening(int(port))
    finally:
        LaneSockets(store, 1, 2, 10.0).close()
        t.join(10)
    assert seen and all(found == [entry.rsplit(":", 1)[0]] for entry, found in seen.items()), seen


# ---- the handshake's proofs cannot be replayed, and each lane's secret is its own -----------------------
def _recorded_handshake(secret: bytes) -> tuple[bytes, bytes, bytes]:
    """A real handshake between rank 1 (connector) and rank 0 of a 2-rank lane, over a socketpair, as
    an eavesdropper on the wire records it: (the acceptor's greeting, the connector's proof message,
    the acceptor's answer)."""
    acceptor_end, connector_end = socket.socketpair()
    sent: list[bytes] = []

    class _Recording:  # the connector's socket, keeping what it sends
        def sendall(self, data):
            sent.append(bytes(data))
            return connector_end.sendall(data)

        def __getattr__(self, name):
            return getattr(connector_end, name)

    try:
        greeting = lane_handshake.Greeting(acceptor_end, "pair", secret, 0, 2, time.monotonic() + 5)
        seen_greeting = connector_end.recv(64, socket.MSG_PEEK)
        connector = threading.Thread(target=lambda: lane_handshake.prove(_Recording(), secret, 1, 0, 2,
                                                                         time.monotonic() + 5))
        connector.start()
        end = time.monotonic() + 5
        while greeting.feed() is None and time.monotonic() < end:
            time.sleep(0.005)
        connector.join(5)
    finally:
        acceptor_end.close()
        connector_end.close()
    nonce_a, nonce_c = seen_greeting[len(lane_handshake.MAGIC):], sent[0][16:32]
    # The acceptor's answer as it crossed the wire (what Greeting.feed sent back).
    return seen_greeting, sent[0], lane_handshake._mac(secret, b"accept", 2, 0, 1, nonce_c, nonce_a)


def test_a_connectors_proof_seen_on_the_wire_is_refused_on_another_connection():
    secret = secrets.token_bytes(lane_handshake.SECRET_BYTES)
    _, proof_message, _ = _recorded_handshake(secret)
    a, b = socket.socketpair()
    try:
        greeting = lane_handshake.Greeting(a, "replayer", secret, 0, 2, time.monotonic() + 5)
        b.recv(64)
        b.sendall(proof_message)  # the recorded proof, for the old connection's nonce
        with pytest.raises(lane_handshake.Refused, match="its proof is wrong"):
            end = time.monotonic() + 5
            while greeting.feed() is None and time.monotonic() < end:
                time.sleep(0.005)
    finally:
        a.close()
        b.close()


def test_an_acceptors_answer_seen_on_the_wire_is_refused_on_another_connection():
    secret = secrets.token_bytes(lane_handshake.SECRET_BYTES)
    old_greeting, _, old_answer = _recorded_handshake(secret)
    squatter, connector = socket.socketpair()
    try:
        squatter.sendall(old_greeting)  # the old greeting, its nonce included, then the old answer
        replay = threading.Thread(target=lambda: (squatter.recv(64), squatter.sendall(old_answer)))
        replay.start()
        with pytest.raises(lane_handshake.Refused, match="wrong proof"):
            lane_handshake.prove(connector, secret, 1, 0, 2, time.monotonic() + 5)
        replay.join(5)
    finally:
        squatter.close()
        connector.close()


def test_every_lane_draws_its_own_secret():
    # Two lanes (two jobs, or two communicators of one) never share a secret: a constant secret would
    # let a rank of any job prove itself on every other job's lane.
    drawn = [lane_handshake.lane_secret(dist.HashStore(), 0, time.monotonic() + 5, 5.0) for _ in range(3)]
    assert len(set(drawn)) == 3 and all(len(s) == lane_handshake.SECRET_BYTES for s in drawn)
    assert all(s != bytes(lane_handshake.SECRET_BYTES) for s in drawn)
