"""The store of an MPI-launched job: ``dist.init_process_group("ddl")`` under mpiexec needs no MASTER_ADDR.

torch's default group needs a key/value store, which torch builds from ``init_method``.
Under an MPI launcher (``mpiexec``/``ddlrun``/``srun`` with PMI) with no ``MASTER_ADDR``
set, there is no address to build it from; MPI already connects the ranks, so:

- ``ddl://`` (``mpi_rendezvous``): rank 0 starts a TCPStore on a free port and broadcasts
  its address over MPI; ranks on rank 0's host connect to 127.0.0.1. The rank and size
  are MPI's; explicit ``rank``/``world_size`` (torch puts them in the URL) or RANK and
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

from ..runtime.setup.bootstrap import launched_by_mpi
from ..runtime.setup.bootstrap_values import BootstrapError, mpi_bcast, shaped

RENDEZVOUS_SCHEME = "ddl"


def check_matches_mpi(rank: int, size: int, comm) -> None:
    """Raise ValueError on every rank of ``comm`` if any rank's torch (rank, size) is not its MPI one.

    Collective: a rank that raised alone would leave the others waiting in the next collective."""
    from mpi4py import MPI

    mine = (rank, size) != (comm.Get_rank(), comm.Get_size())
    if not comm.allreduce(int(mine), op=MPI.MAX):  # control path: one int
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

    comm = MPI.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
        given_rank = int(query.get("rank", os.environ.get("RANK", rank)))
        given_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", size)))
        if given_size == -1:
            given_size = size
        if given_rank == -1:
            given_rank = rank
        check_matches_mpi(given_rank, given_size, comm)
        host = socket.gethostname()
        store = None
        if rank == 0:
            store = dist.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
            address = [host, store.port]
        else:
            address = None
        # Control path: one small value, once, as JSON, within the rendezvous's timeout.
        address = shaped(mpi_bcast(comm, address, 0, timeout.total_seconds(), "the ddl:// store's address"),
                         (str, int), "rank 0's store address", rank)
        if not 0 < address[1] < 65536:
            raise BootstrapError(f"rank {rank}: ddl:// rendezvous: rank 0 sent port {address[1]}")
        if rank != 0:
            peer_host = "127.0.0.1" if address[0] == host else address[0]
            store = dist.TCPStore(peer_host, address[1], size, False, timeout)
    finally:
        comm.Free()
    yield store, rank, size
    raise RuntimeError("ddl:// rendezvous cannot re-rendezvous")


def _env_or_mpi(original):
    """Wrap torch's ``env://`` handler: unchanged when MASTER_ADDR is set or MPI did not launch this
    process; otherwise (where torch would fail) rendezvous over MPI."""
    def handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
        if os.environ.get("MASTER_ADDR") or not launched_by_mpi():
            yield from original(url, timeout=timeout, **kwargs)
        else:
            yield from mpi_rendezvous(url, timeout=timeout, **kwargs)
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
