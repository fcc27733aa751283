"""Placement: who is where in a communicator, and how each peer is reached.

Semantics: a :class:`Placement` is fixed when the communicator is made and never changes.
It holds the grid of ranks (``Options.topology``, else the detected hosts), each rank's
node and host, the ranks that share this rank's node, and the name of the link that
carries this rank's messages to each peer: the transport table's choice for CPU tensors
(transports/table.py: "self", "shm" inside a node, else "mpi" under an MPI bootstrap and
"gloo" over a store). The CPU wiring (wiring.py), the GPU
path (gpu_path.py), the planner (``link``) and the tuner all read this one object, so
they can never disagree about where a rank is.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ...errors import name_peer
from ...options import Options
from ...planning import topology as topology_mod
from ...planning.topology import Topology
from ...transports import table


@dataclass(frozen=True)
class Placement:
    """This rank's view of where every rank of its communicator sits."""

    rank: int
    size: int
    topology: Topology
    node_of_rank: tuple[int, ...]   # each rank's (possibly emulated) node
    host_of_rank: tuple[int, ...]   # each rank's host, named by the lowest rank on it
    on_node: tuple[int, ...]        # the ranks of this rank's node, this one included (NVSHMEM spans them)
    links: tuple[str, ...]          # per peer, the transport that reaches it ("self" for this rank)
    transport: str                  # Options.transport: "mpi" sends everything over the inter-node link
    host_names: tuple[str, ...] = ()  # each rank's host name, when the ranks span hosts (for errors)
    pids: tuple[int, ...] = ()        # each rank's process id, likewise
    bootstrap_kind: str = "mpi"       # how the ranks met: "mpi", or "store" (the transport table reads it)

    def link(self, a: int, b: int) -> str:
        """The planner's link class between ranks ``a`` and ``b``: "shm" inside a node, else "mpi"
        (what the cost model prices, whichever engine carries the inter-node bytes)."""
        if self.transport == "mpi" or self.node_of_rank[a] != self.node_of_rank[b]:
            return "mpi"
        return "shm"

    @property
    def spans_hosts(self) -> bool:
        return len(set(self.host_of_rank)) > 1

    def describe(self, peer: int) -> str:
        """``peer`` as every error names it, with its host: "rank 2 on h2" (ddl_triton/errors.py:
        ``name_peer``, which also narrows a wait on every rank at once, ``peer`` < 0)."""
        return name_peer(self, peer)

    @property
    def every_peer_on_shm(self) -> bool:
        """Whether shared memory reaches every peer (true of a single rank: it has none)."""
        return all(self.links[p] == "shm" for p in range(self.size) if p != self.rank)

    @property
    def max_ranks_per_node(self) -> int:
        """The most ranks any node holds (deciding collective steps alike on every rank)."""
        return max(self.node_of_rank.count(n) for n in set(self.node_of_rank))


def place(bootstrap, options: Options) -> Placement:
    """The placement of ``bootstrap``'s ranks under ``options`` (a collective call: every rank
    of the bootstrap learns every rank's host). Raises ValueError when ``Options.topology``
    puts ranks of different hosts in one node."""
    rank, size = bootstrap.rank, bootstrap.size
    if size == 1:
        return Placement(rank, size, Topology((1,), "a single rank"), (0,), (0,), (0,),
                         _links(rank, (0,), (0,), options, bootstrap.kind), options.transport,
                         bootstrap_kind=bootstrap.kind)
    host_of_rank = tuple(bootstrap.host_of_rank())  # for each rank, the lowest rank on its host
    if options.topology:
        topology = topology_mod.parse(options.topology, size, rank)
        node_of_rank = tuple(topology.node_of(r) for r in range(size))
        for r in range(size):
            first = topology.node_of(r) * topology.ranks_per_node
            if host_of_rank[r] != host_of_rank[first]:
                raise ValueError(f"rank {rank}: DDL_TOPOLOGY={options.topology} puts ranks {first} "
                                 f"and {r} in one node, but they run on different hosts")
    else:
        topology = topology_mod.detect(list(host_of_rank))
        node_of_rank = host_of_rank
    on_node = tuple(r for r in range(size) if node_of_rank[r] == node_of_rank[rank])
    links = _links(rank, node_of_rank, host_of_rank, options, bootstrap.kind)
    # Across hosts, errors name each rank's host, and tell a rank of this host that has exited (its pid).
    names, pids = zip(*_every_name_and_pid(bootstrap)) if len(set(host_of_rank)) > 1 else ((), ())
    return Placement(rank, size, topology, node_of_rank, host_of_rank, on_node, links, options.transport,
                     tuple(names), tuple(pids), bootstrap.kind)


def _links(rank: int, node_of_rank, host_of_rank, options: Options, bootstrap_kind: str) -> tuple[str, ...]:
    """Per peer, the transport the table chooses for CPU tensors between ``rank`` and it."""
    return tuple(row.name for row in table.links(rank, node_of_rank, host_of_rank, options, bootstrap_kind, "cpu"))


def _every_name_and_pid(bootstrap) -> list[list]:
    """Every rank's [host name, pid], checked (they go into error messages and liveness checks)."""
    from .bootstrap_values import BootstrapError, shaped

    every = bootstrap.allgather([socket.gethostname(), os.getpid()])
    for r, value in enumerate(every):
        if shaped(value, (str, int), f"rank {r}'s host name and pid", bootstrap.rank)[1] < 1:
            raise BootstrapError(f"rank {bootstrap.rank}: rank {r} sent pid {value[1]}")
    return every
