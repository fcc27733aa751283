"""The CPU wiring of a communicator: one transport per peer, as its placement says.

Semantics: ``connect`` opens the transports that carry CPU tensors and returns them with
the route (the transport per peer) and the control channel:
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
It is collective over the bootstrap: every rank calls it at the same point. Where more
ranks share a host than this process may use cores, the transports wait without spinning.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...options import Options
from ...transports import link_emulation
from ...transports.gloo import GlooTransport
from ...transports.mpi import MpiTransport
from ...transports.self_transport import SelfTransport
from ...transports.shm import ShmTransport
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
    if size == 1:
        loop = SelfTransport()
        return Wiring([loop], [loop], None, control)
    node = bootstrap.split(placement.node_of_rank[rank])
    if bootstrap.kind == "mpi":
        between = MpiTransport(control, link_emulation.parse(options.link_emulation))
        if not placement.every_peer_on_shm and between.has_group_allreduce:
            # Every rank or none (the nodes partition the ranks): the communicators of the ranks
            # with one index inside their nodes, for hierarchical_native's group steps. MPI's Split
            # has no deadline: it starts once the bootstrap's barrier (which has one) shows every rank here.
            bootstrap.barrier()
            between.split_for_groups(placement.on_node.index(rank))
    else:
        if options.link_emulation:
            raise ValueError(f"rank {rank}: DDL_LINK_EMULATION emulates the MPI transport, but these "
                             "ranks were not launched by MPI: their inter-node transport is gloo")
        between = control = GlooTransport(bootstrap.store_for("gloo"), rank, size, options.timeout)
    transports: list = [between]
    shm = None
    try:
        if "shm" in placement.links:
            shm = ShmTransport(node, list(placement.on_node), slot_bytes=options.chunk_bytes,
                               depth=options.pipeline_depth, lane_bytes=LANE_BYTES)
            transports.append(shm)
            if isinstance(between, MpiTransport):
                shm.keep_moving = between.push_sends  # an MPI send must move while we wait on shm
    finally:
        node.close()
    host = placement.host_of_rank
    if host.count(host[rank]) > len(os.sched_getaffinity(0)):
        # More ranks than cores here: a spinning wait would hold the core its peer needs.
        for t in transports:
            t.spin = 0.0
    route = [None if p == rank else shm if placement.links[p] == "shm" else between for p in range(size)]
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
        lane = CallLane(wire, rank, size, TWO_SIDED_SMALL_BYTES, options.timeout, between.spin, between)
    return Wiring(transports, route, shm, control, lane)
