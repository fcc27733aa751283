"""The call lane's own TCP connections, for ranks that a store bootstrapped (torchrun, env://).

Semantics: one TCP stream between every pair of ranks, carrying the call lane's messages
(call_lane.py: a 16-byte header, then the data bytes the header counts) in order, and nothing
else. ``SocketWire`` is the lane's wire over them: a send is written whole into the kernel's
buffer, a receive reads exactly one message, its data included, from the peer's stream. Reads
block in the kernel with the time left to the deadline (the GIL released), so a peer's message is
answered as soon as it lands, with no thread of ours or gloo's in between.

Why not gloo's point-to-point (the lane's wire before): every gloo message is a notification
that the receive is posted, then the data, each handled by gloo's I/O thread. Between two testbed
hosts one 16-byte exchange took 170 us and 0.45 ms of that thread's CPU; on a socket of its own,
28 us and 15 us (build measurement, 2026-12-02). The lane runs once per collective, so under
torchrun a DDP bucket paid that before gloo's own allreduce could start.

Connecting (collective over the store's ranks, at ``connect``): every rank listens on an
ephemeral port of every address it has (``_addresses``: those of ``GLOO_SOCKET_IFNAME``'s
interfaces when set, as gloo's, else every non-loopback IPv4 address, else 127.0.0.1), publishes
them in the store, and connects to each lower rank, trying its addresses in turn, then accepts
one connection from each higher rank. The first 8 bytes a connector sends name its rank.

Failures: a peer whose process dies closes its end; the read returns nothing and raises
``PeerTimeout(dead=True)`` at once. A peer silent past the deadline raises ``PeerTimeout`` (the
call checker names the call). At ``connect``, a peer that neither publishes its addresses nor
connects within the deadline is a ``CollectiveTimeout`` naming both ranks; addresses none of
which answers, a ``DDLError`` listing them.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from datetime import timedelta

from ..errors import CollectiveTimeout, DDLError
from ..transports.base import PeerTimeout

_SIOCGIFADDR = 0x8915
_SOCKET_BUFFER = 1 << 20  # two messages of the lane's largest fit in flight: a send never waits for a read
_CONNECT_SECONDS = 5.0    # per address tried


def _interface_address(name: str) -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None  # no IPv4 address (or no such interface)
    finally:
        probe.close()


def _addresses() -> list[str]:
    """This host's IPv4 addresses to publish, in the order peers should try them."""
    named = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    names = named or [n for _, n in socket.if_nameindex()]
    found = [a for a in (_interface_address(n) for n in names) if a and (named or not a.startswith("127."))]
    return list(dict.fromkeys(found)) or ["127.0.0.1"]


class LaneSockets:
    """A connected TCP stream to every other rank (module doc). ``socks[p]``: the one to rank p."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.socks: dict[int, socket.socket] = {}
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _size_buffers(listener)  # accepted connections inherit them
        try:
            listener.bind(("0.0.0.0", 0))
            listener.listen(max(1, size))
            port = listener.getsockname()[1]
            store.set(f"lane-{rank}", ",".join(f"{a}:{port}" for a in _addresses()))
            deadline = time.monotonic() + timeout
            for peer in range(rank):
                self.socks[peer] = self._connect(store, peer, deadline)
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            while len(self.socks) < size - 1:
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    missing = [p for p in range(rank + 1, size) if p not in self.socks]
                    raise CollectiveTimeout(f"rank {rank}: rank {missing[0]} did not connect to the call lane "
                                            f"within {timeout:g} s") from None
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    peer = struct.unpack("<q", _read_exactly(sock, 8, -1))[0]
                except (OSError, PeerTimeout):
                    peer = -1  # closed or silent before naming its rank
                if not rank < peer < size or peer in self.socks:
                    sock.close()
                    continue  # not one of ours: ignore it
                self.socks[peer] = sock
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for sock in self.socks.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header goes out alone, now
            sock.settimeout(timeout)  # every send and read: the lane's deadline

    def _connect(self, store, peer: int, deadline: float) -> socket.socket:
        try:
            store.wait([f"lane-{peer}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except RuntimeError:  # the store's timeout: the peer never got as far as its lane
            raise CollectiveTimeout(f"rank {self.rank}: rank {peer} did not publish its call lane address "
                                    f"within {self.timeout:g} s") from None
        tried = []
        for entry in store.get(f"lane-{peer}").decode().split(","):
            host, port = entry.rsplit(":", 1)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _size_buffers(sock)  # before connecting: the receive window is agreed then
            sock.settimeout(min(_CONNECT_SECONDS, max(0.1, deadline - time.monotonic())))
            try:
                sock.connect((host, int(port)))
            except OSError as e:
                sock.close()
                tried.append(f"{entry} ({e.strerror or e})")
                continue
            sock.sendall(struct.pack("<q", self.rank))
            return sock
        raise DDLError(f"rank {self.rank}: the call lane cannot reach rank {peer} at any of its addresses: "
                              + "; ".join(tried) + " (set GLOO_SOCKET_IFNAME to the interface between the hosts)")

    def close(self) -> None:
        for sock in self.socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self.socks.clear()


def _size_buffers(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


def _read_exactly(sock: socket.socket, n: int, peer: int, into: memoryview | None = None) -> bytes | None:
    """``n`` bytes from ``sock`` (into ``into`` when given); PeerTimeout(dead) when the peer closed."""
    view = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n], n - got)
        if k == 0:
            raise PeerTimeout(peer, "the call lane (its connection closed)", dead=True)
        got += k
    return None if into is not None else bytes(view)


class SocketWire:
    """The call lane's wire over ``LaneSockets`` (call_lane.py's wire interface; module doc)."""

    def __init__(self, sockets: LaneSockets, recv_bufs: dict, send_bufs: tuple, header_bytes: int,
                 data_bytes_of):
        self.sockets = sockets
        self._recv_views = {p: memoryview(buf) for p, buf in recv_bufs.items()}
        self._send_views = tuple(memoryview(buf) for buf in send_bufs)
        self._header = header_bytes
        self._data_bytes_of = data_bytes_of  # header bytes -> the data bytes that follow them

    def start_recv(self, peer: int) -> None:
        """Nothing to post: the stream holds the peer's next message until it is read."""

    def wait_recv(self, peer: int, timeout: float, seq: int, spin: float) -> None:
        sock, view = self.sockets.socks[peer], self._recv_views[peer]
        if timeout != self.sockets.timeout:
            sock.settimeout(timeout)  # set at connect to the lane's; a caller's other deadline, for this read
        try:
            _read_exactly(sock, self._header, peer, view)
            data = self._data_bytes_of(view[:self._header])
            if data > len(view) - self._header:
                raise ValueError(f"call lane: rank {peer} sent {data} data bytes, more than the lane carries")
            if data:
                _read_exactly(sock, data, peer, view[self._header:])
        except socket.timeout:
            raise PeerTimeout(peer, f"the call lane message of call #{seq}") from None
        except OSError as e:
            raise PeerTimeout(peer, f"the call lane message of call #{seq}: {e.strerror or e}", dead=True) from None
        finally:
            if timeout != self.sockets.timeout:
                sock.settimeout(self.sockets.timeout)

    def start_sends(self, parity: int, nbytes: int, peers: tuple[int, ...]):
        mem = self._send_views[parity][:nbytes]
        for p in peers:
            sock = self.sockets.socks[p]
            try:
                sock.sendall(mem)  # into the kernel's buffer: the send buffer is free again at once
            except socket.timeout:
                raise PeerTimeout(p, "call lane send") from None
            except OSError as e:
                raise PeerTimeout(p, f"call lane send: {e.strerror or e}", dead=True) from None
        return None

    def complete_sends(self, works, timeout: float, peers: tuple[int, ...]) -> None:
        """Nothing to complete: ``start_sends`` returned once the kernel had every byte."""

    def close(self) -> None:
        self.sockets.close()
