"""An in-process world for the runtime's fast tier: N ranks as threads of this process, joined by a
loopback transport, so that the executor, the call check, the issue path and the plan cache run
their real code in milliseconds, without mpiexec and without a torch import per rank.

Semantics:
- ``ThreadWorld(n)`` holds the shared state of ``n`` ranks: published messages, posted call
  fingerprints, and which ranks are dead. ``world.transport(r)`` is rank ``r``'s end of it.
- ``LoopbackTransport`` implements the transport protocol (transports/protocol.py: acquire, publish,
  prefetch, recv, release, flush, close) as the one-sided shm transport does: a send is a buffer
  the receivers read in place; ``recv`` waits for it under the deadline, raising ``PeerTimeout``
  (``dead=True``, naming the dead rank, once any rank was marked dead with ``world.kill``, as shm's
  liveness check does). It also carries the call
  fingerprints the call check posts and reads (``post_fingerprint``, ``peers_posted_same``,
  ``peer_fingerprint``) and each rank's farewell word (``post_farewell``, ``peer_farewell``), and
  runs ``wait_hook`` while it waits, as shm does.
- A buffer handed out by ``acquire`` is poisoned (NaN, or the dtype's lowest integer), so an
  element a schedule never writes cannot pass by luck. ``world.unreleased()`` lists the messages
  some reader never released: after a finished collective it must be empty.
- ``world.run(fn)`` calls ``fn(rank)`` on every rank at once, each on its own thread, and returns
  the results in rank order; it re-raises the lowest rank's exception (``run_all`` returns every
  rank's result or exception instead). It never waits past its ``timeout``.

It lives in tests/support/, not transports/: threads of one process are not a deployment anyone
runs collectives across (a rank is a process), so it is a test double of the shm transport,
keeping the protocol and its failure modes, not a transport to offer users.
"""
from __future__ import annotations

import threading
import time

import torch

from ddl_triton.transports.waits import PeerTimeout

_WAIT_SLICE_S = 0.005  # how often a waiting rank wakes to run its wait hook and look at the clock


class ThreadWorld:
    """The shared state of ``size`` in-process ranks (see the module doc)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        self.size = size
        self._cond = threading.Condition()
        self._messages: dict[tuple[int, int], tuple[torch.Tensor, set[int]]] = {}  # (sender, msg) -> (data, readers left)
        self._fingerprints: list[dict[int, tuple[int, ...]]] = [{} for _ in range(size)]
        self._farewells = [0] * size  # each rank's farewell word, as shm's header holds it (0: still here)
        self._dead: set[int] = set()
        self._transports = [LoopbackTransport(self, r) for r in range(size)]

    def transport(self, rank: int) -> "LoopbackTransport":
        return self._transports[rank]

    def route(self, rank: int) -> list:
        """Rank ``rank``'s route for the executor: its loopback transport to every peer, None to itself."""
        return [None if p == rank else self._transports[rank] for p in range(self.size)]

    def kill(self, rank: int) -> None:
        """Mark ``rank`` dead: every wait on it raises ``PeerTimeout(dead=True)`` from now on."""
        with self._cond:
            self._dead.add(rank)
            self._cond.notify_all()

    def unreleased(self) -> list[tuple[int, int, list[int]]]:
        """(sender, message id, readers that never released it) of every message still held."""
        with self._cond:
            return sorted((s, m, sorted(readers)) for (s, m), (_, readers) in self._messages.items())

    def run_all(self, fn, timeout: float = 30.0) -> list:
        """``fn(rank)`` on every rank at once, one thread each: each rank's result or exception."""
        results: list = [None] * self.size
        done = [False] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller, per rank
                results[rank] = e
            done[rank] = True

        threads = [threading.Thread(target=body, args=(r,), name=f"inprocess-rank{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r in range(self.size) if not done[r]]
        if stuck:  # daemon threads: each ends at the deadline its own waits carry
            raise TimeoutError(f"in-process world: ranks {stuck} still running after {timeout:g} s")
        return results

    def run(self, fn, timeout: float = 30.0) -> list:
        """``run_all``, raising the lowest rank's exception if any rank raised one."""
        results = self.run_all(fn, timeout)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results


def _poisoned(count: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full((count,), float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(count, dtype=dtype)
    return torch.full((count,), torch.iinfo(dtype).min, dtype=dtype)


class LoopbackTransport:
    """Rank ``rank``'s end of a ``ThreadWorld``: one-sided, sends complete at publish."""

    name = "loopback"
    completes_sends = False
    posts_receives_early = False
    has_group_allreduce = False
    spin = 0.0

    def __init__(self, world: ThreadWorld, rank: int):
        self.world = world
        self.rank = rank
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_hook = None  # run while waiting, as shm's is (the call check's mismatch watch); may raise
        self._pending: tuple[int, torch.Tensor, tuple[int, ...]] | None = None

    # -- the transport protocol ---------------------------------------------------------------
    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor:
        bad = [p for p in peers if not 0 <= p < self.world.size or p == self.rank]
        if bad:
            raise ValueError(f"rank {self.rank}: message {msg_id} addressed to {bad}, not peers in a world of "
                             f"{self.world.size}")
        buf = _poisoned(count, dtype)
        self._pending = (msg_id, buf, tuple(peers))
        return buf

    def publish(self, msg_id: int) -> None:
        pending_id, buf, peers = self._pending  # type: ignore[misc]
        assert pending_id == msg_id, f"rank {self.rank}: publish of {msg_id} after acquire of {pending_id}"
        self._pending = None
        with self.world._cond:
            key = (self.rank, msg_id)
            assert key not in self.world._messages, f"rank {self.rank}: message {msg_id} published twice"
            self.world._messages[key] = (buf, set(peers))
            self.world._cond.notify_all()
        self.bytes_sent += buf.numel() * buf.element_size() * len(peers)

    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None:
        """Nothing to post: the data is read in place from the sender's buffer."""

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor:
        buf = self._wait(lambda: self.world._messages.get((peer, msg_id)), timeout, peer, f"message {msg_id}")[0]
        if buf.dtype != dtype or offset + count > buf.numel():
            raise ValueError(f"rank {self.rank}: message {msg_id} from rank {peer} is {buf.numel()} x {buf.dtype}, "
                             f"read as [{offset}, {offset + count}) x {dtype}")
        self.bytes_received += count * dtype.itemsize
        return buf[offset:offset + count]

    def release(self, peer: int, msg_id: int) -> None:
        with self.world._cond:
            entry = self.world._messages.get((peer, msg_id))
            if entry is None or self.rank not in entry[1]:
                raise AssertionError(f"rank {self.rank}: released message {msg_id} of rank {peer}, "
                                     "which it does not hold")
            entry[1].discard(self.rank)
            if not entry[1]:
                del self.world._messages[(peer, msg_id)]

    def flush(self, timeout: float) -> None:
        """Sends complete at publish."""

    def close(self) -> None:
        """Nothing of its own to free: the world holds the messages."""

    # -- call fingerprints (the call check's, as shm carries them) ----------------------------
    def post_fingerprint(self, seq: int, values: tuple[int, ...]) -> None:
        with self.world._cond:
            self.world._fingerprints[self.rank][seq] = tuple(values)
            self.world._cond.notify_all()

    def peers_posted_same(self, peers: list[int], seq: int, values: tuple[int, ...]) -> bool:
        with self.world._cond:
            return all(self.world._fingerprints[p].get(seq) == tuple(values) for p in peers)

    def peer_fingerprint(self, peer: int, seq: int, timeout: float | None):
        """What ``peer`` posted for call ``seq``; with ``timeout=None``, False when nothing yet."""
        if timeout is None:
            with self.world._cond:
                return self.world._fingerprints[peer].get(seq, False)
        return self._wait(lambda: self.world._fingerprints[peer].get(seq), timeout, peer, f"its call #{seq}")

    # -- farewells (a rank that left the communicator, as shm's header word carries it) -------
    def post_farewell(self, word: int) -> None:
        with self.world._cond:
            self.world._farewells[self.rank] = word
            self.world._cond.notify_all()

    def peer_farewell(self, peer: int) -> int:
        with self.world._cond:
            return self.world._farewells[peer]

    def exited_peers(self) -> list[int]:
        """As shm's: the ranks marked dead (``ThreadWorld.kill``)."""
        with self.world._cond:
            return sorted(self.world._dead - {self.rank})

    # -- waiting ----------------------------------------------------------------------------
    def _wait(self, get, timeout: float, peer: int, what: str):
        """``get()`` once it is not None; PeerTimeout when ``peer`` is dead or past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self.world._cond:
                value = get()
                if value is not None:
                    return value
                if self.world._dead:
                    # As shm's liveness check: any dead rank dooms the collective, even one this
                    # wait does not name (survivors waiting on each other would wait out the deadline).
                    dead = peer if peer in self.world._dead else min(self.world._dead)
                    raise PeerTimeout(dead, f"{what}: rank {dead}'s thread was marked dead", dead=True)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(peer, what)
                self.world._cond.wait(min(left, _WAIT_SLICE_S))
            if self.wait_hook is not None:
                self.wait_hook()  # outside the lock: it reads fingerprints through this transport
