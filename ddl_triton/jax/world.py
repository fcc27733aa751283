"""The communicator JAX code runs on, and Horovod's questions about it: ``rank()``, ``size()``, ...

``init()`` is ``ddl_triton.init()``: under ddlrun, mpiexec or srun (PMI) the MPI world; otherwise
the standard variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a TCPStore on rank 0, gloo
between hosts); with neither, a world of one. It is idempotent, and every function of
``ddl_triton.jax`` uses that world communicator unless given ``comm=`` (another
``ddl_triton.Communicator``, e.g. ``ddl_triton.init(sub_comm)``). No torch.distributed call is
needed, or made, in the user's script.
"""
from __future__ import annotations

import ddl_triton

__all__ = ["init", "local_rank", "local_size", "rank", "size"]


def init(**kwargs):
    """The world communicator (``ddl_triton.init(**kwargs)``: options as keywords, e.g.
    ``schedule="ring"``); created at the first call, the same object afterwards."""
    return ddl_triton.init(**kwargs)


def rank(comm=None) -> int:
    """This process's rank in ``comm`` (default: the world)."""
    return resolve(comm).rank


def size(comm=None) -> int:
    """The number of ranks of ``comm`` (default: the world)."""
    return resolve(comm).size


def local_rank(comm=None) -> int:
    """This process's index among the ranks of its host (its node in ``comm.placement``)."""
    c = resolve(comm)
    return c.placement.on_node.index(c.rank)


def local_size(comm=None) -> int:
    """The number of ranks of ``comm`` on this process's host."""
    return len(resolve(comm).placement.on_node)


_elastic_world = None  # the elastic room's stand-in for the current world (jax/elastic/world.py)


def use_elastic_world(stand_in) -> None:
    """Make ``stand_in`` the default communicator (``ddl_triton.jax.elastic.init``): one object that
    forwards to whichever world is current, so jitted collectives follow every re-form."""
    global _elastic_world
    _elastic_world = stand_in


def resolve(comm=None):
    """``comm``, or the world communicator when None (created on first use; in an elastic job, the
    stand-in for the current world). A value that is not a communicator is refused here, before
    anything is traced or sent."""
    if comm is None:
        return _elastic_world if _elastic_world is not None else ddl_triton.init()
    if not all(hasattr(comm, a) for a in ("allreduce", "broadcast", "all_gather", "rank", "size")):
        raise TypeError(f"ddl_triton.jax: comm must be a ddl_triton.Communicator (ddl_triton.init()), "
                        f"got {type(comm).__name__}")
    return comm
