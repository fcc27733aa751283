"""The call lane's handshake: every TCP connection of the lane (lane_sockets.py) proves, both ways,
that it joins two ranks of this job, before a byte of lane traffic crosses it.

Semantics: rank 0 of the lane draws a secret (``secrets.token_bytes(32)``) and publishes it in the
lane's namespace of the bootstrap store (``lane_secret``); every other rank reads it there. The
store is the trust root, as it is for gloo and torch.distributed: whoever can read it can join the
job (docs/security.md). The secret itself never crosses a lane connection; each side proves it holds
it with an HMAC-SHA256 over both ranks and a fresh nonce of the other side, so a proof seen on the
wire is worth nothing on another connection. The key is the lane's own (a new secret per lane, in
its own store namespace), which binds a proof to this job and this communicator.

Messages, in order, on a connection that rank ``c`` (the connector, the higher rank) opened to rank
``a`` (the acceptor) of a lane of ``size`` ranks; integers are little-endian int64:

    a -> c  greeting  MAGIC (8 bytes) | nonce_a (16)                                   24 bytes
    c -> a  proof     MAGIC (8) | c (8) | nonce_c (16) | HMAC(secret, "connect" | size | c | a
                                                               | nonce_a | nonce_c)    64 bytes
    a -> c  answer    HMAC(secret, "accept" | size | a | c | nonce_c | nonce_a)         32 bytes

(each HMAC message starts with the label ``ddl-lane/1``; the role word keeps one side's proof from
serving as the other's). The acceptor takes the connection as rank ``c``'s only when ``c`` is a rank
that connects to it and the proof is right; the connector takes it as rank ``a``'s only when the
answer is right, so a process squatting on a published address is not mistaken for the peer.

Deadlines: the acceptor gives each connection ``HANDSHAKE_SECONDS`` from its accept (less when the
lane's deadline is nearer) and handles every connection at once (``Greeting`` is a non-blocking
state machine for lane_sockets.py's selector loop), so a silent, slow or garbled stranger is dropped
on its own and never delays a real peer. The connector gives each address it tries the same
``HANDSHAKE_SECONDS``, then tries the next one. Every dropped connection is one line on stderr,
rank-prefixed, naming the remote address and why, the first ten one by one, then one line per ten
seconds at most with a count (``DropLog``).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import sys
import time
from datetime import timedelta

from ...errors import DDLError, did_not_arrive

MAGIC = b"DDLlane1"
HANDSHAKE_SECONDS = 5.0  # a real peer answers in milliseconds: its lane serves connections as they come
SECRET_BYTES = 32
_NONCE_BYTES = 16
_MAC_BYTES = 32
_GREETING_BYTES = len(MAGIC) + _NONCE_BYTES
_PROOF_BYTES = len(MAGIC) + 8 + _NONCE_BYTES + _MAC_BYTES
_SECRET_KEY = "lane-secret"


class Refused(Exception):
    """A connection that did not prove it joins two ranks of this job; ``str``: why. ``claimed``: the
    rank it named, when that is a rank this one expects (a real peer with another secret, maybe)."""

    def __init__(self, why: str, claimed: int | None = None):
        super().__init__(why)
        self.claimed = claimed


def lane_secret(store, rank: int, deadline: float, timeout: float, describe=None) -> bytes:
    """The lane's secret: drawn and published by rank 0, read from ``store`` by the others (collective).
    ``describe``: peer -> how an error names it, with its host (``Placement.describe``)."""
    if rank == 0:
        secret = secrets.token_bytes(SECRET_BYTES)
        store.set(_SECRET_KEY, secret)
        return secret
    try:
        store.wait([_SECRET_KEY], timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except RuntimeError:  # the store's timeout: rank 0 never got as far as its lane
        raise did_not_arrive(rank, 0, "publish the call lane's secret and address", timeout, describe) from None
    secret = store.get(_SECRET_KEY)
    if len(secret) != SECRET_BYTES:
        raise DDLError(f"rank {rank}: the store's {_SECRET_KEY!r} holds {len(secret)} bytes, not the "
                       f"{SECRET_BYTES} of a call lane secret (another program wrote that key)")
    return secret


def _mac(secret: bytes, role: bytes, size: int, prover: int, verifier: int, their_nonce: bytes,
         own_nonce: bytes) -> bytes:
    message = b"ddl-lane/1 " + role + struct.pack("<qqq", size, prover, verifier) + their_nonce + own_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def prove(sock: socket.socket, secret: bytes, rank: int, peer: int, size: int, deadline: float) -> None:
    """The connector's side, on a connected ``sock`` to what should be ``peer``: returns once both
    sides proved themselves; ``Refused`` (why) when the other end is not ``peer`` of this job, or
    ``socket.timeout`` when it did not answer within ``HANDSHAKE_SECONDS`` (or by ``deadline``)."""
    sock.settimeout(max(0.05, min(HANDSHAKE_SECONDS, deadline - time.monotonic())))
    greeting = _read(sock, _GREETING_BYTES, "closed the connection without greeting")
    if greeting[:len(MAGIC)] != MAGIC:
        raise Refused("answered with bytes that are not a call lane greeting (another program's port?)")
    nonce_a, nonce_c = greeting[len(MAGIC):], secrets.token_bytes(_NONCE_BYTES)
    proof = _mac(secret, b"connect", size, rank, peer, nonce_a, nonce_c)
    sock.sendall(MAGIC + struct.pack("<q", rank) + nonce_c + proof)
    answer = _read(sock, _MAC_BYTES, f"closed the connection at this rank's proof: rank {peer} refused it "
                   "(the two ranks hold different lane secrets) or is gone")
    if not hmac.compare_digest(answer, _mac(secret, b"accept", size, peer, rank, nonce_c, nonce_a)):
        raise Refused(f"answered with a wrong proof: not rank {peer} of this job")


def _read(sock: socket.socket, n: int, closed: str) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise Refused(closed)
        got += chunk
    return bytes(got)


class Greeting:
    """The acceptor's side of one accepted connection, non-blocking: greets at once, then ``feed``
    on every readable event until it returns the proven peer's rank or raises ``Refused``."""

    def __init__(self, sock: socket.socket, remote: str, secret: bytes, rank: int, size: int, deadline: float):
        self.sock, self.remote, self.deadline = sock, remote, deadline
        self._secret, self._rank, self._size = secret, rank, size
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._got = bytearray()
        sock.setblocking(False)
        try:
            # A fresh connection's send buffer is empty: 24 bytes go at once, or the connection is bad.
            sent = sock.send(MAGIC + self._nonce)
        except OSError as e:
            raise Refused(f"could not be greeted: {e.strerror or e}") from None
        if sent != _GREETING_BYTES:
            raise Refused("could not be greeted: its send buffer is full")

    def feed(self) -> int | None:
        """Read what has arrived; the peer's rank once its proof is complete and right (then this
        side's answer is sent), None while more is to come, ``Refused`` at anything else."""
        try:
            chunk = self.sock.recv(_PROOF_BYTES - len(self._got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            raise Refused(f"failed before proving it belongs to the job: {e.strerror or e}") from None
        if not chunk:
            raise Refused("closed the connection before proving it belongs to the job")
        self._got += chunk
        head = bytes(self._got[:len(MAGIC)])
        if head != MAGIC[:len(head)]:
            raise Refused(f"sent bytes that are not a call lane handshake: {bytes(self._got[:16])!r}")
        if len(self._got) < _PROOF_BYTES:
            return None
        peer = struct.unpack_from("<q", self._got, len(MAGIC))[0]
        if not self._rank < peer < self._size:
            raise Refused(f"named rank {peer}, which is not a rank that connects to rank {self._rank} "
                          f"(ranks {self._rank + 1}..{self._size - 1} do)")
        nonce_c = bytes(self._got[len(MAGIC) + 8:len(MAGIC) + 8 + _NONCE_BYTES])
        proof = bytes(self._got[-_MAC_BYTES:])
        if not hmac.compare_digest(proof, _mac(self._secret, b"connect", self._size, peer, self._rank,
                                               self._nonce, nonce_c)):
            raise Refused(f"named rank {peer} but its proof is wrong (it holds another secret than this "
                          "job's)", claimed=peer)
        try:
            sent = self.sock.send(_mac(self._secret, b"accept", self._size, self._rank, peer, nonce_c, self._nonce))
        except OSError as e:
            raise Refused(f"could not be answered: {e.strerror or e}") from None
        if sent != _MAC_BYTES:
            raise Refused("could not be answered: its send buffer is full")
        return peer


class DropLog:
    """What the lane says on stderr about the connections it dropped, at a bounded rate: one line each
    (naming the remote address and why: a ``Refused``'s text, or a deadline) for the first ``FIRST``,
    then one line per ``WINDOW`` seconds at most, with how many were dropped meanwhile and the latest;
    ``flush`` says the count not yet said (the lane calls it when it stops accepting). A flood of
    strangers once printed 2,246 lines in 6 s."""

    FIRST = 10
    WINDOW = 10.0

    def __init__(self, rank: int):
        self.rank = rank
        self.printed = 0
        self._held, self._since, self._latest = 0, 0.0, ""

    def drop(self, remote: str, why: str) -> None:
        if self.printed < self.FIRST:
            self.printed += 1
            self._say(f"dropped a connection from {remote}: {why}")
            return
        now = time.monotonic()
        if not self._held:
            self._since = now
        self._held += 1
        self._latest = f"{remote}: {why}"
        if now - self._since >= self.WINDOW:
            self.flush()

    def flush(self) -> None:
        if self._held:
            self._say(f"dropped {self._held} more connection(s) in {time.monotonic() - self._since:.1f} s (the "
                      f"latest from {self._latest})")
            self._held = 0

    def _say(self, what: str) -> None:
        print(f"ddl_triton: rank {self.rank}: call lane: {what}", file=sys.stderr, flush=True)
