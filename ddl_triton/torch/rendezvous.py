"""The store of an MPI-launched job: ``dist.init_process_group("ddl")`` under mpiexec needs no MASTER_ADDR.

torch's default group needs a key/value store, which torch builds from ``init_method``.
Under an MPI launcher (``mpiexec``/``ddlrun``/``srun`` with PMI) with no ``MASTER_ADDR``
set, there is no address to build it from; MPI already connects the ranks, so:

- ``ddl://`` (``mpi_rendezvous``): rank 0 starts a TCPStore on a free port of the job's
  interface only (127.0.0.1 when every rank is on its host; transports/job_network.py)
  and broadcasts its address over MPI. Every step is bounded by DDL_TIMEOUT (a rank that never
  calls makes the others raise BootstrapTimeout). The rank and size are MPI's; explicit ``rank``/``world_size`` (torch puts them in the URL) or RANK and
  WORLD_SIZE must agree with MPI's, or every rank raises ValueError.
- ``env://`` (torch's default) is wrapped: unchanged when MASTER_ADDR is set or MPI did not
  launch this process (torchrun, mp.spawn, SLURM with env://), otherwise ``ddl://``.

Launchers that are not MPI's bring their own store (torchrun's, a ``file://`` init method,
an explicit TCPStore): then none of this runs, and the backend bootstraps from the store
torch hands it (ddl_triton/torch/backend.py).
"""
from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from ..options import Options
from ..runtime.setup.bootstrap import launched_by_mpi, launcher_world, store_of_launcher
from ..runtime.setup.bootstrap_values import BootstrapError, mpi_allgather, mpi_bcast, mpi_dup, mpi_wait, shaped
from ..transports.job_network import job_address, serve_store

RENDEZVOUS_SCHEME = "ddl"


def check_matches_mpi(rank: int, size: int, comm, timeout: float) -> None:
    """Raise ValueError on every rank of ``comm`` if any rank's torch (rank, size) is not its MPI one.

    Collective: a rank that raised alone would leave the others waiting in the next collective."""
    import numpy as np
    from mpi4py import MPI

    mine = (rank, size) != (comm.Get_rank(), comm.Get_size())
    anyone = np.zeros(1, dtype=np.int64)
    # One int, as a raw buffer (nothing pickled), within the deadline: a rank that never calls makes
    # the others raise BootstrapTimeout instead of waiting for ever.
    mpi_wait(comm.Iallreduce(np.array([int(mine)], dtype=np.int64), anyone, op=MPI.MAX), timeout,
             "checking the ranks against MPI's", comm.Get_rank(), comm.Get_size())
    if not anyone[0]:
        return
    what = (f"torch.distributed was given rank {rank} of world size {size}, but MPI launched this process "
            f"as rank {comm.Get_rank()} of {comm.Get_size()}") if mine else \
        "another rank was given a rank or world size that is not its MPI one"
    raise ValueError(f"ddl backend: {what}; under an MPI launcher the 'ddl' backend's ranks are MPI's (pass "
                     "matching rank/world_size, or none; or launch with torchrun/mp.spawn, whose store the "
                     "backend then follows)")


def mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """Rendezvous handler for ``ddl://``: yields (TCPStore, MPI rank, MPI size)."""
    from mpi4py import MPI

    limit = min(timeout.total_seconds(), Options.from_env().timeout)  # DDL_TIMEOUT bounds each step
    comm = mpi_dup(MPI.COMM_WORLD, limit, "the ddl:// rendezvous")
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
        given_rank = int(query.get("rank", os.environ.get("RANK", rank)))
        given_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", size)))
        if given_size == -1:
            given_size = size
        if given_rank == -1:
            given_rank = rank
        check_matches_mpi(given_rank, given_size, comm, limit)
        # Control path: small values, once, as JSON, each within the deadline.
        hosts = mpi_allgather(comm, socket.gethostname(), limit, "the ddl:// rendezvous's hosts")
        store = None
        if rank == 0:  # served on the job's interface only (loopback for a job on one host)
            where = job_address(all(h == hosts[0] for h in hosts))
            try:
                store, bound, port = serve_store(where, 0, size, limit)
            except OSError as e:
                raise BootstrapError(f"rank 0: ddl:// rendezvous: cannot serve the store on {where} ({e})") from None
            address = [bound, port]
        else:
            address = None
        address = shaped(mpi_bcast(comm, address, 0, limit, "the ddl:// store's address"),
                         (str, int), "rank 0's store address", rank)
        if not 0 < address[1] < 65536:
            raise BootstrapError(f"rank {rank}: ddl:// rendezvous: rank 0 sent port {address[1]}")
        if rank != 0:
            store = dist.TCPStore(address[0], address[1], size, False, timeout)
    finally:
        comm.Free()
    yield store, rank, size
    raise RuntimeError("ddl:// rendezvous cannot re-rendezvous")


def launcher_rendezvous(found, url: str, timeout: timedelta):
    """Yields (TCPStore, rank, size) of the world a launcher's variables describe (Slurm, Open MPI,
    Kubeflow, JobSet: launchers.py), where torch's ``env://`` would find no RANK, or the wrong one."""
    limit = min(timeout.total_seconds(), Options.from_env().timeout)
    query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
    for name, mine in (("rank", found.rank), ("world_size", found.size)):
        if int(query.get(name, -1)) not in (-1, mine):
            raise ValueError(f"rank {found.rank}: ddl backend: init_process_group was given {name}={query[name]}, but "
                             f"the launcher's variables say {mine} ({found.explain()})")
    store, rank, size = store_of_launcher(found, limit)
    yield store, rank, size
    raise RuntimeError("the launcher's rendezvous cannot re-rendezvous")


def _env_or_mpi(original):
    """Wrap torch's ``env://`` handler: unchanged under torchrun and env:// variables, or MPI with
    MASTER_ADDR set; over MPI under an MPI launcher; otherwise, where torch would find no RANK (or a
    pod's index as RANK), at the store the launcher's variables describe (launchers.py)."""
    def handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
        launcher = Options.from_env().launcher
        if launched_by_mpi():
            if os.environ.get("MASTER_ADDR"):
                yield from original(url, timeout=timeout, **kwargs)
            else:
                yield from mpi_rendezvous(url, timeout=timeout, **kwargs)
            return
        found = launcher_world(launcher)
        if found is None or found.launcher in ("torchrun", "env"):
            yield from original(url, timeout=timeout, **kwargs)
        else:
            yield from launcher_rendezvous(found, url, timeout)
    handler._ddl_wraps = original
    return handler


def register() -> None:
    """Register ``ddl://`` and wrap ``env://`` (idempotent)."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (dist.rendezvous is a function)
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if handlers is None:
        return
    if RENDEZVOUS_SCHEME not in handlers:
        rdzv.register_rendezvous_handler(RENDEZVOUS_SCHEME, mpi_rendezvous)
    env = handlers.get("env")
    if env is not None and not hasattr(env, "_ddl_wraps"):
        handlers["env"] = _env_or_mpi(env)
