"""The `make demo` program: a short benchmark table, then data-parallel training steps.

Run: ddlrun -n 4 -- python examples/demo.py [--quick]

``--quick`` (used by the test suite) times two sizes and trains three steps.

Part 1 times ddl_triton's allreduce against MPICH's MPI_Allreduce at a few
sizes (medians of interleaved rounds). Part 2 trains a small MLP on a fixed
synthetic regression task, Horovod style: each rank computes gradients on its
own shard of the batch, ``comm.allreduce(grad, op="avg")`` averages them, and
every rank applies the same update, so the replicas stay bit-identical.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import ddl_triton as ddl


def benchmark(comm, mpi, sizes=(256, 64 << 10, 1 << 20, 4 << 20)) -> None:
    if comm.rank == 0:
        print(f"# allreduce fp32 sum on {comm.size} ranks: median of 5 interleaved rounds")
        print("# mpi/ddl = MPICH's MPI_Allreduce time / ddl_triton's: above 1, ddl_triton is faster; "
              "busbw = bytes/time x 2(n-1)/n")
        print(f"{'bytes':>10} {'ddl us':>10} {'mpi us':>10} {'mpi/ddl':>8} {'ddl busbw GB/s':>15}")
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        # Each as its fastest user calls it: MPICH on a buffer spec built once, not per call.
        runs = {"ddl": functools.partial(comm.allreduce, t),
                "mpi": functools.partial(mpi.Allreduce, MPI.IN_PLACE, [t.numpy(), MPI.FLOAT])}
        iters = max(3, min(300, (8 << 20) // nbytes))
        times = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        for _ in range(5):
            for name, fn in runs.items():
                mpi.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                slowest = np.array([time.perf_counter() - t0])
                mpi.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)  # a raw buffer: nothing pickled
                times[name].append(slowest[0] / iters)
        d, m = statistics.median(times["ddl"]), statistics.median(times["mpi"])
        busbw = nbytes / d / 1e9 * 2 * (comm.size - 1) / comm.size
        if comm.rank == 0:
            print(f"{nbytes:>10} {d * 1e6:>10.1f} {m * 1e6:>10.1f} {m / d:>8.2f} {busbw:>15.2f}")


def train(comm, steps: int = 8) -> None:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    global_batch = 64 * comm.size
    if comm.rank == 0:
        print(f"\n# data-parallel training, {comm.size} ranks, global batch {global_batch}")
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(global_batch, 32, generator=g)
        y = torch.tanh(x @ teacher)
        shard = slice(comm.rank * 64, (comm.rank + 1) * 64)  # this rank's part of the global batch
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        opt.zero_grad()
        loss.backward()
        works = [comm.allreduce(p.grad, op="avg", async_op=True) for p in model.parameters()]
        for w in works:
            w.wait()
        opt.step()
        global_loss = comm.allreduce(loss.detach().reshape(1), op="avg").item()
        dt = time.perf_counter() - t0
        if comm.rank == 0:
            print(f"step {step}: loss {global_loss:.4f}  {global_batch / dt:8.0f} samples/s")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    comm.broadcast(first, root=0)
    same = comm.allreduce(torch.tensor([int(torch.equal(first, flat))]), op="min").item()
    if comm.rank == 0:
        print(f"replicas bit-identical after training: {'yes' if same else 'NO'}")


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    torch.set_num_threads(1)
    comm = ddl.init()
    mpi = MPI.COMM_WORLD
    benchmark(comm, mpi, sizes=(256, 64 << 10) if quick else (256, 64 << 10, 1 << 20, 4 << 20))
    train(comm, steps=3 if quick else 8)
    ddl.finalize()


if __name__ == "__main__":
    main()
