"""Soak: many random collectives, every result checked, resources tracked.

Run: mpiexec -n 2 python bench/soak.py [--count 10000] [--seed 7] [--json out.json]

Every rank draws the same sequence of cases from one seeded generator: a
collective (allreduce, reduce_scatter, all_gather, broadcast, all_to_all,
barrier), a dtype, an op, a size (log-uniform up to --max-elems), a root, and
whether to issue it asynchronously (up to 4 in flight). Data is integer-valued,
so every result is checked with ``==`` against the exact answer. Reports RSS
and open file descriptors at the start (after a warm-up of the first tenth) and the end,
RSS at every tenth of the run, and the
number of wrong results, as a table and optionally JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from mpi4py import MPI

import ddl_triton as ddl

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
_COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _data(count: int, rank: int, dtype: torch.dtype, scale: int = 1) -> torch.Tensor:
    return (((torch.arange(count, dtype=torch.int64) * 5 + 7 * rank) % 17 - 8) * scale).to(dtype)


def _case(rng: random.Random, max_elems: int):
    coll = rng.choice(_COLLECTIVES)
    dtype = rng.choice(_DTYPES)
    op = rng.choice(["sum", "min", "max"] + (["avg"] if dtype.is_floating_point else []))
    count = int(round(2 ** rng.uniform(0, max_elems.bit_length() - 1))) if rng.random() > 0.05 else 0
    return coll, dtype, op, count, rng.random() < 0.3


def _issue(comm, coll, dtype, op, count, rank, size, root, async_op):
    """Start one collective; return (work or None, a function giving (got, expected))."""
    scale = size if op == "avg" else 1
    if coll == "allreduce":
        t = _data(count, rank, dtype, scale)
        w = comm.allreduce(t, op=op, async_op=async_op)
        stack = torch.stack([_data(count, q, torch.int64, scale) for q in range(size)])
        exp = {"sum": stack.sum(0), "avg": stack.sum(0) // size, "min": stack.min(0).values,
               "max": stack.max(0).values}[op]
        return w, lambda: (t, exp.to(dtype))
    if coll == "reduce_scatter":
        inp = _data(size * count, rank, dtype, scale)
        out = torch.empty(count, dtype=dtype)
        w = comm.reduce_scatter(out, inp, op=op, async_op=async_op)
        stack = torch.stack([_data(size * count, q, torch.int64, scale) for q in range(size)])
        full = {"sum": stack.sum(0), "avg": stack.sum(0) // size, "min": stack.min(0).values,
                "max": stack.max(0).values}[op]
        return w, lambda: (out, full[rank * count:(rank + 1) * count].to(dtype))
    if coll == "all_gather":
        inp = _data(count, rank, dtype)
        out = torch.empty(size * count, dtype=dtype)
        w = comm.all_gather(out, inp, async_op=async_op)
        return w, lambda: (out, torch.cat([_data(count, q, dtype) for q in range(size)]))
    if coll == "broadcast":
        t = _data(count, rank, dtype)
        w = comm.broadcast(t, root=root, async_op=async_op)
        return w, lambda: (t, _data(count, root, dtype))
    if coll == "all_to_all":
        inp = (torch.arange(size * count) + 1000 * rank).to(dtype) if count else torch.empty(0, dtype=dtype)
        out = torch.empty(size * count, dtype=dtype)
        w = comm.all_to_all(out, inp, async_op=async_op)
        exp = torch.cat([torch.arange(rank * count, (rank + 1) * count) + 1000 * q for q in range(size)]).to(dtype) \
            if count else out.new_empty(0)
        return w, lambda: (out, exp)
    w = comm.barrier(async_op=async_op)
    return w, lambda: (torch.zeros(1), torch.zeros(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-elems", type=int, default=1 << 16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    comm = ddl.init()
    rank, size = comm.rank, comm.size
    rng = random.Random(args.seed)
    wrong = 0
    start_rss = start_fds = None
    trajectory: list[int] = []  # RSS at every tenth of the run: a leak grows, a filling cache levels off
    in_flight: list = []
    t0 = time.perf_counter()
    # "Start" is taken after the first tenth: by then the bounded caches (plans, schedules,
    # compiled programs, shm views, MPI staging pools) have filled, so start-to-end growth
    # measures leaks rather than warm-up. The trajectory printed at the end shows both.
    warmup = args.count // 10
    for i in range(args.count):
        if i == warmup:
            start_rss, start_fds = _rss_bytes(), _open_fds()
        if i % max(1, args.count // 10) == 0:
            trajectory.append(_rss_bytes())
        coll, dtype, op, count, async_op = _case(rng, args.max_elems)
        root = rng.randrange(size)
        w, check = _issue(comm, coll, dtype, op, count, rank, size, root, async_op)
        in_flight.append((w if async_op else None, check))
        if not async_op or len(in_flight) >= 4:
            for work, chk in in_flight:
                if work is not None:
                    work.wait()
                got, exp = chk()
                wrong += 0 if torch.equal(got, exp) else 1
            in_flight = []
    for work, chk in in_flight:
        if work is not None:
            work.wait()
        got, exp = chk()
        wrong += 0 if torch.equal(got, exp) else 1
    elapsed = time.perf_counter() - t0
    end_rss, end_fds = _rss_bytes(), _open_fds()
    trajectory.append(end_rss)
    rows = MPI.COMM_WORLD.gather((rank, start_rss, end_rss, start_fds, end_fds, wrong), root=0)
    paths = MPI.COMM_WORLD.gather(trajectory, root=0)
    if rank == 0:
        print(f"# soak: {args.count} random collectives on {size} ranks in {elapsed:.1f} s (seed {args.seed})")
        print(f"{'rank':>4} {'RSS start MiB':>14} {'RSS end MiB':>12} {'growth':>8} {'fds start':>9} "
              f"{'fds end':>8} {'wrong':>6}")
        for r, rs, re_, fs, fe, w in rows:
            print(f"{r:>4} {rs / 2**20:>14.1f} {re_ / 2**20:>12.1f} {100 * (re_ - rs) / rs:>7.2f}% {fs:>9} {fe:>8} {w:>6}")
        print("RSS MiB at each tenth of the run, per rank:")
        for r, path in enumerate(paths):
            print(f"{r:>4} " + " ".join(f"{v / 2**20:.1f}" for v in path))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"count": args.count, "seed": args.seed, "ranks": size, "seconds": elapsed,
                           "rows": [dict(zip(["rank", "rss_start", "rss_end", "fds_start", "fds_end", "wrong"], r))
                                    for r in rows], "rss_trajectory": paths}, f, indent=1)
    total_wrong = MPI.COMM_WORLD.allreduce(wrong)
    ddl.finalize()
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
