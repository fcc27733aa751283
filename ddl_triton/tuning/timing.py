"""The timing harness that ``ddl-tune`` and every benchmark in bench/ share.

What it offers:

- ``time_per_call(world, run, iters)``: one measurement. A warm call (untimed: it pays for
  planning, lazy set-up and first page faults), a barrier so that the ranks start together,
  ``iters`` back-to-back calls, and the slowest rank's seconds per call (an allreduce MAX
  over ``world``, an mpi4py communicator): a collective is done when its last rank is.
- ``iterations(target_s, seconds)``: how many calls make a measurement last at least
  ``target_s``, given that one call took ``seconds`` (at least 1, at most ``most``).
- ``quantile(values, q)``: the q-quantile of a sample, interpolated linearly between the
  sorted values (numpy's default), so that ``quantile(v, 0.5)`` is ``statistics.median(v)``
  and p20 <= median <= p80 always hold together.
- ``start_gloo(world)``: torch's gloo process group over the same ranks as ``world`` (rank 0
  picks a free local port and sends it over MPI), for timing gloo beside ddl_triton and MPI.

Nothing here imports torch or MPI until it is called (``--help`` stays fast).
"""
from __future__ import annotations

import math
import time


def time_per_call(world, run, iters: int) -> float:
    """Seconds per call of ``run()`` on the slowest rank of ``world`` (see the module doc)."""
    import numpy as np
    from mpi4py import MPI

    run()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    mine, slowest = np.array([(time.perf_counter() - t0) / iters]), np.zeros(1)
    world.Allreduce(mine, slowest, op=MPI.MAX)  # a buffer collective: no pickled object crosses
    return float(slowest[0])


def iterations(target_s: float, seconds: float, most: int = 2000) -> int:
    """Calls per measurement: enough to last ``target_s`` when one call takes ``seconds``."""
    return max(1, min(most, math.ceil(target_s / max(seconds, 1e-7))))


def quantile(values, q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ``values``, linear between the sorted values."""
    s = sorted(values)
    if not s:
        raise ValueError("quantile of no values")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def start_gloo(world, timeout: float = 300.0):
    """Start torch's default process group on gloo over the ranks of ``world`` (an mpi4py
    communicator) and return it; the caller destroys it (``dist.destroy_process_group()``).
    ``timeout`` bounds the exchange of rank 0's address."""
    import socket

    import torch.distributed as dist

    from ..runtime.setup.bootstrap_values import BootstrapError, checked, mpi_allgather, mpi_bcast

    me = world.Get_rank()
    # One host: loopback. Across hosts: rank 0's host name, which every host resolves.
    names = [checked(n, str, f"rank {r}'s host name", me)
             for r, n in enumerate(mpi_allgather(world, socket.gethostname(), timeout, "host names for gloo"))]
    address = "127.0.0.1" if len(set(names)) == 1 else names[0]
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind((address if address == "127.0.0.1" else "", 0))
            port = s.getsockname()[1]
    port = checked(mpi_bcast(world, port, 0, timeout, "gloo's port"), int, "rank 0's port for gloo", me)
    if not 0 < port < 65536:
        raise BootstrapError(f"rank {me}: rank 0 sent port {port} for gloo")
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=world.Get_rank(),
                            world_size=world.Get_size())
    return dist.group.WORLD
