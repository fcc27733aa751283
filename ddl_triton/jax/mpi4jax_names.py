"""mpi4jax's collectives that ddl_triton.jax builds from its own: ``bcast``, ``gather``, ``reduce``,
``scatter``, ``scan``, with mpi4jax's (>= 0.8, token-free) signatures, defaults and results; eager and
inside ``jax.jit`` (each is one or two ordered collectives of collectives.py).

    bcast(x, root, *, comm=None)      root's ``x`` on every rank; the root gets its ``x`` back itself
    gather(x, root, *, comm=None)     on root the ranks' ``x`` stacked on a new axis 0, (nproc, *x.shape);
                                      elsewhere ``x`` unchanged (an allgather underneath: every rank
                                      moves the whole result)
    reduce(x, op, root, *, comm=None) on root ``allreduce(x, op)``; elsewhere ``x`` unchanged (an
                                      allreduce underneath)
    scatter(x, root, *, comm=None)    root's ``x`` has shape (nproc, *s), the others' ``x`` shape s (a
                                      template, not overwritten); rank r gets root's ``x[r]`` (a
                                      broadcast of the whole (nproc, *s) underneath)
    scan(x, op, *, comm=None)         rank r gets x_0 op x_1 op ... op x_r, combined in rank order
                                      (op MPI.SUM, MPI.MIN, MPI.MAX; an allgather underneath)

``op`` takes mpi4py's MPI.SUM, MPI.MIN, MPI.MAX or "sum", "min", "max" (and "avg" for reduce); other MPI
ops are refused naming these (collectives.op_name). ``comm``: None (the world), ``MPI.COMM_WORLD``, or a
``ddl_triton.Communicator``. Errors name the rank: a root out of range, scatter's first axis not nproc.

mpi4jax names this room does not implement (``has_cuda_support``, ``has_sycl_support``) are refused,
naming what to do instead, by the package's ``__getattr__`` (``NOT_HERE``).
"""
from __future__ import annotations

import jax.numpy as jnp

from . import world
from .collectives import allgather, allreduce, broadcast, check_reduced, check_root, op_name

__all__ = ["bcast", "gather", "reduce", "scan", "scatter"]

NOT_HERE = {
    "has_cuda_support": "ddl_triton.jax stages every array through the host, so there is no CUDA-aware MPI "
                        "build to ask about; GPU arrays work as they are",
    "has_sycl_support": "ddl_triton.jax stages every array through the host, so there is no SYCL-aware MPI "
                        "build to ask about",
}


def bcast(x, root, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``bcast``: rank ``root``'s ``x`` on every rank (a new array); on root ``x`` itself."""
    world.no_token(token, "bcast")
    comm = world.resolve(comm)
    root = check_root(comm, root)
    got = broadcast(jnp.asarray(x), root, comm=comm)
    return x if comm.rank == root else got


def gather(x, root, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``gather``: on ``root`` the ranks' ``x`` stacked, shape (nproc, *x.shape); elsewhere ``x``."""
    world.no_token(token, "gather")
    comm = world.resolve(comm)
    root = check_root(comm, root)
    got = allgather(jnp.asarray(x)[None], comm=comm)
    return got if comm.rank == root else x


def reduce(x, op, root, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``reduce``: on ``root`` the reduction of the ranks' ``x`` with ``op``; elsewhere ``x``."""
    world.no_token(token, "reduce")
    comm = world.resolve(comm)
    root = check_root(comm, root)
    got = allreduce(x, op, comm=comm)
    return got if comm.rank == root else x


def scatter(x, root, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``scatter``: rank r gets root's ``x[r]``; root's ``x`` has shape (nproc, *s), the others' s."""
    world.no_token(token, "scatter")
    comm = world.resolve(comm)
    root = check_root(comm, root)
    x = jnp.asarray(x)
    if comm.rank == root:
        if x.ndim == 0 or x.shape[0] != comm.size:
            raise ValueError(f"rank {comm.rank}: ddl_triton.jax.scatter: Scatter input must have shape (nproc, ...) "
                             f"on the root, nproc = {comm.size}; got {tuple(x.shape)}")
        whole = x
    else:
        whole = jnp.zeros((comm.size, *x.shape), x.dtype)
    return broadcast(whole, root, comm=comm)[comm.rank]


def scan(x, op, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``scan`` (MPI_Scan, inclusive): rank r gets x_0 op ... op x_r, in rank order."""
    world.no_token(token, "scan")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    op = op_name(comm, "scan", op)
    if op not in ("sum", "min", "max"):
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.scan: op must be MPI.SUM, MPI.MIN, MPI.MAX (or 'sum', "
                         f"'min', 'max'), got {op!r}")
    check_reduced(comm, "scan", [x], op)
    every = allgather(x[None], comm=comm)
    combine = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}[op]
    out = every[0]
    for q in range(1, comm.rank + 1):
        out = combine(out, every[q])
    return out.astype(x.dtype)
