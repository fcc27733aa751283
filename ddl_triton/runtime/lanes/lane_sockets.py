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

Connecting (collective over the store's ranks, at ``connect``): rank 0 draws the lane's secret and
publishes it in the store (lane_handshake.py). Every rank listens on an ephemeral port of each
address it publishes, and only there (transports/job_network.py: those of ``GLOO_SOCKET_IFNAME``'s interfaces
when set, as gloo's, else every non-loopback IPv4 address, else 127.0.0.1), never on 0.0.0.0: one
listener per published address, because a store does not say which of a host's interfaces its
peers reach it by (a HashStore, a FileStore have no host), and a connector tries the addresses in
turn. It publishes them in the store, accepts the higher ranks' connections on a thread of its own
from then on, and connects to each lower rank. Each connection is proven both ways with the
secret before it counts (lane_handshake.py: a handshake of its own deadline per connection);
one that does not prove itself is dropped and logged, and the rank waits on for the real peer.
The handshake is all the connection costs: a call's messages cross it as before.

Failures: a peer whose process dies closes its end; the read returns nothing and raises
``PeerTimeout(dead=True)`` at once. A peer silent past the deadline raises ``PeerTimeout`` (the
call checker names the call). At ``connect``, a peer that neither publishes its addresses nor
connects within the deadline is a ``CollectiveTimeout`` naming both ranks (and any connection
that named the missing rank but failed its proof); addresses none of which answers and proves
itself, a ``DDLError`` listing them, each with why.
"""
from __future__ import annotations

import selectors
import socket
import threading
import time
from datetime import timedelta

from ...errors import DDLError, did_not_arrive, did_not_finish
from ...transports import failure_notice
from ...transports.waits import PeerTimeout
from . import lane_handshake
from ...transports.job_network import host_addresses
from .lane_handshake import DropLog, Greeting, Refused

_SOCKET_BUFFER = 1 << 20  # two messages of the lane's largest fit in flight: a send never waits for a read
_CONNECT_SECONDS = 5.0    # per address tried
_MAX_HANDSHAKES = 64      # connections proving themselves at once; a flood drops its oldest, not the fds


def _listen(rank: int, size: int) -> tuple[list[socket.socket], list[str]]:
    """A listener on an ephemeral port of each published address, and the "address:port" entries."""
    listeners, entries, failed = [], [], []
    for address in host_addresses():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _size_buffers(listener)  # accepted connections inherit them
        try:
            listener.bind((address, 0))
            listener.listen(socket.SOMAXCONN)  # a flood waits in the kernel, not at the SYN
        except OSError as e:
            listener.close()
            failed.append(f"{address} ({e.strerror or e})")
            continue
        listeners.append(listener)
        entries.append(f"{address}:{listener.getsockname()[1]}")
    if not listeners:
        raise DDLError(f"rank {rank}: the call lane cannot listen on any of this host's addresses: "
                       + "; ".join(failed))
    return listeners, entries


class LaneSockets:
    """A connected TCP stream to every other rank (module doc). ``socks[p]``: the one to rank p."""

    def __init__(self, store, rank: int, size: int, timeout: float, describe=None):
        """``describe``: peer -> how an error names it, with its host (``Placement.describe``)."""
        self.rank, self.size, self.timeout, self.describe = rank, size, timeout, describe
        self.socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        self._secret = lane_handshake.lane_secret(store, rank, deadline, timeout, describe)
        listeners, entries = _listen(rank, size)
        acceptor = _Acceptor(listeners, self._secret, rank, size, deadline, timeout, describe)
        try:
            store.set(f"lane-{rank}", ",".join(entries))
            for peer in range(rank):
                self.socks[peer] = self._connect(store, peer, deadline)
            self.socks.update(acceptor.result())
        except BaseException:
            acceptor.stop()
            self.close()
            raise
        for sock in self.socks.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header goes out alone, now
            sock.settimeout(timeout)  # every send and read: the lane's deadline

    def _connect(self, store, peer: int, deadline: float) -> socket.socket:
        key = f"lane-{peer}"
        try:
            store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except RuntimeError:  # the store's timeout: the peer never got as far as its lane
            raise did_not_arrive(self.rank, peer, "publish its call lane address", self.timeout, self.describe) from None
        tried = []
        for entry in store.get(key).decode(errors="replace").split(","):
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise DDLError(f"rank {self.rank}: the store's {key!r} holds {entry!r}, not an address:port "
                               f"of rank {peer}'s call lane")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _size_buffers(sock)  # before connecting: the receive window is agreed then
            sock.settimeout(min(_CONNECT_SECONDS, max(0.1, deadline - time.monotonic())))
            try:
                sock.connect((host, int(port)))
            except OSError as e:
                sock.close()
                tried.append(f"{entry} ({e.strerror or e})")
                continue
            try:
                lane_handshake.prove(sock, self._secret, self.rank, peer, self.size, deadline)
                return sock
            except Refused as e:
                why = str(e)
            except socket.timeout:
                why = "connected, but no handshake within the handshake's deadline (another program's port?)"
            except OSError as e:
                why = f"the handshake failed: {e.strerror or e}"
            sock.close()
            tried.append(f"{entry} ({why})")
        raise DDLError(f"rank {self.rank}: the call lane cannot reach rank {peer} at any of its addresses: "
                       + "; ".join(tried) + " (set GLOO_SOCKET_IFNAME to the interface between the hosts)")

    def closed_peers(self) -> list[int]:
        """The peers whose connection the other end has closed (its process ended), seen without
        reading: a peek that finds the end of the stream. Cheap; for an elastic job's agreement."""
        closed = []
        for peer, sock in self.socks.items():
            timeout = sock.gettimeout()
            sock.settimeout(0.0)  # with a timeout set, Python would first wait up to it for something to read
            try:
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    closed.append(peer)
            except (BlockingIOError, InterruptedError):
                pass  # open, nothing to read
            except OSError:
                closed.append(peer)  # reset by the peer's kernel
            finally:
                sock.settimeout(timeout)
        return closed

    def close(self) -> None:
        for sock in self.socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self.socks.clear()


class _Acceptor:
    """The higher ranks' connections, accepted and proven on a thread of its own from construction
    until ``result`` or ``stop``, so a peer's handshake is answered at once whatever this rank's
    own connects wait for. One selector loop serves the listeners and every handshake under way,
    each with its own deadline; the wait is recomputed from the nearest deadline every turn."""

    def __init__(self, listeners, secret: bytes, rank: int, size: int, deadline: float, timeout: float,
                 describe=None):
        self._listeners, self._secret, self._describe = listeners, secret, describe
        self._rank, self._size, self._deadline, self._timeout = rank, size, deadline, timeout
        self._accepted: dict[int, socket.socket] = {}
        self._error: BaseException | None = None
        self._drops = DropLog(rank)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name=f"ddl-lane-accept-{rank}", daemon=True)
        self._thread.start()

    def result(self) -> dict[int, socket.socket]:
        """The proven connection of every higher rank, once all are in; ``CollectiveTimeout`` at the deadline."""
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)  # the loop ends by the deadline
        if self._thread.is_alive():
            raise did_not_finish(self._rank, "the call lane's accepting thread", self._timeout)
        if self._error is not None:
            raise self._error
        return self._accepted

    def stop(self) -> None:
        """End the loop (this rank failed) and close what it accepted."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        for sock in self._accepted.values():
            sock.close()

    def _run(self) -> None:
        pending: dict[socket.socket, Greeting] = {}
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            for listener in self._listeners:
                listener.setblocking(False)
                sel.register(listener, selectors.EVENT_READ, "listen")
            self._loop(sel, pending)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e
        finally:
            for sock, greeting in pending.items():
                self._drops.drop(greeting.remote, "had not proven itself when the lane stopped accepting")
                sock.close()
            self._drops.flush()
            sel.close()
            for s in (*self._listeners, self._wake_r, self._wake_w):
                s.close()

    def _loop(self, sel, pending: dict) -> None:
        rank, size = self._rank, self._size
        refused: dict[int, str] = {}  # a rank still expected -> why a connection naming it was dropped
        while len(self._accepted) < size - 1 - rank:
            now = time.monotonic()
            for sock in [s for s, g in pending.items() if g.deadline <= now]:
                self._drop(sel, pending, sock, f"no handshake within {lane_handshake.HANDSHAKE_SECONDS:g} s")
            if now >= self._deadline:
                missing = [p for p in range(rank + 1, size) if p not in self._accepted][0]
                raise did_not_arrive(rank, missing, "connect to the call lane", self._timeout, self._describe,
                                     f"; a connection {refused[missing]}" if missing in refused else "")
            wake = min([self._deadline, *(g.deadline for g in pending.values())])
            for key, _ in sel.select(max(0.0, wake - now)):
                if key.data == "wake":
                    return
                if key.data == "listen":
                    self._accept(sel, pending, key.fileobj)
                    continue
                greeting = key.data
                if greeting.sock not in pending:
                    continue  # dropped earlier in this turn (the oldest of a flood): its event is stale
                try:
                    peer = greeting.feed()
                except Refused as e:
                    if e.claimed is not None:
                        refused[e.claimed] = f"from {greeting.remote} {e}"
                    self._drop(sel, pending, greeting.sock, str(e))
                    continue
                if peer is None:
                    continue
                if peer in self._accepted:
                    self._drop(sel, pending, greeting.sock, f"proved itself as rank {peer}, which is connected")
                    continue
                sel.unregister(greeting.sock)
                del pending[greeting.sock]
                self._accepted[peer] = greeting.sock

    def _accept(self, sel, pending: dict, listener: socket.socket) -> None:
        try:
            sock, (host, port) = listener.accept()
        except OSError:  # gone before we took it (or nothing there after all): nothing to do
            return
        remote = f"{host}:{port}"
        deadline = min(self._deadline, time.monotonic() + lane_handshake.HANDSHAKE_SECONDS)
        try:
            greeting = Greeting(sock, remote, self._secret, self._rank, self._size, deadline)
        except Refused as e:
            self._drops.drop(remote, str(e))
            sock.close()
            return
        if len(pending) >= _MAX_HANDSHAKES:  # dicts keep insertion order: the first is the oldest
            self._drop(sel, pending, next(iter(pending)), f"{_MAX_HANDSHAKES} connections were handshaking at "
                       "once: the oldest gives way")
        pending[sock] = greeting
        sel.register(sock, selectors.EVENT_READ, greeting)

    def _drop(self, sel, pending: dict, sock: socket.socket, why: str) -> None:
        greeting = pending.pop(sock)
        sel.unregister(sock)
        sock.close()
        self._drops.drop(greeting.remote, why)


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
            failure_notice.note_gone(peer)  # its process ended (or, elastic, it gave the world up: membership.py)
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

    drops_unread = True  # a stream's unread bytes go with it: a last message can never be misread later

    def arrived(self, peer: int) -> bool:
        """Not known without reading the stream: the lane reads each peer's messages in order."""
        return False

    def send_farewell(self, peers, head: bytes) -> None:
        """Write ``head`` (a farewell, call_lane.py) to each of ``peers``; one that closed its end is skipped."""
        for p in peers:
            try:
                self.sockets.socks[p].sendall(head)
            except OSError:  # (socket.timeout included) it is gone, or its buffer is full of unread calls
                pass

    def close(self, expect=None) -> None:
        """Close every connection (``expect``, the messages peers may still send, concerns MPI only)."""
        self.sockets.close()
