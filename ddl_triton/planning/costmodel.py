"""An alpha-beta-gamma cost model that times a Schedule on a model of the cluster.

Semantics: a call costs a per-collective overhead outside the schedule (validation, the
call check, staging; the small-message allreduce path has its own), then every rank runs
its steps in order; a step starts when the rank is free and every
message it receives has arrived, and lasts

    step_overhead                                  (the executor's per-step Python cost)
    + sum over received messages: bytes * beta[link]        (reading them; over MPI the whole
                                                             message, over shm the slice read)
    + bytes_reduced * gamma                                 (the reduction, per operand)
    + bytes sent * beta_copy                                (filling the send slot)

A step that stands for part of a transport's own allreduce (``Step.native``: schedules/native.py)
costs its reads and its reduction only: the engine runs it on its own threads, from the tensor,
with no executor step and no staging copy.

A message sent at the end of a step arrives ``alpha[link]`` later. The schedule's
time is when its last rank finishes. This is the simulator's walk with clocks, so
the same IR that the executor runs is what the planner costs, including pipelining.

The modelled time is linear in the parameters along the critical path, which is what
lets a tuner fit them by least squares (``terms`` gives the path's coefficients;
ddl_triton/tuning/fit.py). Default parameters were measured on the 2-core development
machine (docs/schedules.md, "Choosing a schedule"); a tuning table carries fitted ones.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable

from ..schedules import Schedule
from ..schedules.dry_run import walk

# Where a call's fixed cost outside the schedule is accounted: one per collective, and the
# small-message allreduce path (ddl_triton/runtime/lanes/small_allreduce.py), which skips the executor.
CALL_KINDS = ("allreduce", "allreduce_small", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
# The model's parameters, in the order of ``terms`` vectors and of ``CostModel.vector``.
PARAMETERS = (tuple(f"call_{k}" for k in CALL_KINDS) + tuple(f"stage_{k}" for k in CALL_KINDS)
              + ("step_overhead", "shm_alpha", "shm_beta", "mpi_alpha", "mpi_beta", "gamma", "beta_copy", "mem_beta"))
_INDEX = {name: i for i, name in enumerate(PARAMETERS)}


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
    # Seconds per call outside the schedule, per CALL_KINDS entry (the same for every schedule
    # of a collective, so they never change a choice; they make predicted times absolute).
    calls: tuple[float, ...] = (0.0,) * len(CALL_KINDS)
    # Seconds per byte of the caller's tensors (input + output) outside the schedule, per
    # CALL_KINDS entry: flattening, contiguous copies, writing results back.
    stages: tuple[float, ...] = (0.0,) * len(CALL_KINDS)
    # The cache cliff: once a call's footprint (``footprint``) outgrows ``cache_bytes``, the
    # share of its bytes that cannot stay cached also costs ``mem_beta`` per byte moved
    # (read, reduced or copied). Not fitted: ``cache_bytes`` is the machine's last-level cache.
    mem_beta: float = 0.0
    cache_bytes: int = 32 << 20

    def call_overhead(self, collective: str, small: bool = False, tensor_bytes: int = 0) -> float:
        """The cost of one call of ``collective`` outside its schedule: fixed, plus per byte of the
        caller's tensors (``small``: the small-message allreduce path)."""
        kind = _call_kind(collective, small)
        return self.calls[kind] + self.stages[kind] * tensor_bytes

    def time(self, schedule: Schedule, link_of: Callable[[int, int], str], elem: int, small: bool = False,
             scale: float = 1.0) -> float:
        """Modelled seconds for ``schedule`` with ``elem``-byte elements; ``link_of(a, b)`` is
        "shm" or "mpi" for the link between ranks a and b. The same number as ``terms(...)[0]``,
        computed without coefficient vectors (the planner calls this for every candidate).
        ``small``: the call takes the small-message allreduce path (its own fixed cost);
        ``scale``: ``schedule`` stands for a call ``scale`` times longer (its footprint and
        tensor bytes scale; the caller scales the returned schedule time)."""
        call = self.call_overhead(schedule.collective, small, round(tensor_bytes(schedule, elem) * scale))
        if schedule.nranks == 0 or not any(schedule.steps):
            return call
        mem = self.mem_beta * self.miss(schedule, link_of, elem, scale)
        clock = [0.0] * schedule.nranks
        arrival: dict[tuple[int, int], float] = {}
        links = {"shm": self.shm, "mpi": self.mpi}
        for r, s in walk(schedule):
            start = max([clock[r]] + [arrival[(rv.peer, rv.msg)] for rv in s.recv])
            nbytes = s.count * elem
            cost = 0.0 if s.native else self.step_overhead
            moved = 0
            for rv in s.recv:
                link = link_of(r, rv.peer)
                got = received_bytes(link, nbytes, rv, elem)
                cost += got * links[link].beta
                moved += got
            if s.reduce:
                cost += nbytes * (len(s.recv) + 1) * self.gamma
                moved += nbytes * (len(s.recv) + 1)
            if s.send and not s.native:
                cost += nbytes * self.beta_copy
                moved += nbytes
            clock[r] = start + cost + moved * mem
            if s.send:
                arrival[(r, s.msg)] = clock[r] + max(links[link_of(r, p)].alpha for p in s.send)
        return max(clock) + call

    def terms(self, schedule: Schedule, link_of: Callable[[int, int], str], elem: int, small: bool = False,
              scale: float = 1.0) -> tuple[float, tuple[float, ...]]:
        """(modelled seconds, coefficients): the time is ``sum(c * p)`` over ``PARAMETERS``
        along the critical path found with this model's parameters. Example: an allreduce of
        one step that reads 1000 B over shm and reduces two operands has coefficient 1 for
        call_allreduce, step_overhead and shm_alpha, 1000 for shm_beta and 2000 for gamma,
        plus its sends' copy bytes for beta_copy."""
        n = len(PARAMETERS)
        call = [0.0] * n
        kind = _call_kind(schedule.collective, small)
        call[kind] = 1.0
        call[len(CALL_KINDS) + kind] = tensor_bytes(schedule, elem) * scale
        if schedule.nranks == 0 or not any(schedule.steps):
            return self._dot(call), tuple(call)
        miss = self.miss(schedule, link_of, elem, scale)
        zero = (0.0,) * n
        clock = [(0.0, zero)] * schedule.nranks
        arrival: dict[tuple[int, int], tuple[float, tuple[float, ...]]] = {}
        for r, s in walk(schedule):
            start = clock[r]
            for rv in s.recv:
                got = arrival[(rv.peer, rv.msg)]
                if got[0] > start[0]:
                    start = got
            nbytes = s.count * elem
            c = list(start[1])
            if not s.native:
                c[_INDEX["step_overhead"]] += 1
            for rv in s.recv:
                link = link_of(r, rv.peer)
                got = received_bytes(link, nbytes, rv, elem)
                c[_INDEX[link + "_beta"]] += got
                c[_INDEX["mem_beta"]] += got * miss
            if s.reduce:
                c[_INDEX["gamma"]] += nbytes * (len(s.recv) + 1)
                c[_INDEX["mem_beta"]] += nbytes * (len(s.recv) + 1) * miss
            if s.send and not s.native:
                c[_INDEX["beta_copy"]] += nbytes
                c[_INDEX["mem_beta"]] += nbytes * miss
            clock[r] = (self._dot(c), tuple(c))
            if s.send:
                slowest = max((link_of(r, p) for p in s.send), key=lambda name: getattr(self, name).alpha)
                c2 = list(c)
                c2[_INDEX[slowest + "_alpha"]] += 1
                arrival[(r, s.msg)] = (self._dot(c2), tuple(c2))
        last = max(clock, key=lambda t: t[0])
        c = [a + b for a, b in zip(last[1], call)]
        return self._dot(c), tuple(c)

    def miss(self, schedule: Schedule, link_of: Callable[[int, int], str], elem: int, scale: float = 1.0) -> float:
        """The share of a call's bytes that cannot stay in the last-level cache: 0 while its
        footprint fits, then 1 - cache / footprint. The footprint is what the ranks sharing
        rank 0's cache (its shm peers) touch: their input and output tensors, and as much
        again in message slots."""
        local = 1 + sum(link_of(0, p) == "shm" for p in range(1, schedule.nranks))
        footprint = 2 * local * tensor_bytes(schedule, elem) * scale
        return max(0.0, 1.0 - self.cache_bytes / footprint) if footprint > 0 else 0.0

    def vector(self) -> tuple[float, ...]:
        """The parameters in ``PARAMETERS`` order."""
        return tuple(self.calls) + tuple(self.stages) + (self.step_overhead, self.shm.alpha, self.shm.beta, self.mpi.alpha, self.mpi.beta,
                                    self.gamma, self.beta_copy, self.mem_beta)

    @classmethod
    def from_vector(cls, v, cache_bytes: int = 32 << 20) -> "CostModel":
        p = dict(zip(PARAMETERS, (float(x) for x in v)))
        return cls(step_overhead=p["step_overhead"], shm=Link(p["shm_alpha"], p["shm_beta"]),
                   mpi=Link(p["mpi_alpha"], p["mpi_beta"]), gamma=p["gamma"], beta_copy=p["beta_copy"],
                   calls=tuple(p[f"call_{k}"] for k in CALL_KINDS), stages=tuple(p[f"stage_{k}"] for k in CALL_KINDS),
                   mem_beta=p["mem_beta"], cache_bytes=cache_bytes)

    def to_dict(self) -> dict:
        """Plain data for a tuning table: every parameter in seconds (per byte for betas and gamma)."""
        out = asdict(self)
        out["calls"] = dict(zip(CALL_KINDS, self.calls))
        out["stages"] = dict(zip(CALL_KINDS, self.stages))
        return {k: out[k] for k in (f.name for f in fields(self))}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of ``to_dict``; raises ValueError naming a missing or negative parameter."""
        try:
            calls, stages = d.get("calls") or {}, d.get("stages") or {}
            model = cls(step_overhead=float(d["step_overhead"]), shm=Link(**{k: float(v) for k, v in d["shm"].items()}),
                        mpi=Link(**{k: float(v) for k, v in d["mpi"].items()}), gamma=float(d["gamma"]),
                        beta_copy=float(d["beta_copy"]), calls=tuple(float(calls.get(k, 0.0)) for k in CALL_KINDS),
                        stages=tuple(float(stages.get(k, 0.0)) for k in CALL_KINDS),
                        mem_beta=float(d.get("mem_beta", 0.0)), cache_bytes=int(d.get("cache_bytes", 32 << 20)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cost model parameters are incomplete or not numbers ({e!r})") from None
        if any(x < 0 for x in model.vector()):
            raise ValueError(f"cost model parameters must be >= 0, got {dict(zip(PARAMETERS, model.vector()))}")
        return model

    def _dot(self, c) -> float:
        return sum(a * b for a, b in zip(c, self.vector()))


DEFAULT = CostModel()


def received_bytes(link: str, step_bytes: int, recv, elem: int) -> int:
    """Bytes a receive moves: a one-sided link (shm) reads just the step's slice in place; a
    two-sided one (MPI) receives the whole message (``Recv.size`` elements) to read any of it."""
    return max(step_bytes, recv.size * elem) if link == "mpi" else step_bytes


def tensor_bytes(schedule: Schedule, elem: int) -> int:
    """Bytes of the caller's input and output tensors on one rank."""
    in_place = schedule.collective in ("allreduce", "broadcast")
    return (schedule.in_count + (0 if in_place else schedule.out_count)) * elem


def _call_kind(collective: str, small: bool) -> int:
    return _INDEX["call_allreduce_small" if small and collective == "allreduce" else f"call_{collective}"]


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """This machine's largest CPU cache (Linux sysfs), e.g. 33554432 for a 32 MiB L3."""
    import glob
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            best = max(best, int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1))
        except (OSError, ValueError):
            continue
    return best or default
