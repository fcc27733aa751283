"""One timed measurement, as every benchmark here takes it: a warm call, a barrier so that
the ranks start together, ``iters`` back-to-back calls, and the slowest rank's time per call
(an allreduce MAX over the ranks). Also the DDP comm hook that communicates nothing, the
baseline against which the benchmarks time DDP's communication."""
from __future__ import annotations

import time


def time_per_call(world, run, iters: int) -> float:
    """Seconds per call of ``run()`` on the slowest rank of ``world`` (an mpi4py communicator)."""
    from mpi4py import MPI

    run()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    return world.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def unchanged_bucket_hook(state, bucket):
    """A DDP comm hook that communicates nothing: DDP's own bucket work, timed alone."""
    import torch
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
