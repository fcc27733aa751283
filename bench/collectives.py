"""nccl-tests-style benchmark of ddl_triton against MPICH's MPI_Allreduce and torch's gloo.

Run under mpiexec, e.g.:  mpiexec -n 2 python bench/collectives.py [--json out.json]

Every size is timed in interleaved rounds (ddl, mpi, gloo, then a new order each round,
the same on every rank) within one run, so all peers see the same machine noise; the table quotes the
median round (p20/p80 go to the JSON). Every peer reduces the same buffer and is
called as its fastest user would call it, with everything but the call prepared
once: MPICH's ``Allreduce(IN_PLACE, [view, datatype], op)`` on a prebuilt numpy
view, gloo's ``all_reduce(tensor)``, ddl's ``comm.allreduce(tensor)``. Columns follow nccl-tests:
algbw = bytes / time; busbw = algbw * 2(n-1)/n for allreduce. ``#wrong`` counts
elements that differ from the exact answer on integer-valued data after the
timed rounds (checked on every rank, summed over ranks); any wrong element makes the run
exit 1, naming the sizes and implementations that were wrong, after the table is printed.

Across hosts (``--link-rate 1gbit``, the rate each host's link is shaped to, e.g. on the
testbed: docs/testbed.md), each row also shows ``bound``: the least time any allreduce of
S bytes over H hosts needs on that link, 2(H-1)/H * S through each host's link in each
direction (reduce-scatter, then all-gather, between the hosts), and ``%bound``, that
time's share of the measured one (100% = the link is the only cost).

On one host, each row shows ``mem(us)``: the least time the memory allows, from a copy
bandwidth measured in the same run. Every rank copies S bytes between two prebuilt buffers at
once (``copy``, timed in the same interleaved rounds as the peers, so it sees the same drift),
less a copy of one element (the call's fixed cost). An in-place allreduce must at least read
every rank's input once and write its output once: one copy's memory traffic per rank, whatever
the schedule. So mem = that copy time, the floor, and ``%mem`` is its share of each peer's
measured time. Intermediate traffic (publishing into a shared segment, reading the peer's
share) comes on top; chunked schedules keep it in the shared last-level cache, which is why
no floor that counts it as memory traffic would hold (through a segment out of cache it is 2.5
copies per rank). The copy is timed at the call's size, so the floor follows the cache level
that size lives in. Below 64 KiB a copy is mostly its call's fixed cost, not memory traffic:
the column shows "-" there.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.distributed

import ddl_triton as ddl
from ddl_triton.testbed.hosts import parse_rate
from ddl_triton.tuning.timing import quantile, start_gloo

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
# MPI's names for them, looked up in _impls: importing mpi4py.MPI starts MPI, and the suite imports
# this module without ranks (tests/unit/test_bench_verdicts.py).
_MPI_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T", torch.int64: "INT64_T"}
_MPI_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if s < 4096 else 2
    return out


class _Impl:
    """One allreduce implementation under test. ``bind(tensor)`` prepares, once, the call its
    fastest user would make on that buffer (a prebuilt numpy view and MPI datatype for MPICH,
    the tensor itself for gloo and ddl) and returns it as a callable of no arguments, which
    reduces the buffer in place; timing calls only that, so no peer pays a per-call wrapper."""

    def __init__(self, name: str, bind, comm=None):
        self.name = name
        self.bind = bind
        self.comm = comm  # a ddl communicator, whose transports count bytes


def _ddl_impl(name: str, comm, op: str) -> _Impl:
    return _Impl(name, lambda t: functools.partial(comm.allreduce, t, op=op), comm)


def _impls(comm, mpi_comm, dist, op: str, dtype: torch.dtype, names: list[str], schedule: str) -> list[_Impl]:
    from mpi4py import MPI
    impls = []
    if "ddl" in names:
        if schedule == "auto":
            impls.append(_ddl_impl("ddl", comm, op))
        else:
            from ddl_triton import schedules
            chosen = [n for n in schedules.names() if schedules.supports(n, "allreduce")] if schedule == "all" \
                else [schedule]
            impls.append(_ddl_impl("ddl", comm, op))
            for name in chosen:
                impls.append(_ddl_impl(f"ddl:{name}", ddl.init(MPI.COMM_WORLD.Dup(), schedule=name), op))
    if "mpi" in names and dtype in _MPI_TYPES:
        mpi_type, mpi_op = getattr(MPI, _MPI_TYPES[dtype]), getattr(MPI, _MPI_OPS[op])
        # The buffer spec [numpy view, datatype] is built once: building it per call cost MPICH
        # about 2 us of its 3.7 us at 128 B on shm.
        impls.append(_Impl("mpi", lambda t: functools.partial(mpi_comm.Allreduce, MPI.IN_PLACE,
                                                              [t.numpy(), mpi_type], mpi_op)))
    if "gloo" in names and dist is not None:
        red = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        impls.append(_Impl("gloo", lambda t: functools.partial(dist.all_reduce, t, op=red)))
    return impls


def _time_round(impl: _Impl, buf: torch.Tensor, iters: int, mpi_comm) -> float:
    """This rank's seconds per call, between two barriers: every rank's time includes waiting
    for the slowest (the slowest rank's is taken after all rounds, so that no reduction of
    times runs between two implementations' rounds). Not timing.time_per_call, whose warm call
    would run on the freshly reset data before every round."""
    call = impl.bind(buf)
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    mpi_comm.Barrier()
    return (time.perf_counter() - t0) / iters


# Below this size a copy's time is mostly its call, not memory traffic: no memory bound is shown.
_MEM_BOUND_MIN_BYTES = 64 << 10


def _copy_impls(count: int, dtype: torch.dtype) -> list[_Impl]:
    """The memory-traffic yardstick: every rank copies the buffer into a prebuilt one of its own
    ("copy"), and one element of it ("copy0": the copy call's fixed cost, taken off)."""
    dst = torch.empty(count, dtype=dtype)
    dst0 = torch.empty(1, dtype=dtype)
    return [_Impl("copy", lambda t: functools.partial(dst.copy_, t)),
            _Impl("copy0", lambda t: functools.partial(dst0.copy_, t[:1]))]


def _count_wrong(impl: _Impl, count: int, dtype: torch.dtype, op: str, rank: int, size: int) -> int:
    base = torch.arange(count, dtype=torch.int64) % 13
    t = (base + rank).to(dtype)
    impl.bind(t)()
    if op == "sum":
        expected = base * size + size * (size - 1) // 2
    elif op == "min":
        expected = base
    else:
        expected = base + size - 1
    return int((t != expected.to(dtype)).sum())


def _print_crossovers(rows: list[dict], names: list[str]) -> None:
    """The fastest schedule at each size, and the sizes where the winner changes."""
    print("\n# measured fastest schedule by size (crossovers marked)")
    previous = None
    for row in rows:
        best = min(names, key=lambda n: row[n]["p50_us"])
        mark = "  <- crossover" if previous is not None and best != previous else ""
        print(f"{row['bytes']:>10} B: {best[4:]:>12} {row[best]['p50_us']:>10.1f} us "
              f"(planner: {row['ddl']['plan'].split(' ')[0]}){mark}")
        previous = best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--op", default="sum", choices=["sum", "min", "max"])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size (median reported)")
    p.add_argument("--round-seconds", type=float, default=0.02, help="target duration of one timed round")
    p.add_argument("--impls", default="ddl,mpi,gloo", help="comma list of ddl, mpi, gloo")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--schedule", default="auto",
                   help="auto (the planner's choice), a schedule name, or 'all' (one row per schedule)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--link-rate", default="", help="the rate each host's link is shaped to (e.g. 1gbit): adds "
                                                   "the link bound and each row's share of it")
    args = p.parse_args(argv)

    from mpi4py import MPI
    torch.set_num_threads(args.threads)
    mpi_comm = MPI.COMM_WORLD.Dup()
    comm = ddl.init()
    names = args.impls.split(",")
    dist = torch.distributed if "gloo" in names else None
    if dist is not None:
        start_gloo(mpi_comm)
    dtype = _DTYPES[args.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    impls = _impls(comm, mpi_comm, dist, args.op, dtype, names, args.schedule)
    n = comm.size
    hosts = len(set(comm.placement.node_of_rank))
    mem_bound = hosts == 1 and n > 1  # across hosts the link bounds a call long before memory does
    link_bits = parse_rate(args.link_rate) if args.link_rate else 0
    rows = []
    if comm.rank == 0:
        print(f"# ddl_triton collectives: {n} ranks, allreduce, topology {comm.topology.signature}, "
              f"{args.rounds} interleaved rounds, median; algbw/busbw in GB/s; shm/mpi: bytes sent per call, mean over ranks"
              + (f"; {hosts} hosts, links {args.link_rate}: bound = 2(H-1)/H*S on one host's link" if link_bits else ""))
        print(f"{'size(B)':>10} {'count':>9} {'type':>8} {'redop':>5} {'impl':>17} {'time(us)':>10} {'algbw':>7} "
              f"{'busbw':>7} {'#wrong':>6} {'shm B':>10} {'mpi B':>10} {'mpi/impl':>8}"
              + (f" {'bound(us)':>10} {'%bound':>7}" if link_bits else "")
              + (f" {'mem(us)':>9} {'%mem':>6}" if mem_bound else ""))
    for nbytes in _sizes(max(args.min_bytes, elem), args.max_bytes):
        count = nbytes // elem
        buf = (torch.arange(count) % 13).to(dtype)
        # Calibrate iterations on ddl so one round lasts about round_seconds (agreed across ranks).
        for im in impls:
            im.bind(buf)()
        probe = _time_round(impls[0], buf, 3, mpi_comm)
        iters = int(mpi_comm.allreduce(max(1, min(10000, int(args.round_seconds / max(probe, 1e-7)))), op=MPI.MAX))
        timed = impls + (_copy_impls(count, dtype) if mem_bound else [])
        times: dict[str, list[float]] = {im.name: [] for im in timed}
        sent: dict[str, dict[str, int]] = {im.name: {} for im in timed}
        for r in range(args.rounds):
            # A new order each round, the same on every rank (seeded by the round): a peer timed
            # right after another (gloo's threads winding down at 4 ranks on 2 cores) would otherwise
            # always pay for it. A rotation would not do: it keeps who follows whom.
            for im in random.Random(r).sample(timed, len(timed)) if r else timed:
                buf.copy_((torch.arange(count) % 13).to(dtype))
                before = im.comm.transport_bytes if im.comm else {}
                times[im.name].append(_time_round(im, buf, iters, mpi_comm))
                after = im.comm.transport_bytes if im.comm else {}
                for k in after:
                    sent[im.name][k] = sent[im.name].get(k, 0) + after[k]["sent"] - before[k]["sent"]
        row = {"bytes": count * elem, "count": count, "type": args.dtype, "redop": args.op, "iters": iters}
        lines = []
        for im in impls:
            # Use the slowest rank's time per round: a collective is done when its last rank is.
            ts = [float(mpi_comm.allreduce(t, op=MPI.MAX)) for t in times[im.name]]
            wrong = int(mpi_comm.allreduce(_count_wrong(im, count, dtype, args.op, comm.rank, n), op=MPI.SUM))
            med = statistics.median(ts)
            algbw = count * elem / med / 1e9
            busbw = algbw * 2 * (n - 1) / n
            calls = args.rounds * iters
            # Mean over ranks: in a ring across nodes only some ranks' sends cross the node boundary.
            per_call = {k: float(mpi_comm.allreduce(v, op=MPI.SUM)) / n / calls for k, v in sent[im.name].items()}
            row[im.name] = {"p20_us": quantile(ts, 0.2) * 1e6, "p50_us": med * 1e6, "p80_us": quantile(ts, 0.8) * 1e6,
                            "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong, "bytes_sent_per_call": per_call}
            if im.name.startswith("ddl") and im.comm is not None:
                row[im.name]["plan"] = str(im.comm.explain("allreduce", count * elem, dtype))
            lines.append((im.name, med, algbw, busbw, wrong, per_call))
        mpi_time = row["mpi"]["p50_us"] / 1e6 if "mpi" in row else None
        bound = 2 * (hosts - 1) / hosts * count * elem * 8 / link_bits if link_bits and hosts > 1 else None
        if bound is not None:
            row["link_bound_us"] = bound * 1e6
        mem = None
        if mem_bound:
            # Per round, the copy's time less the one-element copy's (its call), then the median.
            copy = statistics.median(float(mpi_comm.allreduce(t - t0, op=MPI.MAX))
                                     for t, t0 in zip(times["copy"], times["copy0"]))
            row["copy_us"] = copy * 1e6
            row["copy_GBps"] = count * elem / copy / 1e9 if copy > 0 else None
            if count * elem >= _MEM_BOUND_MIN_BYTES and copy > 0:
                mem = copy  # read the input once, write the output once
                row["mem_bound_us"] = mem * 1e6
        if comm.rank == 0:
            for name, med, algbw, busbw, wrong, per_call in lines:
                shm_b = f"{per_call['shm']:.0f}" if "shm" in per_call else "-"
                mpi_b = f"{per_call['mpi']:.0f}" if "mpi" in per_call else "-"
                ratio = f"{mpi_time / med:.2f}" if mpi_time else "-"
                share = f" {bound * 1e6:>10.1f} {100 * bound / med:>6.1f}%" if bound is not None else ""
                if mem_bound:
                    share += f" {mem * 1e6:>9.1f} {100 * mem / med:>5.1f}%" if mem is not None else f" {'-':>9} {'-':>6}"
                print(f"{count * elem:>10} {count:>9} {args.dtype:>8} {args.op:>5} {name:>17} {med * 1e6:>10.1f} "
                      f"{algbw:>7.3f} {busbw:>7.3f} {wrong:>6} {shm_b:>10} {mpi_b:>10} {ratio:>8}{share}", flush=True)
            if mem is not None:
                print(f"{'':>10} {'':>9} {'':>8} {'':>5} {'copy':>17} {row['copy_us']:>10.1f} "
                      f"{row['copy_GBps'] or 0:>7.3f} (each rank copies S bytes at once, less a 1-element copy: "
                      "the memory yardstick)", flush=True)
        rows.append(row)
    if comm.rank == 0 and args.schedule == "all":
        _print_crossovers(rows, [im.name for im in impls if im.name.startswith("ddl:")])
    if comm.rank == 0 and args.json:
        meta = {"ranks": n, "collective": "allreduce", "machine": platform.platform(), "cpu_count": os.cpu_count(),
                "python": sys.version.split()[0], "torch": torch.__version__, "mpi": MPI.Get_library_version().strip(),
                "ddl_triton": ddl.__version__, "options": vars(comm.options) if hasattr(comm.options, "__dict__") else {},
                "args": vars(args), "plan": {str(r["bytes"]): comm.explain("allreduce", r["bytes"], dtype).schedule
                                             for r in rows}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    if dist is not None:
        dist.destroy_process_group()
    ddl.finalize()
    return _verdict(rows, [im.name for im in impls], comm.rank == 0)


def _verdict(rows: list[dict], names: list[str], speak: bool) -> int:
    """The exit status: 1 if any implementation counted a wrong element at any size (``speak``:
    print which), else 0. Every rank returns the same: ``wrong`` is summed over the ranks."""
    bad = [f"{name} at {row['bytes']} B: {row[name]['wrong']} wrong elements"
           for row in rows for name in names if row.get(name, {}).get("wrong", 0)]
    if bad and speak:
        print("WRONG RESULTS (exit 1): " + "; ".join(bad), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
