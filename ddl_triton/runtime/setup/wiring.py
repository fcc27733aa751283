"""The CPU wiring of a communicator: one transport per peer, as its placement says.

Semantics: ``connect`` opens the transports that carry CPU tensors and returns them with
the route (the transport per peer) and the control channel. Which transport serves which
peer is the transport table's choice (transports/table.py), which the placement's links
name; as the table stands:
- inside a (possibly emulated) node of several ranks, host shared memory (shm), unless
  ``Options.transport`` is "mpi";
- between nodes, MPI on an MPI bootstrap and gloo on a store bootstrap (which then is the
  control channel too: the call lane, the barrier, clock alignment);
- a communicator of one rank talks to itself;
- between nodes over MPI, one more MPI communicator per index inside a node, for the group
  steps of schedules/native.py (gloo makes its groups' process groups on first use);
- where any peer is reached over MPI or gloo, the call lane (call_lane.py) over the control
  channel: the call check's messages, which carry small allreduces' data, to every peer
  (small_allreduce_two_sided.py), peers on shm included.
A communicator of several ranks always opens the table's row between nodes (MPI or gloo):
it is the control channel and carries the call lane, even where every peer is on shm.
It is collective over the bootstrap: every rank calls it at the same point. Where more
ranks share a host than this process may use cores, the transports wait without spinning.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...options import Options
from ...transports import table
from ..lanes.call_lane import CallLane
from ..lanes.lane_sockets import LaneSockets
from .placement import Placement
from ..lanes.small_allreduce import LANE_BYTES
from ..lanes.small_allreduce_two_sided import LIMIT_BYTES as TWO_SIDED_SMALL_BYTES


@dataclass
class Wiring:
    """What ``connect`` opened for one communicator."""

    transports: list    # every transport opened (closed with the communicator)
    route: list         # per peer, the transport that carries its messages (None for this rank)
    shm: object         # the shm transport, or None where no peer is on shm
    control: object     # the control channel: the private MPI communicator, the gloo transport,
                        # or None (a store bootstrap of one rank: nobody to talk to)
    lane: CallLane | None = None  # the call lane, where some peer is reached over MPI or gloo


def connect(placement: Placement, bootstrap, options: Options) -> Wiring:
    """Open the transports ``placement.links`` names (see the module doc)."""
    rank, size = placement.rank, placement.size
    control = bootstrap.comm if bootstrap.kind == "mpi" else None
    rows = table.to_open(rank, placement.node_of_rank, placement.host_of_rank, options, bootstrap.kind, "cpu")
    opening = table.Opening(placement, options, bootstrap, control, lane_bytes=LANE_BYTES)
    if size == 1:
        loop = rows[0].open(opening)
        return Wiring([loop], [loop], None, control)
    opening.node = bootstrap.split(placement.node_of_rank[rank])
    try:
        for row in rows:  # the row between nodes first
            opening.opened[row.name] = row.open(opening)
    finally:
        opening.node.close()
    transports = list(opening.opened.values())
    between = transports[0]
    if bootstrap.kind != "mpi":
        control = between  # gloo: the control channel too
    shm = opening.opened.get("shm")
    if shm is not None and hasattr(between, "push_sends"):
        shm.keep_moving = between.push_sends  # an MPI send must move while we wait on shm
    host = placement.host_of_rank
    if host.count(host[rank]) > len(os.sched_getaffinity(0)):
        # More ranks than cores here: a spinning wait would hold the core its peer needs.
        for t in transports:
            t.spin = 0.0
    route = [None if p == rank else opening.opened[placement.links[p]] for p in range(size)]
    lane = None
    if not placement.every_peer_on_shm:
        # Every rank takes this branch or none (the nodes partition the ranks): the lane is collective,
        # and so is its data limit, which sizes every peer's receive buffer. Small allreduces ride in
        # it on every such communicator, peers on shm included: their lane messages go over the
        # two-sided transport too (MPI's own shared memory within a host), because one message per
        # peer beats the general path's shm and MPI phases by about 6x where ranks share a host's
        # cores (2 emulated hosts x 2 ranks on 2 cores: 8 B in 137 us against 812 us).
        # Under a store bootstrap the lane gets TCP connections of its own (lane_sockets.py): one
        # exchange through gloo's point-to-point cost 6x the time and 30x the CPU across hosts.
        if bootstrap.kind == "mpi":
            bootstrap.barrier()  # the lane duplicates the control communicator: a Dup has no deadline
        wire = control if bootstrap.kind == "mpi" else LaneSockets(bootstrap.store_for("lane"), rank, size,
                                                                   options.timeout, placement.describe)
        lane = CallLane(wire, rank, size, TWO_SIDED_SMALL_BYTES, options.timeout, between.spin, between,
                        describe=placement.describe)
    return Wiring(transports, route, shm, control, lane)
