"""The ranks as a grid of levels, innermost first, in the manner of DDL's X x Y x Z.

X is the ranks in a node (their messages go over shared memory), Y the nodes in a
rack, Z the racks (their messages go over MPI). Rank r sits at coordinates
``x = r % X, y = (r // X) % Y, z = r // (X*Y)``, so a node holds X consecutive ranks.

The levels are detected with ``MPI.Comm.Split_type(COMM_TYPE_SHARED)``; the
``DDL_TOPOLOGY="XxY[xZ]"`` option overrides that, so one host can emulate several
nodes whose "inter-node" messages really travel over MPI.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*\d+(\s*x\s*\d+){0,2}\s*$")


@dataclass(frozen=True)
class Topology:
    """``dims`` innermost first (X, Y[, Z]); ``source`` says where they came from."""

    dims: tuple[int, ...]
    source: str

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def ranks_per_node(self) -> int:
        return self.dims[0]

    @property
    def nodes(self) -> int:
        return self.size // self.dims[0]

    @property
    def signature(self) -> str:
        """Compact key for tuning tables and explanations, e.g. "2x2"."""
        return "x".join(map(str, self.dims))

    def node_of(self, rank: int) -> int:
        return rank // self.dims[0]

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            out.append(rank % d)
            rank //= d
        return tuple(out)

    def __str__(self) -> str:
        names = ("ranks/node", "nodes/rack", "racks")
        levels = ", ".join(f"{d} {names[i]}" for i, d in enumerate(self.dims))
        lines = [f"Topology {self.signature} ({levels}; {self.source})"]
        for node in range(self.nodes):
            ranks = range(node * self.dims[0], (node + 1) * self.dims[0])
            where = "" if len(self.dims) == 1 else f" {self.coords(node * self.dims[0])[1:]}"
            lines.append(f"  node {node}{where}: ranks {' '.join(map(str, ranks))}")
        return "\n".join(lines)


def parse(spec: str, size: int, rank: int = 0) -> Topology:
    """Parse "XxY[xZ]" and check it describes exactly ``size`` ranks."""
    if not _SPEC.match(spec or ""):
        raise ValueError(f"rank {rank}: DDL_TOPOLOGY={spec!r} is not of the form XxY or XxYxZ (e.g. 2x2)")
    dims = tuple(int(p) for p in spec.lower().replace(" ", "").split("x"))
    if any(d < 1 for d in dims):
        raise ValueError(f"rank {rank}: DDL_TOPOLOGY={spec!r} has an empty dimension")
    if math.prod(dims) != size:
        raise ValueError(f"rank {rank}: DDL_TOPOLOGY={spec!r} describes {math.prod(dims)} ranks, "
                         f"but the communicator has {size}")
    return Topology(dims, f"DDL_TOPOLOGY={spec}")


def detect(node_of_rank: list[int]) -> Topology:
    """The grid implied by which node each rank is on (as found by Split_type).

    A regular layout (every node the same size, ranks node-contiguous) gives (X, nodes);
    anything else is described as one flat level, with the reason in ``source``.
    """
    size = len(node_of_rank)
    nodes = sorted(set(node_of_rank))
    per_node = [node_of_rank.count(n) for n in nodes]
    x = per_node[0]
    contiguous = all(node_of_rank[r] == node_of_rank[(r // x) * x] for r in range(size))
    if len(set(per_node)) == 1 and contiguous:
        dims = (x,) if len(nodes) == 1 else (x, len(nodes))
        return Topology(dims, "detected with MPI Split_type(COMM_TYPE_SHARED)")
    return Topology((size,), "detected: irregular node layout, treated as flat")
