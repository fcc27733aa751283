"""Multi-rank test body, run under ``mpiexec -n N python tests/multirank/multirank_worker.py [--quick]``.

One launch runs many cases (a launch costs ~2 s). Every rank runs the same
sequence of collectives whatever the outcome of a check, so a wrong result is
reported instead of desynchronising the ranks into a hang. Data is
integer-valued, so every reduction order gives the exact answer and results
are compared with ``==``; each result is also checked to be bitwise identical
on every rank. Exits 1 (printing every failed case) if anything was wrong.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import ddl_triton as ddl
from support.checker import Checker

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
OPS = ["sum", "avg", "min", "max"]

# The case lists, shared by the run functions and planned_checks (the count the test expects).
SUITE_SIZES = [0, 1, 2, 3, 7, 13, 127, 1000, 4099, 65537]
QUICK_SIZES = [0, 1, 7, 131, 1031]
BIG_SIZES = [300007]  # prime, larger than a chunk: many pipelined chunks, uneven blocks
BCAST_SIZES = [0, 1, 1000, 70001]
A2A_SIZES = [0, 1, 7, 3001]
TINY_ALLREDUCE_SIZES = [0, 1, 63, 64, 65, 1031]
TINY_SIZES = [1, 97]
SUBGROUP_SIZES = [0, 5, 1000, 70001]
MATRIX_SIZES = {"allreduce": [0, 1, 7, 131, 1031], "reduce_scatter": [1, 29, 30, 3], "all_gather": [1, 29],
                "broadcast": [1, 300]}
NATIVE_SIZES = [0, 1, 7, 1031]
FUZZ_CASES = 200
# The quick cases again through the environment, as a user forces a schedule or a transport: mode
# "quick:NAME" sets these DDL_* variables, makes a communicator that reads them, and runs the quick
# cases on it (test_multirank.py runs them in its 3-rank shared launch).
ENV_VARIANTS = {"ring": {"DDL_SCHEDULE": "ring", "DDL_CHUNK_BYTES": "512"},
                "one_shot": {"DDL_SCHEDULE": "one_shot", "DDL_CHUNK_BYTES": "512"},
                "mpi": {"DDL_TRANSPORT": "mpi", "DDL_CHUNK_BYTES": "1024"},
                # The Triton kernels perform every reduction step (the launch sets TRITON_INTERPRET=1).
                "triton": {"DDL_KERNELS": "triton", "DDL_CHUNK_BYTES": "2048"}}
A2A_DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int64)
BCAST_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
RANDOM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
RANDOM_COUNTS = (5, 4097, 70001)
SMALL_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
SMALL_ENTRIES = ("first", "repeat", "async", "strided", "mixed")
NONCONTIGUOUS_DTYPES = (torch.float32, torch.bfloat16, torch.int32)


def rank_data(count: int, rank: int, size: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Small integers, distinct per rank and element; multiples of ``size`` for avg so the mean is exact."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + 3 * rank) % 23 - 11
    if op == "avg":
        base = base * size
    return base.to(dtype)


def expected_reduction(count: int, size: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    stack = torch.stack([rank_data(count, q, size, torch.int64, op) for q in range(size)]) if count else \
        torch.zeros((size, 0), dtype=torch.int64)
    if op == "sum":
        r = stack.sum(0)
    elif op == "avg":
        r = stack.sum(0) // size  # exact: every value is a multiple of size
    elif op == "min":
        r = stack.min(0).values
    else:
        r = stack.max(0).values
    return r.to(dtype)


def valid_op(op: str, dtype: torch.dtype) -> bool:
    return not (op == "avg" and not dtype.is_floating_point)


def reduction_cases(sizes, covering: bool = False):
    """(dtype, op, count): every dtype, each op valid for it, each count of ``sizes``.

    ``covering``: every (dtype, count) pair once, its op turning with the pair's position, so
    that every dtype still meets each op valid for it once ``sizes`` has as many counts as there
    are ops (and every op meets every count). A pairwise cover, not the whole cross: the
    schedule matrix runs it on each (schedule, topology) pair (35 at 4 ranks), and the whole cross
    runs on the world communicator of every world size (``run_suite``)."""
    for j, dtype in enumerate(DTYPES):
        ops = [op for op in OPS if valid_op(op, dtype)]
        for i, count in enumerate(sizes):
            if covering:
                yield dtype, ops[(i + j) % len(ops)], count
            else:
                for op in ops:
                    yield dtype, op, count


def run_allreduce(ck: Checker, comm, sizes, tag: str, covering: bool = False) -> None:
    n, r = comm.size, comm.rank
    for dtype, op, count in reduction_cases(sizes, covering):
        t = rank_data(count, r, n, dtype, op)
        out = comm.allreduce(t, op=op)
        what = f"{tag} allreduce {op} {dtype} n={count}"
        ck.equal(what, t, expected_reduction(count, n, dtype, op))
        ck.true(what, out is t, "did not return its tensor")
        ck.identical(what, t)


def run_reduce_scatter(ck: Checker, comm, sizes, tag: str, covering: bool = False) -> None:
    n, r = comm.size, comm.rank
    for dtype, op, m in reduction_cases(sizes, covering):
        inp = rank_data(n * m, r, n, dtype, op)
        out = torch.full((m,), 99, dtype=dtype)  # poisoned: unwritten elements show
        comm.reduce_scatter(out, inp, op=op)
        full = expected_reduction(n * m, n, dtype, op)
        ck.equal(f"{tag} reduce_scatter {op} {dtype} m={m}", out, full[r * m:(r + 1) * m])
        ck.equal(f"{tag} reduce_scatter keeps input {dtype} m={m}", inp, rank_data(n * m, r, n, dtype, op))


def run_all_gather(ck: Checker, comm, sizes, tag: str) -> None:
    n, r = comm.size, comm.rank
    for dtype in DTYPES:
        for m in sizes:
            inp = rank_data(m, r, n, dtype, "sum")
            out = torch.full((n * m,), 99, dtype=dtype)
            comm.all_gather(out, inp)
            exp = torch.cat([rank_data(m, q, n, dtype, "sum") for q in range(n)]) if m else out.new_empty(0)
            ck.equal(f"{tag} all_gather {dtype} m={m}", out, exp)
            ck.identical(f"{tag} all_gather {dtype} m={m}", out)


def run_all_to_all(ck: Checker, comm, sizes, tag: str) -> None:
    n, r = comm.size, comm.rank
    for dtype in A2A_DTYPES:
        for m in sizes:
            # Element i of block q on rank r encodes (r, q, i), so misrouted data shows.
            inp = (torch.arange(n * m) + 1000 * r).to(dtype) if m else torch.empty(0, dtype=dtype)
            out = torch.full((n * m,), 99, dtype=dtype)
            comm.all_to_all(out, inp)
            exp = torch.cat([(torch.arange(r * m, (r + 1) * m) + 1000 * q) for q in range(n)]).to(dtype) if m \
                else out.new_empty(0)
            ck.equal(f"{tag} all_to_all {dtype} m={m}", out, exp)


def run_broadcast(ck: Checker, comm, sizes, tag: str) -> None:
    n, r = comm.size, comm.rank
    for dtype in BCAST_DTYPES:
        for root in range(n):
            for count in sizes:
                t = rank_data(count, r, n, dtype, "sum") if r == root else torch.full((count,), 77, dtype=dtype)
                comm.broadcast(t, root=root)
                ck.equal(f"{tag} broadcast root={root} {dtype} n={count}", t, rank_data(count, root, n, dtype, "sum"))


def run_random_floats(ck: Checker, comm, tag: str) -> None:
    """Non-integer data: ranks must still agree bit for bit, and stay within the dtype's rounding."""
    n, r = comm.size, comm.rank
    for dtype in RANDOM_DTYPES:
        for count in RANDOM_COUNTS:
            g = torch.Generator().manual_seed(1000 + r)
            x = torch.randn(count, generator=g, dtype=torch.float64)
            t = x.to(dtype)
            ref = torch.zeros(count, dtype=torch.float64)
            for q in range(n):
                ref += torch.randn(count, generator=torch.Generator().manual_seed(1000 + q), dtype=torch.float64).to(dtype).double()
            comm.allreduce(t, op="sum")
            ck.identical(f"{tag} random {dtype} n={count}", t)
            # fp32 accumulation then one rounding: within one output ulp plus the fp32 sum error.
            eps = torch.finfo(dtype).eps
            bound = ref.abs() * eps + n * n * torch.finfo(torch.float32).eps * ref.abs().clamp(min=1) * 4 + 1e-30
            err = (t.double() - ref).abs()
            ck.true(f"{tag} random {dtype} n={count}", bool((err <= bound).all()),
                    f"max error {err.max().item():.3g} over bound")


def run_small_path_is_one_shot(ck: Checker, world, tag: str, topology: str = "") -> None:
    """The small-message path (the shm lane: ddl_triton/runtime/lanes/small_allreduce.py; or the call lane,
    where the ranks span hosts: small_allreduce_two_sided.py) gives the one_shot schedule's bits on
    random (non-integer) data, for every dtype and op it serves, up to its size limit."""
    placed = {"topology": topology} if topology else {}
    fast = ddl.init(world.Dup(), **placed)
    general = ddl.init(world.Dup(), schedule="one_shot", **placed)
    general._runner.small = None  # the same schedule through the executor
    if fast._runner.small is None:  # no small path here (one rank): nothing to compare
        fast.close()
        general.close()
        return
    r = fast.rank
    for dtype in SMALL_DTYPES:
        limit = fast._runner.small.limit // dtype.itemsize
        for count in (1, 2, 3, 255, limit):
            g = torch.Generator().manual_seed(7000 + 31 * r + count)
            x = torch.randn(count, generator=g, dtype=torch.float64) * 1e3
            x = x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)
            for op in ("sum", "min", "max") + (("avg",) if dtype.is_floating_point else ()):
                want = x.clone()
                general.allreduce(want, op=op)
                # Every entry to the path: the first call of a shape (the general entry), a repeat (the
                # synchronous fast entry), async, a strided view, and ranks mixing entries in one call.
                for entry in SMALL_ENTRIES:
                    a = _small_path_entry(fast, x, op, entry if entry != "mixed" else
                                          ("repeat", "async", "strided")[r % 3])
                    ck.true(f"{tag} small path ({entry}) {op} {dtype} n={count}",
                            torch.equal(a.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)),
                            "bits differ from one_shot")
                    ck.identical(f"{tag} small path ({entry}) {op} {dtype} n={count}", a)
    if hasattr(fast._runner.small, "serves_broadcast"):
        check_small_broadcast(ck, fast, tag)
    fast.close()
    general.close()


def check_small_broadcast(ck: Checker, comm, tag: str) -> None:
    """Across a call lane, small broadcasts ride in it: the root's bits on every rank, for every
    dtype (16-bit floats as their bits), synchronous, async and strided, and no executor message."""
    r, n = comm.rank, comm.size
    sent_before = list(comm._runner.executor.next_msg)
    for dtype in DTYPES:
        limit = comm._runner.small.limit // dtype.itemsize
        for count in (1, 3, limit):
            for root in range(n):
                g = torch.Generator().manual_seed(9000 + 31 * r + count)
                x = (torch.randn(count, generator=g, dtype=torch.float64) * 1e3).to(dtype)
                g = torch.Generator().manual_seed(9000 + 31 * root + count)
                want = (torch.randn(count, generator=g, dtype=torch.float64) * 1e3).to(dtype)
                how = ("sync", "async", "strided")[(root + count) % 3]
                gaps_clean = True
                if how == "strided":
                    wide = torch.zeros(2 * count, dtype=dtype)
                    wide[::2] = x
                    comm.broadcast(wide[::2], root=root)
                    got = wide[::2]
                    gaps_clean = bool((wide[1::2] == 0).all())
                else:
                    got = x
                    work = comm.broadcast(x, root=root, async_op=how == "async")
                    if how == "async":
                        work.wait()
                what = f"{tag} small broadcast ({how}) {dtype} n={count} root {root}"
                bits = torch.empty_like(want).copy_(got)  # stride 1 (one strided element counts as contiguous)
                # One check per case whatever its entry, so that planned_checks need not know the lane's limit.
                ck.true(what, gaps_clean and torch.equal(bits.view(torch.uint8), want.view(torch.uint8)),
                        "not the root's bits" if gaps_clean else "wrote outside the view")
    ck.true(f"{tag} small broadcasts took the call lane", comm._runner.executor.next_msg == sent_before,
            f"executor messages {sent_before} -> {comm._runner.executor.next_msg}")


def _small_path_entry(comm, x: torch.Tensor, op: str, entry: str) -> torch.Tensor:
    """Allreduce a copy of ``x`` through one entry of the communicator; returns the result."""
    if entry == "async":
        a = x.clone()
        comm.allreduce(a, op=op, async_op=True).wait()
        return a
    if entry == "strided":
        holder = torch.zeros(x.numel(), 2, dtype=x.dtype)
        holder[:, 1] = x
        comm.allreduce(holder[:, 1], op=op)
        return torch.empty(x.numel(), dtype=x.dtype).copy_(holder[:, 1])
    a = x.clone()
    comm.allreduce(a, op=op)
    return a


def run_noncontiguous(ck: Checker, comm, tag: str) -> None:
    n, r = comm.size, comm.rank
    for dtype in NONCONTIGUOUS_DTYPES:
        base = rank_data(6 * 37, r, n, dtype, "sum").reshape(6, 37)
        t = base.t()  # strided view
        comm.allreduce(t, op="sum")
        ck.equal(f"{tag} allreduce transposed {dtype}", t,
                 expected_reduction(6 * 37, n, dtype, "sum").reshape(6, 37).t())
        ck.equal(f"{tag} allreduce transposed writes through {dtype}", base,
                 expected_reduction(6 * 37, n, dtype, "sum").reshape(6, 37))
        col = rank_data(40 * 3, r, n, dtype, "sum").reshape(40, 3)
        out = torch.full((n * 40, 3), 99, dtype=dtype)[:, 1]  # strided output column
        comm.all_gather(out, col[:, 2])
        exp = torch.cat([rank_data(120, q, n, dtype, "sum").reshape(40, 3)[:, 2] for q in range(n)])
        ck.equal(f"{tag} all_gather strided {dtype}", out, exp)


def run_async(ck: Checker, comm, tag: str) -> None:
    n, r = comm.size, comm.rank
    tensors = [rank_data(c, r, n, torch.float32, "sum") for c in (1, 1000, 50000, 3, 300001, 17)]
    works = [comm.allreduce(t, op="sum", async_op=True) for t in tensors]
    extra = rank_data(999, r, n, torch.int64, "max")
    comm.allreduce(extra, op="max")  # a synchronous call queues behind the async ones
    ck.equal(f"{tag} sync after async", extra, expected_reduction(999, n, torch.int64, "max"))
    for w, t, c in zip(reversed(works), reversed(tensors), reversed((1, 1000, 50000, 3, 300001, 17))):
        res = w.wait()
        ck.equal(f"{tag} async allreduce n={c}", res, expected_reduction(c, n, torch.float32, "sum"))
        ck.equal(f"{tag} async result is the tensor n={c}", t, res)
    # Mixed collectives in flight at once complete in issue order.
    ag_out = torch.empty(n * 5, dtype=torch.int32)
    w1 = comm.all_gather(ag_out, torch.full((5,), r, dtype=torch.int32), async_op=True)
    b = torch.full((11,), r, dtype=torch.float64)
    w2 = comm.broadcast(b, root=n - 1, async_op=True)
    w3 = comm.barrier(async_op=True)
    w3.wait()
    ck.true(tag, w1.is_completed() and w2.is_completed(), "barrier completed before earlier async collectives")
    ck.equal(f"{tag} async all_gather", w1.wait(), torch.arange(n, dtype=torch.int32).repeat_interleave(5))
    ck.equal(f"{tag} async broadcast", b, torch.full((11,), n - 1, dtype=torch.float64))


def run_reduce_op_enum(ck: Checker, comm, tag: str) -> None:
    import torch.distributed as dist
    n, r = comm.size, comm.rank
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"),
                     (dist.ReduceOp.AVG, "avg")):
        t = rank_data(33, r, n, torch.float32, name)
        comm.allreduce(t, op=op)
        ck.equal(f"{tag} ReduceOp {name}", t, expected_reduction(33, n, torch.float32, name))


def run_bad_input(ck: Checker, comm, tag: str) -> None:
    """Refused on every rank before any communication, so the ranks stay in step; each error names
    the rank that raised it."""
    n = comm.size

    def refused(what: str, exc: type, fn) -> None:
        ck.raises(f"{tag} {what}", exc, fn, must_mention=f"rank {ck.rank}")

    refused("reduce_scatter size mismatch", ValueError,
            lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1)))
    refused("all_gather size mismatch", ValueError,
            lambda: comm.all_gather(torch.empty(2 * n + 1), torch.empty(2)))
    refused("avg on integers", ValueError, lambda: comm.allreduce(torch.ones(4, dtype=torch.int32), op="avg"))
    refused("unknown op", ValueError, lambda: comm.allreduce(torch.ones(4), op="prod"))
    refused("unsupported dtype", TypeError, lambda: comm.allreduce(torch.ones(4, dtype=torch.complex64)))
    refused("broadcast root out of range", ValueError, lambda: comm.broadcast(torch.ones(4), root=n))
    refused("expanded tensor", ValueError, lambda: comm.allreduce(torch.ones(1).expand(8)))
    refused("dtype pair mismatch", TypeError,
            lambda: comm.all_gather(torch.empty(2 * n, dtype=torch.float64), torch.empty(2)))
    refused("tensor on a non-CPU device", ValueError, lambda: comm.allreduce(torch.ones(4, device="meta")))
    refused("tensor that requires grad", ValueError,
            lambda: comm.allreduce(torch.ones(4, requires_grad=True)))
    refused("not a tensor", TypeError, lambda: comm.allreduce([1.0, 2.0]))
    refused("reduce_scatter output dtype differs", TypeError,
            lambda: comm.reduce_scatter(torch.empty(2, dtype=torch.int32), torch.empty(2 * n)))
    refused("all_to_all size mismatch", ValueError,
            lambda: comm.all_to_all(torch.empty(3 * n), torch.empty(3 * n + 1)))
    refused("overlapping out/inp", ValueError,
            lambda: (lambda buf: comm.all_gather(buf, buf[:4]))(torch.empty(4 * n)))


TOPOLOGIES = {1: ["1"], 2: ["2", "1x2", "2x1"], 3: ["3", "3x1", "1x3"], 4: ["4", "2x2", "1x4", "4x1", "2x1x2"]}


def run_matrix(ck: Checker, world) -> None:
    """Every schedule, forced, on every topology of this world size, over the exact cases.

    Collectives a forced schedule does not implement fall back to the planner's choice,
    so every schedule is also exercised beside the others in one communicator. The reductions
    take a pairwise cover of dtype x op x count (``reduction_cases``): the schedule, not the
    kernel, is what varies here.
    """
    from ddl_triton import schedules
    n = world.Get_size()
    for topo in TOPOLOGIES[n]:
        for name in schedules.names():
            # 512-byte chunks: most cases span many chunks and reuse the two slots constantly.
            comm = ddl.init(world.Dup(), schedule=name, topology=topo, chunk_bytes=512, pipeline_depth=2)
            tag = f"{name}@{topo}"
            run_allreduce(ck, comm, MATRIX_SIZES["allreduce"], tag, covering=True)
            run_reduce_scatter(ck, comm, MATRIX_SIZES["reduce_scatter"], tag, covering=True)
            run_all_gather(ck, comm, MATRIX_SIZES["all_gather"], tag)
            run_broadcast(ck, comm, MATRIX_SIZES["broadcast"], tag)
            comm.close()
    if n == 4:
        check_hierarchical_bytes(ck, world)
        check_native_on_and_off_the_engines(ck, world)
        # Emulated hosts of 2 ranks: the call lane carries small allreduces to host mates too.
        run_small_path_is_one_shot(ck, world, "2x2", topology="2x2")


def run_fuzz(ck: Checker, world, seed: int, cases: int) -> None:
    """Seeded random cases, identical on every rank: schedule x topology x dtype x op x size x
    async mixing (up to 3 in flight), each result checked exactly against its reference."""
    import random
    from ddl_triton import schedules
    n, r = world.Get_size(), world.Get_rank()
    rng = random.Random(seed)
    pool = {}
    for _ in range(6):  # a few communicators, each with a forced schedule on an emulated topology
        key = (rng.choice(schedules.names()), rng.choice(TOPOLOGIES[n]), rng.choice([256, 1024, 1 << 20]))
        if key not in pool:
            pool[key] = ddl.init(world.Dup(), schedule=key[0], topology=key[1], chunk_bytes=key[2])
    keys = sorted(pool)
    pending = []
    for i in range(cases):
        key = rng.choice(keys)
        comm = pool[key]
        dtype = rng.choice(DTYPES)
        op = rng.choice([o for o in OPS if valid_op(o, dtype)])
        count = rng.choice([0, 1, 2, 3, 5, 17, 129, 1000, 4099, 20011])
        async_op = rng.random() < 0.4
        kind = rng.choice(["allreduce", "allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"])
        tag = f"fuzz#{i} {kind} {op} {dtype} n={count} on {key}"
        if kind == "allreduce":
            t = rank_data(count, r, n, dtype, op)
            w = comm.allreduce(t, op=op, async_op=async_op)
            pending.append((w, tag, t, expected_reduction(count, n, dtype, op)))
        elif kind == "reduce_scatter":
            out = torch.full((count,), 99, dtype=dtype)
            w = comm.reduce_scatter(out, rank_data(n * count, r, n, dtype, op), op=op, async_op=async_op)
            pending.append((w, tag, out, expected_reduction(n * count, n, dtype, op)[r * count:(r + 1) * count]))
        elif kind == "all_gather":
            out = torch.full((n * count,), 99, dtype=dtype)
            w = comm.all_gather(out, rank_data(count, r, n, dtype, "sum"), async_op=async_op)
            exp = torch.cat([rank_data(count, q, n, dtype, "sum") for q in range(n)]) if count else out.new_empty(0)
            pending.append((w, tag, out, exp))
        elif kind == "broadcast":
            root = rng.randrange(n)
            t = rank_data(count, r, n, dtype, "sum")
            w = comm.broadcast(t, root=root, async_op=async_op)
            pending.append((w, tag, t, rank_data(count, root, n, dtype, "sum")))
        else:
            inp = (torch.arange(n * count) % 101 + 3 * r).to(dtype)
            out = torch.full((n * count,), 99, dtype=dtype)
            w = comm.all_to_all(out, inp, async_op=async_op)
            exp = torch.cat([(torch.arange(r * count, (r + 1) * count) % 101 + 3 * q) for q in range(n)]).to(dtype) \
                if count else out.new_empty(0)
            pending.append((w, tag, out, exp))
        if not async_op or len(pending) >= 3:
            for w_, tag_, got, exp in pending:
                if w_ is not None and hasattr(w_, "wait"):
                    w_.wait()
                ck.equal(tag_, got, exp)
            pending = []
    for w_, tag_, got, exp in pending:
        if hasattr(w_, "wait"):
            w_.wait()
        ck.equal(tag_, got, exp)
    for comm in pool.values():
        comm.close()


def check_native_on_and_off_the_engines(ck: Checker, world) -> None:
    """hierarchical_native on 2x2: its group steps run on MPI's own allreduce, putting
    hierarchical's bytes on each link; under an emulated link (which MPI's allreduce would not
    pace) every rank runs their p2p stand-in instead, with the same exact results."""
    from ddl_triton.schedules.native import NAME
    count = 4 * 4096 + 3
    sent = {}
    for emulated in ("", "mpi:bw=2GB/s,lat=0us"):
        comm = ddl.init(world.Dup(), schedule=NAME, topology="2x2", chunk_bytes=4096, link_emulation=emulated)
        ck.true(f"{NAME} engines {emulated or 'on'}", comm._runner.executor.group_engines == (not emulated),
                f"group engines {comm._runner.executor.group_engines}")
        run_allreduce(ck, comm, NATIVE_SIZES, f"{NAME}@2x2 {emulated or 'engines'}", covering=True)
        t = torch.ones(count)
        before = comm.transport_bytes
        comm.allreduce(t)
        after = comm.transport_bytes
        sent[emulated] = {k: after[k]["sent"] - before[k]["sent"] for k in after}
        ck.equal(f"{NAME} 2x2 {emulated or 'engines'} sum", t, torch.full((count,), 4.0))
        comm.close()
    block = 4 * (count // 2 + (comm.rank % 2 == 0) * (count % 2))  # this rank's half, as blocks() cuts it
    ck.true(f"{NAME} 2x2 MPI bytes", sent[""]["mpi"] == block, f"{sent[''] }, block {block} bytes")
    ck.true(f"{NAME} 2x2 bytes the same off the engines", sent[""] == sent["mpi:bw=2GB/s,lat=0us"], str(sent))


def check_hierarchical_bytes(ck: Checker, world) -> None:
    """On 2x2, hierarchical sends 1/X of the intra-node volume over MPI, as its schedule says."""
    from ddl_triton import schedules
    comm = ddl.init(world.Dup(), schedule="hierarchical", topology="2x2", chunk_bytes=4096)
    count = 4 * 4096
    t = torch.ones(count)
    before = comm.transport_bytes
    comm.allreduce(t)
    after = comm.transport_bytes
    sent = {k: after[k]["sent"] - before[k]["sent"] for k in after}
    plan = comm.explain("allreduce", count * 4, torch.float32)
    sched = schedules.build("hierarchical", "allreduce", 4, count, chunk_elems=plan.chunk_elems, grid=plan.grid,
                            algos=plan.algos)
    node = comm.rank // 2
    expect = {"shm": 0, "mpi": 0}
    for st in sched.steps[comm.rank]:
        for p in st.send:
            expect["shm" if p // 2 == node else "mpi"] += st.count * 4
    ck.true("hierarchical 2x2 bytes", sent == expect, f"{sent}, schedule says {expect}")
    ck.true("hierarchical 2x2 MPI bytes", expect["mpi"] * 2 == expect["shm"],
            f"{expect['mpi']} are not 1/X of the intra-node {expect['shm']}")
    ck.equal("hierarchical 2x2 sum", t, torch.full((count,), 4.0))
    comm.close()


def planned_checks(mode: str, n: int) -> int:
    """The number of checks one rank of an ``n``-rank world on one host runs in ``mode`` ("suite",
    "quick", "matrix" or "fuzz"), counted from the case lists above: a section that silently ran
    fewer cases, or none, makes the report's count differ (tests/multirank/test_multirank.py)."""
    from ddl_triton import schedules

    def allreduce(sizes, covering=False):
        return 3 * len(list(reduction_cases(sizes, covering)))

    def reduce_scatter(sizes, covering=False):
        return 2 * len(list(reduction_cases(sizes, covering)))

    def all_gather(sizes):
        return 2 * len(DTYPES) * len(sizes)

    def broadcast(sizes):
        return len(BCAST_DTYPES) * n * len(sizes)

    def all_to_all(sizes):
        return len(A2A_DTYPES) * len(sizes)

    def small_path(call_lane: bool):
        if n == 1:
            return 0  # one rank has no small path
        ops = sum(len(OPS) - (not dtype.is_floating_point) for dtype in SMALL_DTYPES)  # avg on floats only
        return (2 * len(SMALL_ENTRIES) * 5 * ops  # five counts, two checks per entry
                + (len(DTYPES) * 3 * n + 1 if call_lane else 0))  # the lane's broadcasts, then its byte check

    if mode == "fuzz":
        return FUZZ_CASES
    if mode == "matrix":
        per_pair = (allreduce(MATRIX_SIZES["allreduce"], True) + reduce_scatter(MATRIX_SIZES["reduce_scatter"], True)
                    + all_gather(MATRIX_SIZES["all_gather"]) + broadcast(MATRIX_SIZES["broadcast"]))
        total = per_pair * len(TOPOLOGIES[n]) * len(schedules.names())
        if n == 4:  # check_hierarchical_bytes, check_native_on_and_off_the_engines, the 2x2 small path
            total += 3 + 2 * (1 + allreduce(NATIVE_SIZES, True) + 1) + 2 + small_path(call_lane=True)
        return total
    sizes = QUICK_SIZES if mode == "quick" else SUITE_SIZES
    total = (2 + allreduce(sizes + ([] if mode == "quick" else BIG_SIZES)) + reduce_scatter(sizes)
             + all_gather(sizes) + broadcast(BCAST_SIZES) + all_to_all(A2A_SIZES))
    if mode == "suite":
        random_floats = 2 * len(RANDOM_DTYPES) * len(RANDOM_COUNTS)
        noncontiguous = 3 * len(NONCONTIGUOUS_DTYPES)
        in_flight = 1 + 2 * 6 + 3  # run_async: the sync call, six async results, the mixed collectives
        enum_ops, bad_inputs = 4, 14  # run_reduce_op_enum's ops, run_bad_input's refusals
        tiny = (allreduce(TINY_ALLREDUCE_SIZES) + reduce_scatter(TINY_SIZES) + all_gather(TINY_SIZES)
                + broadcast(TINY_SIZES) + all_to_all(TINY_SIZES))
        total += (random_floats + small_path(call_lane=False) + noncontiguous + in_flight + enum_ops + bad_inputs
                  + tiny + allreduce(SUBGROUP_SIZES))
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer sizes (used for the extra transport/kernel runs)")
    p.add_argument("--matrix", action="store_true", help="every schedule on every topology of this world size")
    p.add_argument("--fuzz", type=int, default=None, metavar="SEED", help="seeded random cases")
    p.add_argument("--modes", default=None, metavar="MODE,MODE",
                   help="several of suite, quick, matrix and fuzz (with --fuzz SEED) in one launch, in order, "
                        "each with its own report")
    args = p.parse_args()
    from mpi4py import MPI  # here, not at the top: the test imports this module for planned_checks
    world = MPI.COMM_WORLD
    modes = args.modes.split(",") if args.modes else [
        "matrix" if args.matrix else "fuzz" if args.fuzz is not None else "quick" if args.quick else "suite"]
    unknown = [m for m in modes if m not in ("suite", "quick", "matrix", "fuzz")
               and m.removeprefix("quick:") not in ENV_VARIANTS]
    if unknown or ("fuzz" in modes and args.fuzz is None):
        p.error(f"--modes: {unknown or 'fuzz without --fuzz SEED'}: the modes are suite, quick, matrix and fuzz")
    status = 0
    # One report per mode, each with its own checker: a test reads its mode's report by heading,
    # so one launch serves every test of a world size (the test IDs, and every check, kept).
    for i, mode in enumerate(modes):
        ck = Checker(world)

        def body(mode=mode, last=i == len(modes) - 1) -> None:
            if mode == "matrix":
                run_matrix(ck, world)
            elif mode == "fuzz":
                run_fuzz(ck, world, args.fuzz, FUZZ_CASES)
            elif mode.startswith("quick:"):
                run_quick_through_environment(ck, world, ENV_VARIANTS[mode.removeprefix("quick:")])
            else:
                run_suite(ck, world, mode == "quick")
            if last:
                ddl.finalize()

        ck.run(body)
        status |= ck.report(f"multirank_worker: {world.Get_size()} ranks, {mode}")
    return status


def run_quick_through_environment(ck: Checker, world, env: dict[str, str]) -> None:
    """The quick cases on a communicator made while ``env``'s DDL_* variables are set (then
    restored): its options must show them, and every case is exact. The checks of mode "quick"
    one for one: "the environment reached the options" stands for "init() is idempotent"."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        comm = ddl.init(world.Dup())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    o = comm.requested_options  # as given: a tuning table may change the chunk in force
    wanted = {"DDL_SCHEDULE": ("schedule", str), "DDL_TRANSPORT": ("transport", str), "DDL_CHUNK_BYTES": ("chunk_bytes", int),
              "DDL_KERNELS": ("kernels", str)}
    got = {k: getattr(o, wanted[k][0]) for k in env}
    ck.true("the environment reached the options", got == {k: wanted[k][1](v) for k, v in env.items()}, str(got))
    world.Barrier()
    left = [e for e in os.listdir("/dev/shm") if e.startswith("ddl_triton-")]
    ck.true("shared-memory segments visible after init", not left, str(left))
    run_every_collective(ck, comm, QUICK_SIZES, QUICK_SIZES, BCAST_SIZES, A2A_SIZES, "env")
    comm.close()


def run_every_collective(ck: Checker, comm, allreduce_sizes, sizes, bcast_sizes, a2a_sizes, tag: str) -> None:
    """The five collectives' exact cases on ``comm``: allreduce, reduce_scatter, all_gather, broadcast, all_to_all."""
    run_allreduce(ck, comm, allreduce_sizes, tag)
    run_reduce_scatter(ck, comm, sizes, tag)
    run_all_gather(ck, comm, sizes, tag)
    run_broadcast(ck, comm, bcast_sizes, tag)
    run_all_to_all(ck, comm, a2a_sizes, tag)


def run_suite(ck: Checker, world, quick: bool) -> None:
    """The exact cases on the world communicator, plus tiny chunks and a sub-group."""
    sizes = QUICK_SIZES if quick else SUITE_SIZES
    comm = ddl.init()
    ck.true("init()", ddl.init() is comm, "not idempotent")
    world.Barrier()
    left = [e for e in os.listdir("/dev/shm") if e.startswith("ddl_triton-")]
    # segments are unlinked inside init, once every peer has mapped them
    ck.true("shared-memory segments visible after init", not left, str(left))
    run_every_collective(ck, comm, sizes + ([] if quick else BIG_SIZES), sizes, BCAST_SIZES, A2A_SIZES, "world")
    if not quick:
        run_random_floats(ck, comm, "world")
        run_small_path_is_one_shot(ck, world, "world")
        run_noncontiguous(ck, comm, "world")
        run_async(ck, comm, "world")
        run_reduce_op_enum(ck, comm, "world")
        run_bad_input(ck, comm, "world")
        # Tiny chunks and the shallowest pipeline: many chunks, slots reused constantly.
        tiny = ddl.init(world.Dup(), chunk_bytes=256, pipeline_depth=2)
        run_every_collective(ck, tiny, TINY_ALLREDUCE_SIZES, TINY_SIZES, TINY_SIZES, TINY_SIZES, "tiny-chunks")
        tiny.close()
        # A sub-group: even and odd ranks form separate communicators.
        sub_mpi = world.Split(world.Get_rank() % 2, world.Get_rank())
        sub = ddl.init(sub_mpi)
        ck.group = sub_mpi
        run_allreduce(ck, sub, SUBGROUP_SIZES, f"subgroup{world.Get_rank() % 2}")
        ck.group = world
        sub.close()
        sub_mpi.Free()


if __name__ == "__main__":
    sys.exit(main())
