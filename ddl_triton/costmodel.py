"""An alpha-beta-gamma cost model that times a Schedule on a model of the cluster.

Semantics: every rank runs its steps in order; a step starts when the rank is free
and every message it receives has arrived, and lasts

    step_overhead                                  (the executor's per-step Python cost)
    + sum over received messages: bytes * beta[link]        (reading them)
    + bytes_reduced * gamma                                 (the reduction, per operand)
    + bytes sent * beta_copy                                (filling the send slot)

A message sent at the end of a step arrives ``alpha[link]`` later. The schedule's
time is when its last rank finishes. This is the simulator's walk with clocks, so
the same IR that the executor runs is what the planner costs, including pipelining.

Default parameters were measured on the 2-core development machine (see README,
"Choosing a schedule"); ``Options`` does not expose them, but a tuner can pass its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .schedules import Schedule
from .schedules.simulate import walk


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds from a publish to the peer seeing it
    beta: float   # seconds per byte read from this link


@dataclass(frozen=True)
class CostModel:
    step_overhead: float = 12e-6      # Python executor cost per step (measured: 8-20 us)
    shm: Link = Link(alpha=10e-6, beta=1 / 12e9)  # alpha: a waiting rank wakes from its yield loop
    mpi: Link = Link(alpha=25e-6, beta=1 / 3e9)
    gamma: float = 1 / 20e9           # seconds per byte per reduction operand
    beta_copy: float = 1 / 20e9       # seconds per byte copied into a send slot

    def time(self, schedule: Schedule, link_of: Callable[[int, int], str], elem: int) -> float:
        """Modelled seconds for ``schedule`` with ``elem``-byte elements; ``link_of(a, b)`` is
        "shm" or "mpi" for the link between ranks a and b."""
        clock = [0.0] * schedule.nranks
        arrival: dict[tuple[int, int], float] = {}
        links = {"shm": self.shm, "mpi": self.mpi}
        for r, s in walk(schedule):
            start = max([clock[r]] + [arrival[(rv.peer, rv.msg)] for rv in s.recv])
            nbytes = s.count * elem
            cost = self.step_overhead
            for rv in s.recv:
                cost += nbytes * links[link_of(r, rv.peer)].beta
            if s.reduce:
                cost += nbytes * (len(s.recv) + 1) * self.gamma
            if s.send:
                cost += nbytes * self.beta_copy
            clock[r] = start + cost
            if s.send:
                arrival[(r, s.msg)] = clock[r] + max(links[link_of(r, p)].alpha for p in s.send)
        return max(clock) if clock else 0.0


DEFAULT = CostModel()
