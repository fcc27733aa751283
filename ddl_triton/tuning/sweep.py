"""The sweep: every call shape ``ddl-tune`` was asked for, raced, into measurement rows.

A call shape is (collective, dtype, size), the sizes a geometric series (``geometric_sizes``).
Before the first one, every collective runs untimed on every communicator for about a
second (``_warm_up``). For each shape, the race (ddl_triton/tuning/race.py) times every
candidate (ddl_triton/tuning/candidates.py), and, for allreduce with ``--peers``, MPICH's
``MPI_Allreduce`` and gloo's on the same data. Each timed thing becomes one row: its median,
p20 and p80 time per call and how many times it was measured.

The sweep stops at the next shape once ``--budget`` is spent, or on Ctrl-C (``Stop``): every
rank catches SIGINT and the ranks agree to stop together; what was measured is kept.
"""
from __future__ import annotations

import contextlib
import functools
import signal
import statistics
import time

from ..runtime.setup.bootstrap_values import mpi_bcast
from .candidates import Candidate, candidates
from .race import Race, Runner, calls_for, candidate_runner
from .timing import quantile


def geometric_sizes(low: int, high: int, factor: int) -> list[int]:
    """low, low*factor, ... below high, then high itself: 8, 32, ..., 134217728, 268435456."""
    out, n = [], max(1, low)
    while n <= high:
        out.append(n)
        n *= factor
    if out and out[-1] != high:
        out.append(high)  # the top of the range is always measured
    return out


class Stop:
    """Ctrl-C and the budget: a flag set by SIGINT, read by every rank at task boundaries."""

    def __init__(self, budget: float | None):
        self.deadline = None if budget is None else time.monotonic() + budget
        self.interrupted = False
        self._previous = None

    def __enter__(self):
        with contextlib.suppress(ValueError):  # not the main thread: no handler, no Ctrl-C
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum, _frame):
        self.interrupted = True

    def wanted(self, world) -> bool:
        import numpy as np
        from mpi4py import MPI
        mine = self.interrupted or (self.deadline is not None and time.monotonic() > self.deadline)
        anyone = np.zeros(1, dtype=np.int64)
        world.Allreduce(np.array([int(mine)], dtype=np.int64), anyone, op=MPI.MAX)  # a buffer: nothing pickled
        return bool(anyone[0])


def sweep(args, world, comms: dict, progress) -> tuple[list[dict], bool]:
    """Time every task; returns (measurement rows, whether the sweep was stopped early)."""
    import torch

    from .. import schedules

    size = world.Get_size()
    any_comm = next(iter(comms.values()))
    dims = any_comm.topology.dims
    race = Race(world, args.target_ms / 1e3, args.rounds, args.finalists, any_comm.options.timeout)
    rows: list[dict] = []
    tasks = [(c, d, n) for c in args.collectives for d in args.dtypes
             for n in geometric_sizes(args.min_bytes, args.max_bytes, args.factor)]
    stopped = False
    _warm_up(world, comms.values(), size, timeout=any_comm.options.timeout)
    with Stop(args.budget) as stop:
        for collective, dtype_name, nbytes in tasks:
            if stop.wanted(world):
                stopped = True
                break
            dtype = getattr(torch, dtype_name)
            elem = dtype.itemsize
            made = calls_for(collective, nbytes // elem, size, dtype)
            if made is None or nbytes < elem:
                progress(collective, nbytes, skipped=True)
                continue
            call, numel = made
            count = schedules.count_for(collective, numel, size)
            cands = candidates(collective, count, elem, dims, args.chunks, args.depths)
            runners = {c: candidate_runner(comms[(c.chunk_bytes, c.depth)], call, c, elem) for c in cands}
            peers = _peer_runners(args, world, numel, dtype) if collective == "allreduce" else {}
            times, finalists = race.run(runners, peers)
            for c, ts in times.items():
                if not ts:
                    continue
                row = {"collective": collective, "dtype": dtype_name, "bytes": numel * elem,
                       "median_us": statistics.median(ts) * 1e6, "p20_us": quantile(ts, 0.2) * 1e6,
                       "p80_us": quantile(ts, 0.8) * 1e6, "rounds": len(ts)}
                if isinstance(c, Candidate):
                    row.update(c.to_json(), finalist=c in finalists)
                else:
                    row.update(peer=c)
                rows.append(row)
            progress(collective, nbytes)
    return rows, stopped


def _warm_up(world, comms, size: int, seconds: float = 1.0, timeout: float = 300.0) -> None:
    """Run every collective on every communicator for about ``seconds``, untimed, so that the
    first size measured is not the one that pays for cold caches, lazy imports and first
    page faults."""
    import torch

    from .. import schedules

    calls = [calls_for(c, 4096 * size, size, torch.float32)[0] for c in schedules.COLLECTIVES]
    for comm in comms:
        deadline = time.monotonic() + seconds / max(1, len(comms))
        while True:
            for call in calls:
                call(comm)
            # Every rank must run the same number of rounds: rank 0's clock decides.
            if mpi_bcast(world, time.monotonic() > deadline, 0, timeout, "the warm-up's end") is True:
                break


def _peer_runners(args, world, numel: int, dtype) -> dict:
    """MPICH's MPI_Allreduce and gloo's allreduce on the same data, when --peers asks (gloo:
    the default process group, which the command line started with timing.start_gloo)."""
    if not args.peers:
        return {}
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    buf = torch.ones(numel, dtype=dtype)
    # Each peer as its fastest user calls it: MPICH on a buffer spec built once, not per call.
    mpi_type = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
                torch.int64: MPI.INT64_T}.get(dtype)  # MPI has no standard fp16 / bf16 type
    out = {}
    if mpi_type is not None:
        out["MPICH MPI_Allreduce"] = Runner(functools.partial(world.Allreduce, MPI.IN_PLACE, [buf.numpy(), mpi_type],
                                                              MPI.SUM))
    if dist.is_initialized():
        out["gloo allreduce"] = Runner(functools.partial(dist.all_reduce, buf))
    return out
