"""``host_group()``: the torch process group of this rank's host, for per-step reduction inside it.

Outer-sync training across slow links (ddl_triton/torch/diloco.py with ``replicas="hosts"``) keeps
the ranks of one host a single replica: DDP over this group reduces their gradients every step
over shared memory, and only the outer sync crosses the slow link::

    model = DDP(model, process_group=ddt.host_group())
    with ddt.DiLoCo(model, inner, outer, sync_every=100, replicas="hosts"): ...

A host is a node of the communicator's placement (``DDL_TOPOLOGY=2x2`` emulates two). Collective:
every rank of the default group calls it, at the same point (torch's ``new_subgroups_by_enumeration``,
one group per host, made by every rank); ``backend`` defaults to the default group's.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["host_group", "host_ranks"]


def host_ranks(comm=None) -> list[list[int]]:
    """The ranks of each host, hosts in order of their first rank (``comm``: default ``ddl_triton.init()``)."""
    if comm is None:
        import ddl_triton
        comm = ddl_triton.init()
    nodes: dict[int, list[int]] = {}
    for r, node in enumerate(comm.placement.node_of_rank):
        nodes.setdefault(node, []).append(r)
    return list(nodes.values())


def host_group(comm=None, backend: str | None = None):
    """This rank's host's process group (module doc). ValueError naming the rank when the default
    group is not initialized or is not ``comm``'s world."""
    if comm is None:
        import ddl_triton
        comm = ddl_triton.init()
    if not dist.is_initialized() or dist.get_world_size() != comm.size or dist.get_rank() != comm.rank:
        raise ValueError(f"rank {comm.rank}: host_group: torch.distributed's default group must be initialized over "
                         f"the same ranks as the communicator ({comm.size} ranks)")
    group, _ = dist.new_subgroups_by_enumeration(host_ranks(comm), backend=backend or dist.get_backend())
    return group
