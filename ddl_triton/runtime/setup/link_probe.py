"""Measure the link between hosts once at init, for a planner that has no fitted cost model.

Semantics: ``measure`` is collective (every rank, same point): over an MPI bootstrap at init,
before the transports open (table_agreement.py), over its own communicator; over a store
bootstrap (torchrun, env://), which has no data path until then, right after the transports
are wired (the communicator), over the gloo transport's process group, and the planner takes
the figures then (``Planner.use_link``), before any call is planned. It does not run where
``wanted`` says no: one host, ``Options.link_probe`` off (``DDL_LINK_PROBE=0``), a tuning table
with a fitted model (it knows the link better), or ranks of one host that talk over MPI or gloo
(``DDL_TRANSPORT``: the model's one "mpi" link would price them as the slow link). Otherwise it
returns the :class:`~ddl_triton.planning.measured_link.MeasuredLink` every rank agrees on:

1. the first rank of each host pairs with the next host's (hosts 0-1, 2-3, ...; an odd last host
   with host 0, after) and, over the bootstrap's own MPI communicator (or gloo's), times 8-byte round trips
   (the latency: half the fastest) and 1 and 2 MiB sent both ways at once (the rate: the
   difference, so that tbf's burst and the fixed cost cancel; medians, interleaved), or 8 and
   16 MiB where 2 MiB took under 8 ms (a fast link's burst would hold both);
2. then every rank at once computes for ``_SPIN`` seconds and reads the share of a core it got
   (several ranks per core, 4 testbed ranks on 2 cores: 0.5);
3. the ranks exchange their figures and every rank takes the slowest link, and the share of a
   core the ranks got together, divided among them (``measured_link.agree``).

Bounded: each exchange waits at most ``Options.timeout`` (a lost peer: BootstrapTimeout naming it),
and no pair of transfers starts past ``_BUDGET`` seconds (a slow link times one). On the testbed
(1 Gbit/s) it took 99-109 ms.
"""
from __future__ import annotations

import statistics
import time

from ...options import Options
from ...planning.measured_link import MeasuredLink, agree, rate
from .bootstrap_values import BootstrapError, BootstrapTimeout
from .placement import Placement

_PING_BYTES, _SMALL, _BIG = 8, 1 << 20, 2 << 20
# A shaper lets a burst through at line rate (tbf: about 2 ms of traffic, 2.5 MB at 10 Gbit/s); the
# difference of two transfers cancels it only when both outlast it. Where the larger one took less
# than _FAST_S, both sizes are scaled by _SCALE (8 and 16 MiB: 13 ms at 10 Gbit/s).
_FAST_S, _SCALE = 0.008, 8
_PINGS, _REPEATS = 8, 3
_BUDGET = 0.15   # seconds of 1 + 2 MiB pairs per host pair, past which no more are timed
_SPIN = 0.02     # seconds every rank computes at once to read its share of a core
_TAG = 0x4C50    # on the bootstrap's communicator, before any transport uses it


def wanted(placement: Placement, options: Options, table) -> str:
    """Why the probe does not run ("" when it does): the same on every rank (module doc)."""
    if not placement.spans_hosts:
        return "one host"
    if not options.link_probe:
        return "DDL_LINK_PROBE=0"
    if table is not None and table.model is not None:
        return "the tuning table's fitted model"
    host = placement.host_of_rank
    if any(host[a] == host[b] and placement.link(a, b) == "mpi" for a in range(placement.size)
           for b in range(a + 1, placement.size)):
        return "ranks of one host talk over MPI" if placement.bootstrap_kind == "mpi" else \
            "ranks of one host talk over gloo"
    return ""


def before_wiring(placement: Placement) -> bool:
    """Whether the probe runs at init before the transports open (an MPI bootstrap: over its
    communicator) or right after them (a store bootstrap: over the gloo transport)."""
    return placement.bootstrap_kind == "mpi"


def measure(bootstrap, placement: Placement, options: Options, gloo=None) -> MeasuredLink:
    """Measure the link between hosts (module doc); call only where ``wanted`` is "". ``gloo``: the
    gloo transport a store bootstrap's communicator just opened (None over MPI)."""
    started = time.perf_counter()
    rank = placement.rank
    mine: list = [None, None]
    for lower, upper in _pairs(sorted(set(placement.host_of_rank))):
        if rank in (lower, upper):
            peer = upper if rank == lower else lower
            wire = _MpiPair(bootstrap.comm, peer) if gloo is None else _GlooPair(gloo, peer)
            alpha, bw = _exchange(wire, rank, peer, rank == lower, options.timeout, placement.describe)
            if rank == lower:
                mine = [alpha, bw]  # one report per link
        bootstrap.barrier()  # the next pair's host 0 is this pair's: one exchange at a time per host
    share = _cpu_share(_SPIN)
    every = bootstrap.allgather(mine + [share, int(mine[0] is not None), time.perf_counter() - started])
    try:
        return agree(every)
    except (ValueError, TypeError, IndexError) as e:
        raise BootstrapError(f"rank {rank}: the link probe's figures do not agree: {e}") from None


def _pairs(leaders: list[int]) -> list[tuple[int, int]]:
    """Host leaders paired: (0, 1), (2, 3), ..., then an odd last one with the first."""
    out = [(leaders[i], leaders[i + 1]) for i in range(0, len(leaders) - 1, 2)]
    if len(leaders) % 2:
        out.append((leaders[0], leaders[-1]))
    return out


class _MpiPair:
    """Point-to-point with ``peer`` over an MPI communicator: nonblocking sends and receives of
    numpy views, completed together."""

    def __init__(self, comm, peer: int):
        self.comm, self.peer = comm, peer

    def send(self, buf, tag: int):
        return self.comm.Isend(buf.numpy(), self.peer, tag)

    def recv(self, buf, tag: int):
        return self.comm.Irecv(buf.numpy(), self.peer, tag)

    def wait(self, requests, timeout: float, what: str) -> None:
        from mpi4py import MPI

        from ...transports.waits import wait_until
        wait_until(lambda: MPI.Request.Testall(requests), timeout, self.peer, what, prompt=True)


class _GlooPair:
    """Point-to-point with ``peer`` over the gloo transport's process group, on tags past the
    transport's own (``transports/gloo.py`` numbers its messages below ``_TAG_RANGE``; nothing else
    is in flight at this point of init)."""

    def __init__(self, gloo, peer: int):
        from ...transports.gloo import _TAG_RANGE
        self.gloo, self.peer, self.tags = gloo, peer, _TAG_RANGE

    def send(self, buf, tag: int):
        return self.gloo.pg.send([buf], self.peer, self.tags + tag)

    def recv(self, buf, tag: int):
        return self.gloo.pg.recv([buf], self.peer, self.tags + tag)

    def wait(self, requests, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        for work in requests:
            self.gloo.wait_work(work, max(deadline - time.monotonic(), 1e-3), self.peer, what)


def _exchange(wire, rank: int, peer: int, first: bool, timeout: float, describe) -> tuple[float, float]:
    """(one-way seconds, bytes per second each way) between this rank and ``peer`` over ``wire``
    (``_MpiPair`` or ``_GlooPair``; module doc)."""
    import torch

    from ...transports.waits import PeerTimeout

    out, back = torch.zeros(_BIG, dtype=torch.uint8), torch.empty(_BIG, dtype=torch.uint8)

    def done(requests, what):
        try:
            wire.wait(requests, timeout, what)
        except PeerTimeout:
            raise BootstrapTimeout(f"rank {rank}: measuring the link between hosts ({what}) with "
                                   f"{describe(peer)} did not complete within {timeout:g} s") from None

    def ping() -> float:
        t0 = time.perf_counter()
        if first:
            done([wire.send(out[:_PING_BYTES], _TAG)], "8-byte round trip")
            done([wire.recv(back[:_PING_BYTES], _TAG)], "8-byte round trip")
        else:
            done([wire.recv(back[:_PING_BYTES], _TAG)], "8-byte round trip")
            done([wire.send(out[:_PING_BYTES], _TAG)], "8-byte round trip")
        return time.perf_counter() - t0

    def both_ways(nbytes: int) -> float:
        t0 = time.perf_counter()
        done([wire.recv(back[:nbytes], _TAG + 1), wire.send(out[:nbytes], _TAG + 1)], f"{nbytes} B both ways")
        return time.perf_counter() - t0

    def lower_says(flag: bool, what: str) -> bool:
        """The lower rank's ``flag``, on both sides (the two must run the same transfers)."""
        said = torch.tensor([flag], dtype=torch.uint8)
        done([wire.send(said, _TAG + 2)] if first else [wire.recv(said, _TAG + 2)], what)
        return bool(said[0])

    ping()  # connects and warms the path
    trips = [ping() for _ in range(_PINGS)]
    sizes = (_SMALL, _BIG)
    if lower_says(both_ways(_BIG) < _FAST_S, "the probe's transfer size"):
        sizes = (_SMALL * _SCALE, _BIG * _SCALE)  # a fast link: transfers that outlast the shaper's burst
        # Buffers that large only here: a slow link's probe (the testbed's) needs none of them.
        out, back = torch.zeros(sizes[1], dtype=torch.uint8), torch.empty(sizes[1], dtype=torch.uint8)
    small, big = [], []
    begun = time.perf_counter()
    for repeat in range(_REPEATS):
        small.append(both_ways(sizes[0]))
        big.append(both_ways(sizes[1]))
        if repeat == _REPEATS - 1:
            break
        # Both sides stop together (a slow link after one pair): the lower rank decides and says so.
        if lower_says(time.perf_counter() - begun > _BUDGET, "the probe's end"):
            break
    # The fastest round trip is the link's: a slower one waited for a core (ranks busy in init beside
    # it), which the model charges as step cost, not as latency.
    alpha = min(trips) / 2
    try:
        return alpha, rate(sizes[0], statistics.median(small), sizes[1], statistics.median(big))
    except ValueError:
        # A link faster than the timer can tell apart: price it as the larger transfer's mean rate.
        return alpha, sizes[1] / max(statistics.median(big), 1e-9)


def _cpu_share(seconds: float) -> float:
    """The share of a core this thread got while computing for ``seconds`` of wall time."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - wall0 < seconds:
        for i in range(200):
            x += i
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return max(0.01, min(1.0, cpu / wall))
