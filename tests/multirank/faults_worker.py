"""Fault-injection worker, run under mpiexec: mismatched calls, a rank that never calls,
a rank killed mid-collective, a rank that leaves while the others wait. Every rank prints one
machine-readable line per case:

    FAULT case=<name> rank=<r> error=<ExceptionType> seconds=<time to the error> msg=<first line>

Usage: python tests/multirank/faults_worker.py mismatch | skip | kill <victim> [--stamp FILE] | leave | absent_init
(``leave`` also runs without MPI's launcher: ranks from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
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


def run_absent_init(world) -> int:
    """The last rank never calls ``dist.init_process_group("ddl")`` (it sleeps, then leaves): the
    others must raise within DDL_TIMEOUT, not block in MPI's communicator duplication for ever."""
    import torch.distributed as dist

    import ddl_triton.torch  # noqa: F401 - registers the "ddl" backend

    rank, size = world.Get_rank(), world.Get_size()
    if rank == size - 1:
        time.sleep(float(os.environ["DDL_TIMEOUT"]) * 2)
        report("absent_init", rank, None, 0.0)
        return 0
    t0, error = time.monotonic(), None
    try:
        dist.init_process_group("ddl")
    except Exception as e:  # noqa: BLE001
        error = e
    report("absent_init", rank, error, time.monotonic() - t0)
    return 1 if error is not None else 0


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


# The leave cases, in order: rank 1 leaves the communicator one way while the others wait in a
# collective it never issues (small: the small-message path; large: the general path).
LEAVE_CASES = ("close_small", "close_large", "close_barrier", "finalize", "destroy_group", "exit")


def run_leave() -> int:
    """Rank 1 leaves (closes, finalizes, destroys its torch group, or exits the script) where the
    other ranks call a collective; each of them must raise CollectiveSkipped naming rank 1 and what
    it did, within 2 s. Each case has a world communicator of its own (finalized between cases); the
    last case ("exit") ends rank 1's script while the others wait: they raise, uncaught (exit 1)."""
    import torch.distributed as dist

    from ddl_triton.runtime.setup.bootstrap import launched_by_mpi
    import ddl_triton.torch  # noqa: F401 - registers the "ddl" backend

    store = None
    if not launched_by_mpi():  # env://: one TCPStore for the job, a namespace per case
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0,
                              wait_for_workers=False)
    for case in LEAVE_CASES:
        case_store = None if store is None else dist.PrefixStore(f"{case}/", store)
        if case == "destroy_group":
            if store is None:
                dist.init_process_group("ddl")
            else:
                dist.init_process_group("ddl", store=case_store, rank=rank, world_size=size)
        comm = ddl.init() if store is None else ddl.init(store=case_store, rank=rank, size=size)  # (torch's, if made)
        rank = comm.rank
        comm.allreduce(torch.ones(10))  # a good call first: the sequence numbers are in step
        error, t0 = None, time.monotonic()
        if rank == 1:
            if case == "exit":
                report(case, rank, None, 0.0)
                return 0  # the script ends: at exit the communicator says so
            {"finalize": ddl.finalize, "destroy_group": dist.destroy_process_group}.get(case, comm.close)()
        else:
            try:
                if case == "close_barrier":
                    comm.barrier()
                elif case == "destroy_group":
                    dist.all_reduce(torch.ones(100_000))
                else:
                    comm.allreduce(torch.ones(100_000 if case in ("close_large", "finalize") else 10))
            except Exception as e:  # noqa: BLE001
                error = e
        report(case, rank, error, time.monotonic() - t0)
        if case == "exit" and error is not None:
            raise error  # uncaught, as in any script: exit 1
        if case == "destroy_group":
            if rank != 1:
                dist.destroy_process_group()
        ddl.finalize()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["mismatch", "skip", "kill", "leave", "absent_init"])
    p.add_argument("victim", nargs="?", type=int, default=0)
    p.add_argument("--stamp", default="")
    args = p.parse_args()
    if args.mode == "leave":
        return run_leave()
    world = MPI.COMM_WORLD
    if args.mode == "mismatch":
        return run_mismatch(world)
    if args.mode == "skip":
        return run_skip(world)
    if args.mode == "absent_init":
        return run_absent_init(world)
    return run_kill(world, args.victim, args.stamp)


if __name__ == "__main__":
    sys.exit(main())
