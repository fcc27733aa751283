"""The transport table: which transport carries the messages between two ranks, in order of preference.

Semantics: ``TRANSPORTS`` is an ordered list of rows, one per transport that carries data. The
transport between ranks a and b of a communicator, for tensors of one kind ("cpu" or "cuda"), is
the first row of that kind whose ``can_connect`` accepts the pair's placement facts (``Pair``),
the options and the bootstrap kind ("mpi" or "store"). This is NCCL's ``ncclTransports[]`` walked
by ``selectTransport``: each transport's ``canConnect`` says whether it can join two peers, and the
first that can wins. Every rank evaluates the same rows on the same facts, so the two ranks of a
pair always agree on the transport between them, and every rank can tell what any other pair chose.

Who reads it: placement (runtime/setup/placement.py) names each peer's CPU link from it; the CPU
wiring (runtime/setup/wiring.py) and the GPU path (runtime/calls/gpu_path.py) open what it chose
(``to_open``), each with the transport's own ``open_for`` (see ``Row``). A new transport is its
module plus one row here (docs/design.md, "Adding a transport").

The rows today, first preferred:
    cpu   self   a world of one: the rank itself (self_transport.py)
          shm    two ranks of one node, ``Options.transport`` "auto" (shm.py)
          mpi    any two ranks, under an MPI bootstrap (mpi.py)
          gloo   any two ranks, under a store bootstrap (gloo.py)
    cuda  self   a world of one, unless ``Options.transport`` is "nvshmem" (self_transport.py)
          nvshmem two ranks of one node, where nvshmem4py is importable, some node holds two ranks
                 (or "nvshmem" is asked for) and ``Options.transport`` is not "mpi" (nvshmem.py)
          mpi    any two ranks, host-staged or CUDA-aware (mpi_device.py)
This module imports neither torch, MPI nor nvshmem: a transport's module loads when it is opened.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Pair:
    """What the table may know of two ranks a and b of one communicator: placement facts only, the
    same on every rank. ``same_rank``: a is b; ``same_node``: one (possibly emulated) node holds
    both; ``same_host``: one host does; ``size``: the communicator's ranks; ``max_ranks_per_node``:
    the most ranks any of its nodes holds."""

    same_rank: bool
    same_node: bool
    same_host: bool
    size: int
    max_ranks_per_node: int

    @classmethod
    def of(cls, a: int, b: int, node_of_rank, host_of_rank) -> "Pair":
        """The facts of ranks ``a`` and ``b`` given each rank's node and host."""
        return cls(a == b, node_of_rank[a] == node_of_rank[b], host_of_rank[a] == host_of_rank[b],
                   len(node_of_rank), _most_per_node(node_of_rank))

    @classmethod
    def node_mates(cls, size: int, max_ranks_per_node: int) -> "Pair":
        """Two distinct ranks of one node of such a communicator (what a path asks when it says
        why its traffic within a node takes the transport it takes)."""
        return cls(False, True, True, size, max_ranks_per_node)


class CannotOpen(Exception):
    """An opener found its transport cannot serve this communicator after all (the message says
    why); the pairs that chose it take their next row."""


@dataclass(frozen=True)
class Row:
    """One transport of the table.

    ``name``: the transport's name, as links, ``transport_bytes`` and errors show it; ``module``:
    its module in transports/; ``carries``: "cpu" or "cuda" tensors; ``refuses(pair, options,
    bootstrap_kind)``: "" when it can connect the pair, else why not (in words an error can show);
    ``opened_by``: "communicator" when opening it is collective over every rank (each rank opens it
    where the table chose it for any pair), "node" when only the ranks it connects open it, together.
    Opening calls the module's ``open_for(opening)`` (an ``Opening``), or ``opener`` when given."""

    name: str
    module: str
    carries: str
    refuses: Callable[[Pair, object, str], str]
    opened_by: str = "communicator"
    opener: Callable[["Opening"], object] | None = field(default=None, compare=False)

    def can_connect(self, pair: Pair, options, bootstrap_kind: str) -> bool:
        return not self.refuses(pair, options, bootstrap_kind)

    def open(self, opening: "Opening"):
        """This row's transport for ``opening``'s communicator; CannotOpen where it cannot serve."""
        if self.opener is not None:
            return self.opener(opening)
        return importlib.import_module(f"{__package__}.{self.module}").open_for(opening)


@dataclass
class Opening:
    """What an opener may use, given by the path that opens (wiring or the GPU path).

    ``placement``: the communicator's (runtime/setup/placement.py); ``bootstrap``: its bootstrap
    (``kind``, ``comm``, ``split``, ``store_for``, ``barrier``); ``control``: its private MPI
    communicator, the gloo transport, or None; ``node``: the sub-bootstrap of this rank's node, for
    transports opened by a node; ``device``: the CUDA device, for CUDA rows; ``opened``: the
    transports opened so far, by row name; ``lane_bytes``: what a one-sided transport reserves per
    peer for the small-message lane; ``gather_ints(comm, value, what)``: every rank's int over an
    MPI communicator, bounded by the deadline and checked."""

    placement: object
    options: object
    bootstrap: object = None
    control: object = None
    node: object = None
    device: object = None
    opened: dict = field(default_factory=dict)
    lane_bytes: int = 0
    gather_ints: Callable | None = None


def nvshmem_importable() -> bool:
    """Whether nvshmem4py can be imported here (a seam: the GPU transports' CPU tests claim it)."""
    return importlib.util.find_spec("nvshmem") is not None


def _self(pair: Pair, options, bootstrap_kind: str) -> str:
    return "" if pair.same_rank else "the ranks differ"


def _self_cuda(pair: Pair, options, bootstrap_kind: str) -> str:
    if options.transport == "nvshmem" and pair.same_rank:
        return "Options.transport is 'nvshmem': NVSHMEM must serve, even a world of one"
    return _self(pair, options, bootstrap_kind)


def _shm(pair: Pair, options, bootstrap_kind: str) -> str:
    if options.transport != "auto":
        return f"Options.transport is {options.transport!r}"
    return "" if pair.same_node and not pair.same_rank else "the ranks are on different nodes"


def _mpi(pair: Pair, options, bootstrap_kind: str) -> str:
    return "" if bootstrap_kind == "mpi" else "MPI did not launch these ranks"


def _gloo(pair: Pair, options, bootstrap_kind: str) -> str:
    return "" if bootstrap_kind == "store" else "the ranks met through MPI, which carries their messages"


def _nvshmem(pair: Pair, options, bootstrap_kind: str) -> str:
    if options.transport == "mpi":
        return "Options.transport is 'mpi'"
    if not nvshmem_importable():
        return "nvshmem4py is not installed"
    if pair.max_ranks_per_node == 1 and options.transport != "nvshmem":
        # Decided from the whole layout, not this node alone: opening NVSHMEM is collective.
        return "no node holds more than one rank"
    return "" if pair.same_node else "the ranks are on different nodes"


def _any(pair: Pair, options, bootstrap_kind: str) -> str:
    return ""


# In preference order, per kind of tensor. Every module of transports/ that carries data has a row
# (tests/unit/test_transport_table.py checks it).
TRANSPORTS: list[Row] = [
    Row("self", "self_transport", "cpu", _self),
    Row("shm", "shm", "cpu", _shm, opened_by="node"),
    Row("mpi", "mpi", "cpu", _mpi),
    Row("gloo", "gloo", "cpu", _gloo),
    Row("self", "self_transport", "cuda", _self_cuda),
    Row("nvshmem", "nvshmem", "cuda", _nvshmem),
    Row("mpi", "mpi_device", "cuda", _any),
]


def rows(carries: str) -> list[Row]:
    """The rows for ``carries`` ("cpu" or "cuda") tensors, first preferred."""
    if carries not in KINDS:
        raise ValueError(f"the transport table knows {' and '.join(KINDS)} tensors, not {carries!r}")
    return [row for row in TRANSPORTS if row.carries == carries]


def named(name: str, carries: str) -> Row | None:
    """The row called ``name`` for ``carries`` tensors, or None."""
    return next((row for row in rows(carries) if row.name == name), None)


def choose(pair: Pair, options, bootstrap_kind: str, carries: str, unusable=()) -> Row:
    """The first row for ``carries`` tensors that can connect ``pair``, skipping the rows named in
    ``unusable`` (opened, and found unable to serve). ValueError when none can."""
    for row in rows(carries):
        if row.name not in unusable and row.can_connect(pair, options, bootstrap_kind):
            return row
    why = "; ".join(f"{row.name}: {row.refuses(pair, options, bootstrap_kind) or 'could not be opened'}"
                    for row in rows(carries))
    raise ValueError(f"no transport connects these ranks ({pair}) for {carries} tensors: {why}")


def why_not_preferred(pair: Pair, options, bootstrap_kind: str, carries: str, failed: dict) -> str:
    """Why ``pair`` does not take a row the table prefers to the one it takes: the refusal (or, from
    ``failed``, row name -> why, the failure to open) of the nearest row ahead of it, the self row
    aside (it only ever connects a rank to itself); "" when nothing preferred was passed over."""
    chosen = choose(pair, options, bootstrap_kind, carries, failed)
    why = ""
    for row in rows(carries):
        if row == chosen:
            return why
        if row.name != "self":
            why = failed.get(row.name) or row.refuses(pair, options, bootstrap_kind)
    return why


def links(rank: int, node_of_rank, host_of_rank, options, bootstrap_kind: str, carries: str,
          unusable=()) -> tuple[Row, ...]:
    """The row chosen between ``rank`` and each rank of the communicator (its own pair included)."""
    size, per_node = len(node_of_rank), _most_per_node(node_of_rank)
    chosen: dict[Pair, Row] = {}  # a few distinct facts however many ranks: choose once for each
    out = []
    for p in range(size):
        pair = Pair(p == rank, node_of_rank[p] == node_of_rank[rank], host_of_rank[p] == host_of_rank[rank],
                    size, per_node)
        if pair not in chosen:
            chosen[pair] = choose(pair, options, bootstrap_kind, carries, unusable)
        out.append(chosen[pair])
    return tuple(out)


def between_nodes(size: int, max_ranks_per_node: int, options, bootstrap_kind: str, carries: str) -> Row:
    """The row that connects two ranks of different hosts: the two-sided engine a communicator of
    several ranks always opens (its control channel, its call lane, and every path's fallback)."""
    return choose(Pair(False, False, False, size, max_ranks_per_node), options, bootstrap_kind, carries)


def to_open(rank: int, node_of_rank, host_of_rank, options, bootstrap_kind: str, carries: str,
            unusable=()) -> list[Row]:
    """The rows ``rank`` opens: unless its communicator is a world of one on the loopback, first
    the row between nodes (``between_nodes``: the others may lean on it); then, in table order,
    the rows chosen for its pairs with its peers (its own pair too in a world of one), and the
    rows opened by the communicator that the table chose for any pair of it."""
    size, per_node = len(node_of_rank), _most_per_node(node_of_rank)
    mine = links(rank, node_of_rank, host_of_rank, options, bootstrap_kind, carries, unusable)
    if size == 1 and mine[0].name == "self":
        return [mine[0]]
    first = between_nodes(size, per_node, options, bootstrap_kind, carries)
    wanted = {mine[p] for p in range(size) if p != rank or size == 1}
    for pair in _pairs_present(node_of_rank, host_of_rank):
        row = choose(pair, options, bootstrap_kind, carries, unusable)
        if row.opened_by == "communicator":
            wanted.add(row)
    return [first] + [row for row in rows(carries) if row in wanted and row != first]


def _most_per_node(node_of_rank) -> int:
    counts: dict[int, int] = {}
    for n in node_of_rank:
        counts[n] = counts.get(n, 0) + 1
    return max(counts.values())


def _pairs_present(node_of_rank, host_of_rank) -> set[Pair]:
    """The facts of every pair of two distinct ranks of the communicator (at most three kinds:
    one node; one host, two nodes; two hosts), in time linear in its size."""
    size, per_node = len(node_of_rank), _most_per_node(node_of_rank)
    nodes_of_host: dict[int, set[int]] = {}
    for n, h in zip(node_of_rank, host_of_rank):
        nodes_of_host.setdefault(h, set()).add(n)
    present = set()
    if per_node > 1:
        present.add(Pair(False, True, True, size, per_node))
    if any(len(nodes) > 1 for nodes in nodes_of_host.values()):
        present.add(Pair(False, False, True, size, per_node))
    if len(nodes_of_host) > 1:
        present.add(Pair(False, False, False, size, per_node))
    return present
