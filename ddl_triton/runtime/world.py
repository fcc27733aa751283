"""The world's life cycle: ``init`` creates a communicator (the world's, once), ``finalize``
releases it, and an exit guard keeps a survivor of a lost peer from hanging in MPI_Finalize.

This is the only module that holds process-wide runtime state: the world communicator and
whether this process made one (the exit rendezvous needs to know).
"""
from __future__ import annotations

import os
import sys

from ..options import Options
from ..transports import failure_notice
from .communicator import Communicator, farewell_at_exit
from .lanes.farewell import Leaving

_world: Communicator | None = None
_exit_guard_installed = False


def _install_exit_guard() -> None:
    """At exit, first tell the peers of every open communicator that this rank reached exit
    (communicator.farewell_at_exit); then skip MPI_Finalize when a peer was lost or timed out (in
    init or later), or is not at exit within the deadline (``_exit_rendezvous``).

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
        from .calls.issue import peers_lost
        farewell_at_exit()  # first: a peer waiting for this rank in a call it never issued raises now
        lost = peers_lost() or _init_timed_out or not _exit_rendezvous()
        # Decided: from here on the launcher's notice can change nothing, and the
        # interpreter's teardown would put SIGUSR1 back to its default action (death)
        # while a faster peer's clean exit is still being announced.
        failure_notice.ignore_from_now_on()
        if lost:
            from .. import status_files
            status_files.exiting()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    atexit.register(guard)
    _exit_guard_installed = True


_world_created = False  # this process created a world communicator (every rank of the world did)
_exit_timeout = 300.0    # the world communicator's Options.timeout: the exit rendezvous's deadline
_init_timed_out = False  # a rank did not arrive at a step of this process's init: MPI_Finalize would wait for it


def _exit_rendezvous() -> bool:
    """Before MPI_Finalize, which waits for every rank with no way out: wait for every rank
    in an ``Ibarrier``, at most the world communicator's ``Options.timeout`` (DDL_TIMEOUT),
    ending early when the launcher reports a process that ended without finalizing
    (failure_notice.py). Returns False, after dumping the flight recorder and reporting,
    when a peer is not at exit by then: finalizing would wait for it with no way out.

    The trade-off: a peer that is merely slow (still writing a checkpoint, say) is waited for
    as long as any other wait of the job, DDL_TIMEOUT, and no longer; past that the ranks
    already at exit leave with exit code 1, naming the wait. A job whose ranks finish that
    far apart needs a DDL_TIMEOUT to match, as its collectives around the slow step would."""
    from mpi4py import MPI

    if not _world_created or not MPI.Is_initialized() or MPI.Is_finalized():
        return True
    from ..observability import flight
    from .. import status_files
    from ..transports.waits import PeerTimeout, wait_until

    request = MPI.COMM_WORLD.Ibarrier()
    try:
        wait_until(request.Test, _exit_timeout, -1, "every rank at exit")
    except PeerTimeout as e:
        late = "" if e.dead else (f" within {_exit_timeout:g} s (DDL_TIMEOUT; a rank still busy, writing a "
                                  "checkpoint say, needs a larger one)")
        message = (f"rank {MPI.COMM_WORLD.Get_rank()}: at exit, before MPI_Finalize: {e}{late}; "
                   "leaving without finalizing")
        path = flight.RECORDER.dump(message)
        status_files.error(message)
        print(f"ddl_triton: {message}" + (f" [flight recorder: {path}]" if path else ""), file=sys.stderr, flush=True)
        return False
    return True


def init(mpi_comm=None, options: Options | None = None, *, store=None, rank: int | None = None,
         size: int | None = None, **overrides) -> Communicator:
    """Create a communicator: the world's (by default), or one over ``mpi_comm``.

    How the ranks find each other (ddl_triton/runtime/setup/bootstrap.py), in this order:

    1. ``mpi_comm``: that MPI communicator (a sub-group: ``ddl_triton.init(sub_comm)``).
    2. ``store``, ``rank``, ``size``: a ``torch.distributed.Store`` (TCPStore, FileStore, ...)
       and this process's place in a world of ``size`` ranks: the world communicator.
    3. The world, launched by MPI (mpiexec, ddlrun, srun --mpi=pmi2): ``MPI.COMM_WORLD``.
    4. The world, not launched by MPI: torch's default process group, when one is
       initialized (its store, ranks and size); else the world the launcher's variables
       describe (ddl_triton/launch/launchers.py: torchrun, a Kubeflow PyTorchJob, a
       JobSet, env:// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Open MPI's mpirun, Slurm's srun,
       Kubeflow Trainer; rank 0 serves a TCPStore where they say); else a world of one.
       ``Options.launcher`` (DDL_LAUNCHER) names the launcher instead of finding it.

    Under MPI the inter-node transport is MPI; over a store it is gloo (a gloo process
    group on the same store). Within a host it is shared memory either way.

    The world communicator is created once: a later ``init()`` over the world returns it,
    and raises ``ValueError`` when given options, a rank or a size that differ from the
    ones it was created with (they could not be honoured; a communicator's options never
    change). For other options, make another communicator over a duplicate of the world:
    ``ddl_triton.init(MPI.COMM_WORLD.Dup(), schedule="ring")``, or ``finalize()`` first.
    ``options`` defaults to ``Options.from_env()`` (the ``DDL_*`` variables, read
    here and only here); keyword ``overrides`` replace single fields.
    """
    global _world
    from mpi4py import MPI

    if store is not None and mpi_comm is not None:
        raise ValueError("ddl_triton.init: pass an MPI communicator or a store, not both")
    if (store is None) != (rank is None) or (store is None) != (size is None):
        raise ValueError("ddl_triton.init: store=, rank= and size= go together (all three or none)")
    world = store is not None or mpi_comm is None or mpi_comm == MPI.COMM_WORLD
    if world and _world is not None:
        _check_same_options(_world, options, overrides)
        if store is not None and (rank, size) != (_world.rank, _world.size):
            raise ValueError(f"rank {_world.rank}: ddl_triton.init: the world communicator already exists as rank "
                             f"{_world.rank} of {_world.size}, not rank {rank} of {size}; call "
                             "ddl_triton.finalize() first")
        return _world
    opts = options.replace(**overrides) if options is not None else Options.from_env(**overrides)
    _install_exit_guard()
    failure_notice.install()  # survive the launcher's "a rank died" signal, and act on it
    if mpi_comm is not None:
        comm = _guarded(lambda: Communicator(mpi_comm, opts))
    else:
        bootstrap = _guarded(lambda: _world_bootstrap(opts, store, rank, size))
        try:
            comm = _guarded(lambda: Communicator(bootstrap, opts))
        except BaseException:
            bootstrap.close()  # made here; a Communicator closes only what it made itself
            raise
    if world:
        global _world_created, _exit_timeout
        _world = comm
        _world_created = comm.bootstrap.kind == "mpi"  # the exit rendezvous is MPI's (see _exit_rendezvous)
        _exit_timeout = opts.timeout
        from .. import status_files
        status_files.start(opts.status_dir, comm.rank)
    return comm


def _guarded(make):
    """``make()``; when a rank did not arrive at a step of init in time and MPI's world has other
    ranks (MPI_Finalize would wait for that rank), remember it for the exit guard before the error
    goes on. A singleton's MPI_Finalize (ranks over a store) waits for nobody: its exit code stays
    the application's."""
    global _init_timed_out
    from mpi4py import MPI
    from .setup.bootstrap import BootstrapTimeout
    try:
        return make()
    except BootstrapTimeout:
        _init_timed_out = MPI.COMM_WORLD.Get_size() > 1
        raise


_store_worlds = 0  # world communicators made over stores in this process: each gets its own key namespace


def _world_bootstrap(opts: Options, store, rank, size):
    """The world's bootstrap, chosen as ``init`` documents (steps 2-4)."""
    global _store_worlds
    from ..launch.launchers import detect, mpi_launched
    from .setup.bootstrap import MpiBootstrap, StoreBootstrap, store_of_launcher

    found = None
    if store is None:
        from mpi4py import MPI
        if mpi_launched(launcher=opts.launcher):
            how = detect(launcher=opts.launcher).explain()
            return _found(MpiBootstrap(MPI.COMM_WORLD, timeout=opts.timeout), how)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store
            store, rank, size = _get_default_store(), dist.get_rank(), dist.get_world_size()
        else:
            found = detect(launcher=opts.launcher)
            if found is None:  # a world of one (an MPI singleton)
                return _found(MpiBootstrap(MPI.COMM_WORLD, timeout=opts.timeout),
                              "no launcher's variables: a world of one")
            store, rank, size = store_of_launcher(found, opts.timeout)
    _store_worlds += 1
    made = StoreBootstrap(store, rank, size, timeout=opts.timeout, prefix=f"ddl_triton/world{_store_worlds}")
    return _found(made, found.explain() if found is not None else _given(opts))


def _given(opts: Options) -> str:
    """The launcher line of a world over a store handed to ``init`` (torch's default group's, say)."""
    from ..launch.launchers import detect
    line = "store, rank and size given (torch's default process group, or ddl_triton.init(store=...))"
    try:
        found = detect(launcher=opts.launcher)
    except ValueError:
        found = None
    return f"{line}; {found.explain()}" if found is not None else line


def _found(bootstrap, how: str):
    """``bootstrap``, saying how its world was found (``Communicator.explain`` reports it)."""
    bootstrap.launcher = how
    return bootstrap


def _check_same_options(world: Communicator, options: Options | None, overrides: dict) -> None:
    """Refuse options the existing world communicator was not created with (see ``init``)."""
    created = world.requested_options
    asked = (options.replace(**overrides) if options is not None else created.replace(**overrides)) \
        if (options is not None or overrides) else created
    differ = [f"{name}={getattr(asked, name)!r} (it has {getattr(created, name)!r})"
              for name in Options.__dataclass_fields__ if getattr(asked, name) != getattr(created, name)]
    if differ:
        raise ValueError(f"rank {world.rank}: ddl_triton.init: the world communicator already exists and cannot "
                         f"take {', '.join(differ)}; create another with ddl_triton.init(MPI.COMM_WORLD.Dup(), ...) "
                         "or call ddl_triton.finalize() first")


def current() -> Communicator | None:
    """The world communicator, or None before ``init`` (and after ``finalize``)."""
    return _world


def finalize(how: Leaving = Leaving.FINALIZED) -> None:
    """Finish outstanding work and release the world communicator's resources; a peer still waiting
    in a collective this rank never issued raises ``CollectiveSkipped`` saying that this rank called
    finalize (``how``: the torch backend's group destruction says so instead)."""
    global _world
    if _world is not None:
        _world.close(how)
        _world = None
