"""NumPy and JAX arrays through the real transports (tests/multirank/test_arrays_across_ranks.py runs it on 3 ranks).

Two communicators: the world's (shm between the ranks, the small-message path and the
synchronous fast entry for small allreduces) and one over MPI (``transport="mpi"``: the call
lane and the executor over MPI). On shm every collective on numpy and JAX arrays of every
supported dtype and of sizes 0, 1, primes and a multi-chunk prime (over MPI three dtypes and
sizes, MPI_DTYPES and MPI_SIZES) must be exact (integer-valued
data), bitwise the torch path's on the same data, and bitwise identical on every rank; numpy
results come back in place (the same object, also on the fast entry's second call of a shape),
JAX results as new JAX arrays, the caller's array untouched; async calls hand the array back
from ``wait()``. Last on each communicator (a mismatch poisons it): arrays whose shape (shm) or
dtype (MPI) differs across ranks raise CollectiveMismatch on every rank, within seconds.
Prints one report (tests/support/report.py) gathered on rank 0.
"""
from __future__ import annotations

import time

import numpy as np
import torch

import ddl_triton as ddl
from ddl_triton.errors import CollectiveMismatch
from support.checker import Checker

# JAX (and ml_dtypes) and MPI are imported by main: test_arrays_across_ranks.py imports this module for
# planned_checks, and importing mpi4py.MPI there would start MPI in the test process.
jax = jnp = ml_dtypes = None

SIZES = (0, 1, 7, 13, 4099)   # 0, 1, primes (none divisible by 2 or 3); 4099 x 8 B spans several shm chunks
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
COLLECTIVES = ("allreduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all")
# Over MPI, a third of the matrix (the adapter does not depend on the transport; the shm run covers
# every dtype and size): a 16-bit, a 32-bit and a 64-bit dtype; empty, prime, multi-chunk.
MPI_DTYPES, MPI_SIZES = ("float32", "bfloat16", "int64"), (0, 13, 4099)
ASYNC_SIZE = 13
MISMATCH_LIMIT_S = 10.0  # well inside DDL_TIMEOUT: the call check tells, no wait runs out


def values(rank: int, numel: int) -> np.ndarray:
    """Small integers: sums over 4 ranks stay exact in bfloat16."""
    return (np.arange(numel, dtype=np.int64) % 7) + 3 * rank + 1


def make(kind: str, dtype: str, v: np.ndarray):
    if kind == "torch":
        return torch.from_numpy(v.copy()).to(getattr(torch, dtype))
    if kind == "numpy":
        return v.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    return jnp.asarray(v, dtype=getattr(jnp, dtype))


def as_bytes(x) -> torch.Tensor:
    raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor) and x.numel() \
        else b"" if isinstance(x, torch.Tensor) else np.asarray(x).tobytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def expected(collective: str, rank: int, n: int, numel: int) -> np.ndarray:
    whole = numel * n if collective in ("reduce_scatter", "all_to_all") else numel
    inputs = [values(q, whole) for q in range(n)]
    if collective == "allreduce":
        return sum(inputs)
    if collective == "broadcast":
        return inputs[0]
    if collective == "reduce_scatter":
        return sum(inputs)[rank * numel:(rank + 1) * numel]
    if collective == "all_gather":
        return np.concatenate(inputs)
    return np.concatenate([inputs[q][rank * numel:(rank + 1) * numel] for q in range(n)])


def run_case(ck: Checker, comm, where: str, collective: str, kind: str, dtype: str, numel: int, async_op: bool):
    """One collective on ``kind``; returns the result's bytes (checked exact and of the right kind)."""
    n, r = comm.size, comm.rank
    what = f"{where}: {collective} of {numel} x {dtype} ({kind}{', async' if async_op else ''})"
    if collective in ("allreduce", "broadcast"):
        x = make(kind, dtype, values(r, numel))
        got = comm.allreduce(x, async_op=async_op) if collective == "allreduce" else \
            comm.broadcast(x, root=0, async_op=async_op)
        got = got.wait() if async_op else got
        if kind == "jax":
            ck.true(f"{what}: a new JAX array, the caller's untouched", type(got) is type(x) and got is not x
                    and got.dtype == x.dtype and np.array_equal(np.asarray(x).astype(np.float64), values(r, numel)))
        else:
            ck.true(f"{what}: in place, the same object back", got is x, f"{type(got)}")
    else:
        whole = numel * n if collective in ("reduce_scatter", "all_to_all") else numel
        x = make(kind, dtype, values(r, whole))
        out = make("numpy" if kind == "jax" else kind, dtype, np.full(
            numel * n if collective == "all_gather" else whole if collective == "all_to_all" else numel, -5))
        got = getattr(comm, collective)(out, x, async_op=async_op)
        got = got.wait() if async_op else got
        ck.true(f"{what}: returns its output", got is out, f"{type(got)}")
    result = got.to(torch.float64).numpy() if isinstance(got, torch.Tensor) else np.asarray(got).astype(np.float64)
    ck.equal(what, torch.from_numpy(result), torch.from_numpy(expected(collective, r, n, numel).astype(np.float64)))
    return as_bytes(got)


def run_all(ck: Checker, comm, where: str, dtypes=DTYPES, sizes=SIZES) -> None:
    for collective in COLLECTIVES:
        for dtype in dtypes:
            for numel in sizes:
                torch_bytes = run_case(ck, comm, where, collective, "torch", dtype, numel, False)
                for kind in ("numpy", "jax"):
                    # numpy twice: the second allreduce of a small shape takes the synchronous fast
                    # entry; async at one size (the hand-back does not depend on it)
                    calls = (False, False) if kind == "numpy" else (False,)
                    for async_op in calls + ((True,) if numel == ASYNC_SIZE else ()):
                        got = run_case(ck, comm, where, collective, kind, dtype, numel, async_op)
                        what = f"{where}: {collective} of {numel} x {dtype} ({kind})"
                        ck.true(f"{what}: bitwise the torch path's", torch.equal(got, torch_bytes))
                        if collective in ("allreduce", "broadcast", "all_gather"):
                            ck.identical(f"{what}: identical on every rank", got)


def planned_checks() -> int:
    """Checks per rank: per case, torch 2 (kind, exact); numpy 2 calls and JAX 1, each 2 + bitwise + identical
    (where every rank holds the same result), and one async call of each at ASYNC_SIZE; 2 per mismatch;
    the full matrix on shm, a third over MPI."""
    per_call = {c: 3 + (c in ("allreduce", "broadcast", "all_gather")) for c in COLLECTIVES}
    per_case = sum(2 + 3 * per for per in per_call.values())        # torch; numpy twice, JAX once
    async_case = sum(2 * per for per in per_call.values())          # numpy and JAX async, at ASYNC_SIZE
    return sum(per_case * len(dtypes) * len(sizes) + async_case * len(dtypes) * (ASYNC_SIZE in sizes)
               for dtypes, sizes in ((DTYPES, SIZES), (MPI_DTYPES, MPI_SIZES))) + 2 * 2


def mismatch(ck: Checker, comm, where: str, make_array) -> None:
    """Every rank calls allreduce on ``make_array(rank)``; every rank must raise the mismatch, in time."""
    t0 = time.monotonic()
    ck.raises(f"{where}: arrays that differ across ranks", CollectiveMismatch,
              lambda: comm.allreduce(make_array(comm.rank)), f"rank {comm.rank}: ranks disagree on collective #")
    ck.true(f"{where}: the mismatch is told within {MISMATCH_LIMIT_S} s", time.monotonic() - t0 < MISMATCH_LIMIT_S,
            f"{time.monotonic() - t0:.1f} s")


def main() -> int:
    global jax, jnp, ml_dtypes
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ck = Checker(world)

    def body() -> None:
        with jax.enable_x64(True):  # JAX's 64-bit dtypes (32-bit by default)
            comm = ddl.init()
            mpi_comm = ddl.init(world.Dup(), transport="mpi")
            run_all(ck, comm, "shm")
            run_all(ck, mpi_comm, "mpi", MPI_DTYPES, MPI_SIZES)
            mismatch(ck, comm, "shm", lambda rank: np.ones(5 + rank, np.float32))
            mismatch(ck, mpi_comm, "mpi", lambda rank: np.ones(4099, np.float32) if rank == 0 else
                     jnp.ones(4099, jnp.int32))
            world.Barrier()
            mpi_comm.close()
            ddl.finalize()

    ck.run(body)
    return ck.report(f"arrays_worker: {world.Get_size()} ranks")


if __name__ == "__main__":
    raise SystemExit(main())
