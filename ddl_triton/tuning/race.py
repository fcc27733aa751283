"""The timing race: which of one call shape's candidates is fastest, measured fairly.

Every measurement is ddl_triton/tuning/timing.py's ``time_per_call``: a warm call, a barrier,
a candidate run back to back long enough to be timed (at least the race's target), and the
slowest rank's time per call. Successive halving prunes the candidates: all survivors are
timed once, in turn, and the slower half dropped (anything within 25% of the best stays),
until ``finalists`` remain; those are timed in ``rounds`` interleaved rounds (rotated, so no
candidate always goes first), after a warm-up that also sets each one's pace. Rank 0 decides
every pruning and broadcasts it, so every rank times the same candidates.

A ``Runner`` is one timed thing: a call, made inside a context (a forced plan, or nothing).
``calls_for`` makes the call of one collective on buffers of one size.
"""
from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass

from ..runtime.setup.bootstrap_values import BootstrapError, mpi_bcast
from .timing import iterations, time_per_call


@dataclass(frozen=True)
class Runner:
    """One timed thing: ``call()`` inside ``context()`` (a candidate's forced plan, or nothing)."""

    call: object
    context: object = contextlib.nullcontext


def forced(comm, call, plan) -> Runner:
    """``call(comm)`` with every collective of ``comm`` run by ``plan``."""
    return Runner(lambda: call(comm), lambda: comm.forcing(plan))


def candidate_runner(comm, call, cand, elem: int) -> Runner:
    """``call(comm)`` run the way candidate ``cand`` says (its chunk no larger than a slot)."""
    from .. import schedules
    from ..planning.planner import Plan

    dims = comm.topology.dims
    plan = Plan(cand.schedule, max(1, min(cand.chunk_bytes, comm.options.chunk_bytes) // elem), "tuner candidate",
                dims if schedules.uses_grid(cand.schedule) else None, cand.algos)
    return forced(comm, call, plan)


def calls_for(collective: str, numel: int, size: int, dtype):
    """(call, numel actually used) for one collective, or None when the size cannot be formed
    (reduce_scatter and all_to_all need at least one element per rank).

    Every buffer is written before it is timed: a zero-filled allocation maps one shared zero
    page, and reading it is far faster than reading real memory. Sums of ones grow to inf
    over many calls, which costs the same as finite data (no denormals)."""
    import torch

    if collective in ("reduce_scatter", "all_to_all"):
        numel -= numel % size
        if numel == 0:
            return None
    inp = torch.ones(numel, dtype=dtype)
    if collective == "allreduce":
        return (lambda comm: comm.allreduce(inp)), numel
    if collective == "broadcast":
        return (lambda comm: comm.broadcast(inp, root=0)), numel
    if collective == "reduce_scatter":
        out = torch.ones(numel // size, dtype=dtype)
        return (lambda comm: comm.reduce_scatter(out, inp)), numel
    if collective == "all_gather":
        out = torch.ones(numel * size, dtype=dtype)
        return (lambda comm: comm.all_gather(out, inp)), numel
    out = torch.ones(numel, dtype=dtype)
    return (lambda comm: comm.all_to_all(out, inp)), numel


class Race:
    """Times the candidates of one call shape (see the module doc)."""

    def __init__(self, world, target_s: float, rounds: int, finalists: int, timeout: float = 300.0):
        self.world, self.target_s, self.rounds, self.finalists = world, target_s, rounds, finalists
        self.timeout = timeout  # the most any control exchange between the ranks may wait

    def measure(self, runner: Runner, iters: int) -> float:
        """Seconds per call of ``runner``, the slowest rank's, after a barrier. The warm call,
        made inside the plan before the barrier, re-plans the shape (not timed)."""
        with runner.context():
            return time_per_call(self.world, runner.call, iters)

    def run(self, runners: dict, peers: dict | None = None) -> tuple[dict, list]:
        """{candidate: [seconds per call, ...]} for every candidate, and the finalists."""
        times: dict = {c: [] for c in runners}
        iters = {}
        for c, run in runners.items():              # warm-up (plans, schedules, pages) and pace
            iters[c] = iterations(self.target_s, self.measure(run, 1))
        alive = list(runners)
        while len(alive) > self.finalists:
            for c in alive:
                times[c].append(self.measure(runners[c], iters[c]))
            ranked = sorted(alive, key=lambda c: statistics.median(times[c]))
            # The faster half goes on, and so does anything within 25% of the best: one noisy
            # measurement must not drop a close contender.
            best = statistics.median(times[ranked[0]])
            keep = max(self.finalists, math.ceil(len(alive) / 2))
            survivors = [c for i, c in enumerate(ranked) if i < keep or statistics.median(times[c]) <= 1.25 * best]
            if len(survivors) == len(alive):
                survivors = ranked[:keep]  # every candidate is close: halve anyway, or this never ends
            # Rank 0's ranking decides; candidates cross as their places in ``alive`` (the same list on every rank).
            picked = mpi_bcast(self.world, [alive.index(c) for c in survivors], 0, self.timeout, "the race's survivors")
            if not isinstance(picked, list) or not all(type(i) is int and 0 <= i < len(alive) for i in picked):
                raise BootstrapError(f"rank {self.world.Get_rank()}: ddl-tune: rank 0 sent survivors {picked!r:.100}")
            alive = [alive[i] for i in picked]
        extra = dict(peers or {})
        for name, run in extra.items():
            iters[name] = iterations(self.target_s, self.measure(run, 1))
            times[name] = []
        for r in range(self.rounds):
            order = alive + list(extra)
            order = order[r % len(order):] + order[: r % len(order)]  # rotate: no candidate always first
            for c in order:
                times[c].append(self.measure(runners.get(c) or extra[c], iters[c]))
        return times, alive
