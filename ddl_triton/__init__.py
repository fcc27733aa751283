"""ddl_triton: synchronous data-parallel collectives whose communication cost almost disappears.

    import ddl_triton as ddl
    comm = ddl.init()                       # world communicator over MPI.COMM_WORLD (idempotent)
    comm.allreduce(t, op="avg")             # in place; sum | avg | min | max or torch ReduceOp
    w = comm.allreduce(t, async_op=True); w.wait()
    comm.reduce_scatter(out, inp); comm.all_gather(out, inp); comm.broadcast(t, root=0); comm.barrier()
    ddl.finalize()
"""
from __future__ import annotations

import sys

from .communicator import Communicator
from .planner import Plan
from .errors import CollectiveTimeout, CommunicatorPoisoned, DDLError
from .options import Options
from .transports import failure_notice
from .work import Work

__all__ = ["CollectiveTimeout", "Communicator", "CommunicatorPoisoned", "DDLError", "Options", "Plan", "Work",
           "finalize", "init"]
__version__ = "0.1.0"

_world: Communicator | None = None
_exit_guard_installed = False


def _install_exit_guard() -> None:
    """At exit, skip MPI_Finalize when a peer was lost or timed out.

    MPI_Finalize waits for every rank, so a survivor of a dead peer would hang there
    after its CollectiveTimeout. The guard flushes output and ends the process with
    exit code 1 without finalizing (MPI_Abort would also kill the other survivors
    before they report). mpi4py finalizes MPI in a C-level exit function, after every
    atexit handler, so the guard always runs first. In every case the guard then
    ignores the launcher's SIGUSR1 notice for the rest of the process's life.
    """
    global _exit_guard_installed
    if _exit_guard_installed:
        return
    import atexit

    def guard() -> None:
        from .communicator import peers_lost
        lost = peers_lost() or not _exit_rendezvous()
        # Decided: from here on the launcher's notice can change nothing, and the
        # interpreter's teardown would put SIGUSR1 back to its default action (death)
        # while a faster peer's clean exit is still being announced.
        failure_notice.ignore_from_now_on()
        if lost:
            import os
            from . import status
            status.exiting()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    atexit.register(guard)
    _exit_guard_installed = True


_world_created = False  # this process created a world communicator (every rank of the world did)


def _exit_rendezvous() -> bool:
    """Before MPI_Finalize, which waits for every rank with no way out: wait for every rank
    in an ``Ibarrier`` that ends early when the launcher reports a process that ended
    without finalizing (failure_notice.py). Returns False, after dumping the flight
    recorder, when such a peer makes finalizing hopeless. A rank that is merely slow (still
    writing a checkpoint, say) is waited for as long as it takes."""
    from mpi4py import MPI

    if not _world_created or not MPI.Is_initialized() or MPI.Is_finalized():
        return True
    from . import flight, status
    from .transports.base import PeerTimeout, wait_until

    request = MPI.COMM_WORLD.Ibarrier()
    try:
        wait_until(request.Test, float("inf"), -1, "every rank at exit")
    except PeerTimeout as e:
        message = (f"rank {MPI.COMM_WORLD.Get_rank()}: at exit, before MPI_Finalize: {e}; "
                   "leaving without finalizing")
        path = flight.RECORDER.dump(message)
        status.error(message)
        print(f"ddl_triton: {message}" + (f" [flight recorder: {path}]" if path else ""), file=sys.stderr, flush=True)
        return False
    return True


def init(mpi_comm=None, options: Options | None = None, **overrides) -> Communicator:
    """Create a communicator over ``mpi_comm`` (default ``MPI.COMM_WORLD``).

    The world communicator is created once: a later ``init()`` over the world returns it,
    and raises ``ValueError`` when given options that differ from the ones it was created
    with (they could not be honoured; a communicator's options never change). For other
    options, make another communicator over a duplicate of the world:
    ``ddl_triton.init(MPI.COMM_WORLD.Dup(), schedule="ring")``, or ``finalize()`` first.
    ``options`` defaults to ``Options.from_env()`` (the ``DDL_*`` variables, read
    here and only here); keyword ``overrides`` replace single fields.
    """
    global _world
    from mpi4py import MPI

    world = mpi_comm is None or mpi_comm == MPI.COMM_WORLD
    if world and _world is not None:
        _check_same_options(_world, options, overrides)
        return _world
    opts = options.replace(**overrides) if options is not None else Options.from_env(**overrides)
    _install_exit_guard()
    failure_notice.install()  # survive the launcher's "a rank died" signal, and act on it
    comm = Communicator(MPI.COMM_WORLD if mpi_comm is None else mpi_comm, opts)
    if world:
        global _world_created
        _world = comm
        _world_created = True
        from . import status
        status.start(opts.status_dir, comm.rank)
    return comm


def _check_same_options(world: Communicator, options: Options | None, overrides: dict) -> None:
    """Refuse options the existing world communicator was not created with (see ``init``)."""
    created = world._requested_options
    asked = (options.replace(**overrides) if options is not None else created.replace(**overrides)) \
        if (options is not None or overrides) else created
    differ = [f"{name}={getattr(asked, name)!r} (it has {getattr(created, name)!r})"
              for name in Options.__dataclass_fields__ if getattr(asked, name) != getattr(created, name)]
    if differ:
        raise ValueError(f"rank {world.rank}: ddl_triton.init: the world communicator already exists and cannot "
                         f"take {', '.join(differ)}; create another with ddl_triton.init(MPI.COMM_WORLD.Dup(), ...) "
                         "or call ddl_triton.finalize() first")


def finalize() -> None:
    """Finish outstanding work and release the world communicator's resources."""
    global _world
    if _world is not None:
        _world.close()
        _world = None
