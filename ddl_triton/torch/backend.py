"""The "ddl" torch.distributed backend: how torch creates a "ddl" group, under any launcher.

    import ddl_triton.torch                 # calls register(): backend "ddl" (CPU and CUDA tensors)
    dist.init_process_group("ddl")          # torchrun, mp.spawn, env://, file://, tcp://, mpiexec/ddlrun

torch calls ``create_process_group`` with the group's store, this process's rank in the
group and the group's size. The group's ranks find each other one of two ways
(ddl_triton/runtime/setup/bootstrap.py):

- launched by MPI (``mpiexec``/``ddlrun``/``srun`` with PMI): over MPI, as MPI ranks. The
  default group is the world communicator (``ddl_triton.init()``); torch's rank and size
  must be MPI's (else every rank raises ValueError); a sub-group is an MPI sub-communicator.
  Point-to-point is MPI. Without MASTER_ADDR, the store itself is built over MPI
  (rendezvous.py).
- otherwise (torchrun, ``torch.multiprocessing.spawn``, SLURM with ``env://``, torch's test
  harnesses): over the store torch hands the backend, with torch's ranks. The default
  group is the world communicator (``ddl_triton.init(store=..., rank=..., size=...)``, so a
  later ``ddl_triton.init()``, the hooks' default, returns it); a sub-group gets a
  communicator of its own. Within a host the ranks meet over shared memory; between hosts
  over gloo, on the same store. Point-to-point is a gloo group of its own.

Either way DDL_* variables configure the communicators, as for ``ddl_triton.init()``.
The pieces: process_group.py (the ProcessGroup adapter), point_to_point.py, futures.py
(Work and futures), staging.py (dtypes), rendezvous.py (the MPI-built store).
"""
from __future__ import annotations

import torch.distributed as dist

from ..planning import topology
from ..options import Options
from ..runtime.setup.bootstrap import StoreBootstrap, host_id, launched_by_mpi
from ..runtime.setup.bootstrap_values import mpi_dup, mpi_members_meet
from . import rendezvous
from .point_to_point import GlooPointToPoint, MpiPointToPoint
from .process_group import BACKEND_NAME, DdlProcessGroup

__all__ = ["BACKEND_NAME", "create_process_group", "register"]

# A duplicate of MPI's world made with the default group (under MPI), on which a sub-group's
# members meet within the deadline before the blocking Create_group (mpi_members_meet).
_meetings = None


def create_process_group(common_opts, backend_opts=None) -> DdlProcessGroup:
    """torch's creator hook (extended API): the group of ``common_opts.group_size`` ranks
    (``global_ranks_in_group``; empty for the default group), over MPI or over
    ``common_opts.store`` (see the module doc)."""
    if launched_by_mpi():
        return _over_mpi(common_opts)
    return _over_store(common_opts)


def _over_mpi(common_opts) -> DdlProcessGroup:
    from mpi4py import MPI

    import ddl_triton as ddl
    from ..runtime.world import current as current_world

    world = MPI.COMM_WORLD
    rank, size = common_opts.group_rank, common_opts.group_size
    members = list(common_opts.global_ranks_in_group)
    if not members:  # the default group
        rendezvous.check_matches_mpi(rank, size, world, Options.from_env().timeout)
        owns = current_world() is None
        comm = ddl.init()
        p2p = MpiPointToPoint(mpi_dup(world, comm.options.timeout, "the default group's point-to-point"),
                              comm.options.timeout, comm.rank, comm.placement.describe)
        global _meetings
        if _meetings is None:  # where a later sub-group's members meet (bounded) before Create_group
            _meetings = mpi_dup(world, comm.options.timeout, "the sub-groups' meeting point")
        return DdlProcessGroup(comm, p2p, owns_comm=owns)
    if dist.get_rank() != world.Get_rank():
        raise ValueError(f"ddl backend: the default process group's rank {dist.get_rank()} differs from the "
                         f"MPI rank {world.Get_rank()}; a 'ddl' subgroup needs them equal")
    timeout = Options.from_env().timeout
    if _meetings is not None:  # Create_group blocks until every member arrives: meet first, bounded
        mpi_members_meet(_meetings, members, timeout, f"creating the 'ddl' subgroup {members}")
    world_group = world.Get_group()
    sub_group = world_group.Incl(members)
    sub = world.Create_group(sub_group)
    world_group.Free()
    sub_group.Free()
    try:
        comm = ddl.init(sub, **_sub_topology(members, world.Get_size(), world.Get_rank()))
        p2p = MpiPointToPoint(mpi_dup(sub, comm.options.timeout, f"subgroup {members}'s point-to-point"),
                              comm.options.timeout, comm.rank, comm.placement.describe)
    finally:
        sub.Free()
    if comm.rank != rank or comm.size != size:
        raise ValueError(f"ddl backend: subgroup {members}: torch expects rank {rank} of {size}, "
                         f"MPI gives {comm.rank} of {comm.size}")
    return DdlProcessGroup(comm, p2p, owns_comm=True)


def _sub_topology(members: list[int], world_size: int, world_rank: int) -> dict:
    """The ``topology`` override of an MPI sub-group under DDL_TOPOLOGY, which describes the world:
    none without it; else the members' own grid (L ranks on each of H emulated nodes, node-contiguous),
    "" when they sit on one node. ValueError naming the rank when the members' layout is no grid."""
    spec = Options.from_env().topology
    if not spec:
        return {}
    world = topology.parse(spec, world_size, world_rank)
    nodes = [world.node_of(m) for m in members]
    runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    per = [nodes.count(n) for n in runs]
    if len(runs) != len(set(runs)) or len(set(per)) != 1:
        raise ValueError(f"rank {world_rank}: ddl backend: subgroup {members} is not L ranks on each of its emulated "
                         f"nodes in node order (DDL_TOPOLOGY={spec}: nodes {nodes})")
    return {"topology": "" if len(runs) == 1 else f"{per[0]}x{len(runs)}"}


def _over_store(common_opts) -> DdlProcessGroup:
    """The group over the store torch made for it (already private to this group: torch
    prefixes it with the group's name)."""
    import ddl_triton as ddl
    from ddl_triton.runtime.communicator import Communicator
    from ..runtime.world import current as current_world

    store, rank, size = common_opts.store, common_opts.group_rank, common_opts.group_size
    if not list(common_opts.global_ranks_in_group):  # the default group: the world communicator
        owns = current_world() is None
        comm = ddl.init(store=store, rank=rank, size=size)
    else:
        opts, host = Options.from_env(), None
        if opts.topology:
            # DDL_TOPOLOGY describes the world: a sub-group keeps each member's emulated node.
            world = topology.parse(opts.topology, dist.get_world_size(), dist.get_rank())
            host = f"{host_id()}|emulated node {world.node_of(dist.get_rank())}"
            opts = opts.replace(topology="")
        bootstrap = StoreBootstrap(store, rank, size, timeout=opts.timeout, prefix="ddl_triton/group",
                                   world_rank=dist.get_rank(), world_size=dist.get_world_size(), host=host)
        comm, owns = Communicator(bootstrap, opts), True
    p2p = GlooPointToPoint(dist.PrefixStore("ddl_triton/p2p/", store), rank, size, comm.options.timeout,
                           comm.placement.describe)
    return DdlProcessGroup(comm, p2p, owns_comm=owns)


def register() -> None:
    """Register backend "ddl" (CPU and CUDA) and the ``ddl://`` rendezvous, and let ``env://`` fall
    back to MPI under an MPI launcher with no MASTER_ADDR (rendezvous.py). Idempotent."""
    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    if plugin is None or plugin.creator_fn is not create_process_group:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    rendezvous.register()
