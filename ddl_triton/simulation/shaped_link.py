"""A host link shaped by a token bucket (Linux ``tbf``), as the testbed's links are, and a
schedule's time across such links.

Semantics: each host has one link, and each direction of it (what the host sends, what it is
sent) passes a token bucket of ``rate`` payload bytes per second that holds at most ``burst``
bytes. Bytes go through at once while the bucket has tokens, then at ``rate``; the bucket refills
at ``rate`` whenever it is not full. Messages take each bucket in the order they reach it.

What the alpha-beta walk alone (ddl_triton/planning/costmodel.py) gets wrong on such links:

- It costs each message on its own link. Two ranks of one host sending to the other host at
  once share one shaped link, and their bytes queue (``host_link_bytes``: the busiest
  direction's bytes). On the testbed a 2 x 2 ring puts 1.5 S on each host's link, one_shot 4 S.
- Its per-byte time is one number per link class. Through the bucket a message is free while
  tokens last and then costs 1 / rate per byte, so the same message is fast after an idle spell
  and slow in a stream (a benchmark's calls back to back cannot beat the rate on average).
- A schedule that alternates phases on shm and on the link (hierarchical: reduce-scatter within
  the host, the exchange between hosts, all-gather within) pays the link's time between the
  other phases, not beside them: no bound of the form max(walk, bytes / rate) sees that.

``schedule_seconds`` walks the schedule with clocks as the cost model does, every message between
hosts passing its sender's uplink bucket and its receiver's downlink bucket (in the order of the
times it is handed over, found by walking again until they settle), and the receiving step done
no sooner than its last byte is through. It starts the buckets at the level that a steady stream
of calls leaves them (or, given ``calls``, the average over that many calls after an idle spell,
the first of which finds them full). Over a training step, transfers are apart: ``TokenBucket``
follows a bucket's level from one transfer to the next, so a gradient bucket issued after a
spell of computing gets the burst.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..planning.costmodel import CostModel, received_bytes, tensor_bytes
from ..schedules import Schedule
from ..schedules.dry_run import walk

# Walks until the hand-over order settles: 2-4 for a few chunks; a pass moves the order about one
# chunk further, so many chunks need more (a 2 x 2 hierarchical of 32 chunks settled after 30).
# The bound: this many plus one per message between hosts, reached only by an order that never settles.
_SETTLE_PASSES = 12


@dataclass(frozen=True)
class ShapedLink:
    """The token bucket of one direction of a host link: ``rate`` payload bytes per second,
    ``burst`` payload bytes (tbf counts frames; both are given here in what TCP delivers)."""

    rate: float
    burst: float

    def floor_seconds(self, link_bytes: float, calls: int | None = None) -> float:
        """The least seconds per call that ``link_bytes`` on one bucket allow, over ``calls`` calls
        back to back after an idle spell (the burst shared among them; None: the steady state)."""
        return max(0.0, link_bytes - (self.burst / calls if calls else 0.0)) / self.rate


class TokenBucket:
    """A ShapedLink's bucket over time: ``transfer(start, nbytes)`` returns when ``nbytes`` handed
    to the link at ``start`` have passed it (at once while tokens last, then at the rate), and
    takes the tokens. Transfers are in order (FIFO): one starts when the previous has passed."""

    def __init__(self, link: ShapedLink, at: float = 0.0, tokens: float | None = None):
        self.link = link
        self.tokens = link.burst if tokens is None else tokens  # default full: the link was idle before
        self.at = at                 # when ``tokens`` was last brought up to date
        self.free = at               # when the link has passed everything handed to it so far

    def transfer(self, start: float, nbytes: float) -> float:
        start = max(start, self.free)
        self.tokens = min(self.link.burst, self.tokens + (start - self.at) * self.link.rate)
        self.at = start
        short = nbytes - self.tokens
        if short <= 0:
            self.tokens -= nbytes
            self.free = start
            return start
        self.tokens = 0.0
        self.at = self.free = start + short / self.link.rate
        return self.free


def host_link_bytes(schedule: Schedule, host_of: Callable[[int], int], elem: int, scale: float = 1.0) -> float:
    """The most bytes that one direction of one host's link carries in ``schedule``: for every host,
    the bytes its ranks send to other hosts' ranks (its uplink) and the bytes sent to it (the switch
    port toward it), the larger of all. A message goes whole over a network link, once per peer it
    is sent to. ``scale``: ``schedule`` stands for a call that many times longer."""
    up: dict[int, int] = {}
    down: dict[int, int] = {}
    for r, step in walk(schedule):
        for peer in step.send:
            if host_of(peer) != host_of(r):
                nbytes = step.count * elem
                up[host_of(r)] = up.get(host_of(r), 0) + nbytes
                down[host_of(peer)] = down.get(host_of(peer), 0) + nbytes
    return max([0, *up.values(), *down.values()]) * scale


def schedule_seconds(model: CostModel, schedule: Schedule, link_of: Callable[[int, int], str],
                     host_of: Callable[[int], int], elem: int, link: ShapedLink, calls: int | None = None,
                     scale: float = 1.0, small: bool = False) -> float:
    """Seconds of one call of ``schedule`` (``CostModel.time``'s walk, the call overhead included)
    when every message between hosts passes ``link``'s buckets (see the module doc). ``scale``:
    ``schedule`` stands for a call that many times longer (its tensor bytes and cache footprint,
    as in ``CostModel.time``; the caller scales the time past the call overhead, as the planner
    does). ``small``: the call takes the small-message path (its own fixed cost)."""
    if schedule.nranks == 0 or not any(schedule.steps):
        return model.time(schedule, link_of, elem, small=small, scale=scale)
    call = model.call_overhead(schedule.collective, small, round(tensor_bytes(schedule, elem) * scale))
    mem = model.mem_beta * model.miss(schedule, link_of, elem, scale)
    links = {"shm": model.shm, "mpi": model.mpi}
    steps = list(walk(schedule))
    # A steady stream of calls leaves each bucket at the level refilled in the link's idle spell
    # between calls; ``level`` starts empty and settles with the hand-over times.
    handed: dict[tuple[int, int, int], float] = {}   # (sender, msg, peer) -> when handed to the link
    level = 0.0
    end = 0.0
    crossing = sum(1 for r, s in steps for p in s.send if host_of(p) != host_of(r))
    for _ in range(_SETTLE_PASSES + crossing):
        start_tokens = level if not calls else level + (link.burst - level) / calls
        through, first, buckets = _through_buckets(handed, steps, host_of, elem, link, start_tokens)
        clock = [0.0] * schedule.nranks
        arrival: dict[tuple[int, int], float] = {}
        now: dict[tuple[int, int, int], float] = {}
        for r, s in steps:
            start = max([clock[r]] + [arrival[(rv.peer, rv.msg)] for rv in s.recv])
            nbytes = s.count * elem
            # A native step (schedules/native.py) is the engine's: no executor step, no staging copy.
            reading, work, moved, wire = 0.0 if s.native else model.step_overhead, 0.0, 0, 0.0
            for rv in s.recv:
                kind = link_of(r, rv.peer)
                got = received_bytes(kind, nbytes, rv, elem)
                reading += got * links[kind].beta
                moved += got
                if (rv.peer, rv.msg, r) in through:
                    wire = max(wire, through[(rv.peer, rv.msg, r)] + links[kind].alpha)
            if s.reduce:
                work += nbytes * (len(s.recv) + 1) * model.gamma
                moved += nbytes * (len(s.recv) + 1)
            if s.send and not s.native:
                work += nbytes * model.beta_copy
                moved += nbytes
            # Reading a message from the link overlaps its bytes coming through the bucket; the
            # reduction and the copy onward need them all.
            clock[r] = max(start + reading, wire) + work + moved * mem
            if s.send:
                arrival[(r, s.msg)] = clock[r] + max(links[link_of(r, p)].alpha for p in s.send)
                for p in s.send:
                    if host_of(p) != host_of(r):
                        now[(r, s.msg, p)] = clock[r]
        new_end = max(clock)
        # What each bucket holds when the next call hands it its first message: what it held
        # after its last, refilled until the call ended, through the next call's fixed cost
        # (outside the walk, but time the link idles too) and until that first hand-over.
        new_level = min([link.burst] + [b.tokens + (new_end - b.at + call + first) * link.rate for b in buckets])
        moved_most = max((abs(t - handed.get(m, -1.0)) for m, t in now.items()), default=0.0)
        settled = now.keys() == handed.keys() and moved_most <= 1e-9 and abs(new_level - level) <= 1e-6 * link.burst
        handed, level, end = now, new_level, new_end
        if settled:
            break
    return end + call


def _through_buckets(handed: dict, steps, host_of, elem: int, link: ShapedLink, tokens: float):
    """(when each message between hosts is through its buckets, the first hand-over, the buckets
    as the last message left them): messages take their sender's uplink bucket and the receiver's downlink bucket in the
    order of ``handed`` (the previous walk's hand-over times; none yet: every message at once).
    A message is through when both have passed it, each as if it met it first: bytes that leave
    one bucket at the rate go through the next one at that rate without waiting, so only a
    downlink that several uplinks feed at once (incast) delays them more."""
    sizes = {(r, s.msg, p): s.count * elem for r, s in steps for p in s.send if host_of(p) != host_of(r)}
    order = sorted(sizes, key=lambda m: (handed.get(m, 0.0), m))
    first = min((handed.get(m, 0.0) for m in order), default=0.0)
    ups: dict[int, TokenBucket] = {}
    downs: dict[int, TokenBucket] = {}
    through = {}
    for m in order:
        sender, _, peer = m
        up = ups.setdefault(host_of(sender), TokenBucket(link, first, tokens))
        down = downs.setdefault(host_of(peer), TokenBucket(link, first, tokens))
        at = handed.get(m, 0.0)
        through[m] = max(up.transfer(at, sizes[m]), down.transfer(at, sizes[m]))
    return through, first, [*ups.values(), *downs.values()]
