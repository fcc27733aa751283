"""Fault-injection worker, run under mpiexec: mismatched calls, a rank that never calls,
a rank killed mid-collective. Every rank prints one machine-readable line per case:

    FAULT case=<name> rank=<r> error=<ExceptionType> seconds=<time to the error> msg=<first line>

Usage: python tests/multirank/faults_worker.py mismatch | skip | kill <victim> [--stamp FILE]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import ddl_triton as ddl
from support.report import print_line


def report(case: str, rank: int, error: BaseException | None, seconds: float, to_file: str = "") -> None:
    name = type(error).__name__ if error is not None else "none"
    msg = str(error).splitlines()[0] if error is not None else ""
    line = f"FAULT case={case} rank={rank} error={name} seconds={seconds:.2f} msg={msg}"
    if to_file:  # also keep a file, written whole (rename) so that a reader never sees half a line
        with open(f"{to_file}.rank{rank}.tmp", "w") as f:
            f.write(line + "\n")
        os.replace(f"{to_file}.rank{rank}.tmp", f"{to_file}.rank{rank}")
    print_line(line)


def mismatch_cases(rank: int, size: int):
    """(name, the call each rank makes): the last rank (or rank 0) deviates in one argument."""
    last = size - 1
    x = lambda n=100, dtype=torch.float32: torch.ones(n, dtype=dtype)  # noqa: E731
    return [
        ("collective", lambda c: c.broadcast(x(), root=0) if rank == last else c.allreduce(x())),
        ("numel", lambda c: c.allreduce(x(101 if rank == last else 100))),
        ("dtype", lambda c: c.allreduce(x(dtype=torch.float64 if rank == 0 else torch.float32))),
        ("op", lambda c: c.allreduce(x(), op="max" if rank == last else "sum")),
        ("barrier", lambda c: c.barrier() if rank == last else c.allreduce(x())),
        ("root", lambda c: c.broadcast(x(), root=1 % size if rank == last else 0)),
        # the small-message path against the general path: one size under its limit, one over
        ("small_vs_large", lambda c: c.allreduce(x(100_000 if rank == last else 100))),
        # a repeated shape takes the small path's fast entry; the deviating rank's is a first call
        ("fast_entry", lambda c: (c.allreduce(x(7)), c.allreduce(x(8 if rank == last else 7)))),
    ]


def run_mismatch(world) -> int:
    rank, size = world.Get_rank(), world.Get_size()
    for name, call in mismatch_cases(rank, size):
        comm = ddl.init(world.Dup())
        comm.allreduce(torch.ones(10))  # a good call first: the sequence numbers are in step
        t0 = time.monotonic()
        error = None
        try:
            call(comm)
        except Exception as e:  # noqa: BLE001
            error = e
        report(name, rank, error, time.monotonic() - t0)
        comm.close()
        world.Barrier()  # control path only: keep the cases apart
    return 0


def run_skip(world) -> int:
    """The last rank does not make the call: the others must time out, naming it."""
    rank, size = world.Get_rank(), world.Get_size()
    comm = ddl.init(world.Dup())
    comm.allreduce(torch.ones(10))
    t0 = time.monotonic()
    error = None
    if rank != size - 1:
        try:
            comm.allreduce(torch.ones(1000))
        except Exception as e:  # noqa: BLE001
            error = e
    report("skip", rank, error, time.monotonic() - t0)
    world.Barrier()
    return 0


def run_kill(world, victim: int, stamp: str) -> int:
    """Rank ``victim`` SIGKILLs itself in the middle of a stream of large allreduces
    (``victim`` = the world size: nobody does, and a test kills them all from outside)."""
    rank = world.Get_rank()
    comm = ddl.init()
    t = torch.ones(1 << 20)
    error = None
    for i in range(10_000):
        if i == 5 and stamp:  # inside the stream: every segment is mapped (and already unlinked)
            # Written under another name, then renamed: the test globs for the stamp and reads the
            # pid at once, so it must never see the file before its contents.
            writing = f"{stamp}.writing.rank{rank}"  # not matched by the test's "stamp.started.rank*"
            with open(writing, "w") as f:
                f.write(str(os.getpid()))
            os.replace(writing, f"{stamp}.started.rank{rank}")
        if rank == victim and i == 5:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.allreduce(t, op="avg")
        except Exception as e:  # noqa: BLE001
            error = e
            break
    with open(stamp) as f:
        killed_at = float(f.read())
    report(f"kill{victim}", rank, error, time.time() - killed_at, to_file=stamp)
    # A survivor's error propagates like any uncaught one: the exit guard ends it with status 1.
    if error is not None:
        raise error
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["mismatch", "skip", "kill"])
    p.add_argument("victim", nargs="?", type=int, default=0)
    p.add_argument("--stamp", default="")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    if args.mode == "mismatch":
        return run_mismatch(world)
    if args.mode == "skip":
        return run_skip(world)
    return run_kill(world, args.victim, args.stamp)


if __name__ == "__main__":
    sys.exit(main())
