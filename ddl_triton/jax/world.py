"""The communicator JAX code runs on, and Horovod's questions about it: ``rank()``, ``size()``, ...

``init()`` is ``ddl_triton.init()``: under ddlrun, mpiexec or srun --mpi=pmi2 the MPI world;
otherwise the world the launcher's variables describe (torchrun or env:// RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; plain srun; Open MPI's mpirun; Kubeflow; JobSet:
ddl_triton/launch/launchers.py), over a TCPStore on rank 0 and gloo between hosts; with
none, a world of one. It is idempotent, and every function of
``ddl_triton.jax`` uses that world communicator unless given ``comm=`` (another
``ddl_triton.Communicator``, e.g. ``ddl_triton.init(sub_comm)``). No torch.distributed call is
needed, or made, in the user's script.
"""
from __future__ import annotations

import ddl_triton

__all__ = ["init", "local_rank", "local_size", "rank", "size"]


def init(**kwargs):
    """The world communicator (``ddl_triton.init(**kwargs)``: options as keywords, e.g.
    ``schedule="ring"``); created at the first call, the same object afterwards. The public
    ``ddl_triton.jax.init`` (point_to_point.py) also sets up the world's point-to-point channel."""
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


NO_TOKEN = object()  # mpi4jax's NOTSET: ``token=`` not given


def no_token(token, what: str) -> None:
    """mpi4jax (>= 0.8) refuses ``token=``, and so do its names here, the same way (RuntimeError)."""
    if token is not NO_TOKEN:
        raise RuntimeError(f"ddl_triton.jax.{what}: explicit token management is not supported, as in mpi4jax>=0.8: "
                           "the calls are ordered for you (ordered effects); drop token= and use the result alone "
                           "(no (result, token) pair)")


_elastic_world = None  # the elastic room's stand-in for the current world (jax/elastic/world.py)


def use_elastic_world(stand_in) -> None:
    """Make ``stand_in`` the default communicator (``ddl_triton.jax.elastic.init``): one object that
    forwards to whichever world is current, so jitted collectives follow every re-form."""
    global _elastic_world
    _elastic_world = stand_in


def resolve(comm=None):
    """``comm``, or the world communicator when None (created on first use; in an elastic job, the
    stand-in for the current world, ``use_elastic_world``). mpi4jax's spelling
    ``comm=MPI.COMM_WORLD`` (or a clone of it, mpi4jax's default) is the world communicator; any
    other mpi4py communicator is refused, naming ``ddl_triton.init(that_comm)``. A value that is not
    a communicator is refused here, before anything is traced or sent."""
    if comm is None:
        return _elastic_world if _elastic_world is not None else ddl_triton.init()
    if type(comm).__module__ == "mpi4py.MPI":
        return _from_mpi(comm)
    if not all(hasattr(comm, a) for a in ("allreduce", "broadcast", "all_gather", "rank", "size")):
        raise TypeError(f"ddl_triton.jax: comm must be a ddl_triton.Communicator (ddl_triton.init()), "
                        f"got {type(comm).__name__}")
    return comm


def _from_mpi(mpi_comm):
    """The world communicator for mpi4jax's ``comm=MPI.COMM_WORLD`` (or a communicator congruent
    with it: mpi4jax's default is its clone); other mpi4py communicators are refused by name."""
    from mpi4py import MPI
    world = ddl_triton.init()
    mpi_world = (MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank())
    if not isinstance(mpi_comm, MPI.Intracomm) or MPI.Comm.Compare(mpi_comm, MPI.COMM_WORLD) not in (
            MPI.IDENT, MPI.CONGRUENT) or mpi_world != (world.size, world.rank):
        raise ValueError(f"rank {world.rank}: ddl_triton.jax: comm={mpi_comm!r} is not ddl_triton's world (MPI's "
                         f"COMM_WORLD of {world.size} ranks); for a sub-communicator pass "
                         "comm=ddl_triton.init(that_mpi_comm), made once on every rank of it")
    return world
