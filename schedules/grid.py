"""Topology-aware allreduce over a grid of ranks: DDL's multi-dimensional schedule and the
classic two-level hierarchical one, built from per-dimension reduce-scatter/all-gather phases.

Naive semantics, for a grid (X, Y, Z) (X ranks in a node, Y nodes in a rack, Z racks;
rank = x + X*(y + Y*z)):

    reduce-scatter along x   (every x-line of X ranks; each rank keeps 1/X of the data)
    reduce-scatter along y   (on that 1/X: each rank keeps 1/(XY))
    reduce-scatter along z   (each rank now owns 1/(XYZ), fully reduced)
    all-gather along z, then y, then x                       (the reverse order)

Each dimension runs its own algorithm (ring, rhd or direct), the one that suits its
links: a ring inside a node over shared memory, halving-doubling across many nodes.
``hierarchical`` is the two-level case: grid (X, nodes), ring inside the node over
shm, ring between nodes over MPI on 1/X of the data.

Pipelining across levels: the buffer is cut into super-chunks of ``chunk_elems * X``
elements. Super-chunk j runs phase p at time j + p, so while chunk j crosses the
network (phase 1) chunk j+1 is being reduced inside the node (phase 0):

    time:       0       1       2       3       4
    chunk 0:  rs x    rs y    ag y    ag x
    chunk 1:          rs x    rs y    ag y    ag x
"""
from __future__ import annotations

import math

from . import one_shot, ring
from .ir import IN, OUT, Schedule, Span, Step, assemble

PHASE_ALGORITHMS = ("ring", "rhd", "direct")


def _phases(algo: str):
    """(reduce_scatter_phase, all_gather_phase) of a per-dimension algorithm."""
    if algo == "ring":
        return ring.reduce_scatter_phase, ring.all_gather_phase
    if algo == "direct":
        return one_shot.reduce_scatter_phase, one_shot.all_gather_phase
    if algo == "rhd":
        from . import rhd
        return rhd.reduce_scatter_phase, rhd.all_gather_phase
    raise ValueError(f"unknown per-dimension algorithm {algo!r}; valid: {', '.join(PHASE_ALGORITHMS)}")


def lines(dims: tuple[int, ...], d: int) -> list[tuple[int, ...]]:
    """Every group of ranks that differ only in coordinate ``d``, each ordered by that coordinate."""
    stride = math.prod(dims[:d])
    groups = []
    for r in range(math.prod(dims)):
        if (r // stride) % dims[d] == 0:
            groups.append(tuple(r + i * stride for i in range(dims[d])))
    return groups


def build_grid(name: str, collective: str, nranks: int, count: int, *, chunk_elems: int,
               dims: tuple[int, ...], algos: tuple[str, ...]) -> Schedule:
    """Allreduce over the grid ``dims`` (innermost first) with ``algos[d]`` along dimension d."""
    if collective != "allreduce":
        raise ValueError(f"{name}: unsupported collective {collective!r}")
    if math.prod(dims) != nranks:
        raise ValueError(f"{name}: grid {'x'.join(map(str, dims))} does not have {nranks} ranks")
    if len(algos) != len(dims):
        raise ValueError(f"{name}: {len(algos)} algorithms for {len(dims)} dimensions")
    active = [d for d in range(len(dims)) if dims[d] > 1]
    drafts: list[list[Step]] = [[] for _ in range(nranks)]
    if not active:
        if count:
            drafts[0].append(Step(count, src=Span(IN, 0, count), dst=Span(OUT, 0, count), final=True, label="local"))
        return assemble(name, collective, nranks, count, count, drafts,
                        params={"chunk_elems": chunk_elems, "dims": dims, "algos": algos})
    super_elems = chunk_elems * dims[active[0]]
    n_super = -(-count // super_elems) if count else 0
    per_chunk = [_chunk_phases(dims, active, algos, (j * super_elems, min(super_elems, count - j * super_elems)),
                               chunk_elems) for j in range(n_super)]
    n_phases = 2 * len(active)
    for t in range(n_super + n_phases - 1):
        for j in range(max(0, t - n_phases + 1), min(n_super, t + 1)):
            phase = per_chunk[j][t - j]
            for r, steps in phase.items():
                drafts[r] += steps
    return assemble(name, collective, nranks, count, count, drafts,
                    params={"chunk_elems": chunk_elems, "dims": dims, "algos": algos})


def _chunk_phases(dims, active, algos, region, chunk_elems) -> list[dict[int, list[Step]]]:
    """The 2*len(active) phases of one super-chunk, each as draft steps per world rank."""
    owned = {r: region for r in range(math.prod(dims))}
    history = []
    phases: list[dict[int, list[Step]]] = []
    for i, d in enumerate(active):
        rs, _ = _phases(algos[d])
        phase: dict[int, list[Step]] = {}
        new_owned = {}
        for group in lines(dims, d):
            reg = owned[group[0]]  # every member of a line owns the same region here
            if reg[1] == 0:
                new_owned.update({w: (reg[0], 0) for w in group})
                continue
            steps, got = rs(group, reg, chunk_elems, final=i == len(active) - 1)
            phase.update(steps)
            new_owned.update(got)
        history.append((d, owned))
        owned = new_owned
        phases.append(phase)
    for d, before in reversed(history):
        _, ag = _phases(algos[d])
        phase = {}
        for group in lines(dims, d):
            reg = before[group[0]]
            if reg[1] == 0:
                continue
            phase.update(ag(group, reg, {w: owned[w] for w in group}, chunk_elems))
        owned = before
        phases.append(phase)
    return phases


def build_multidim(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0,
                   grid: tuple[int, ...] | None = None, algos: tuple[str, ...] | None = None) -> Schedule:
    """DDL's grid allreduce over every dimension of ``grid`` (default: flat)."""
    dims = tuple(grid) if grid else (nranks,)
    algos = tuple(algos) if algos else default_algorithms(dims)
    return build_grid("multidim", collective, nranks, count, chunk_elems=chunk_elems, dims=dims, algos=algos)


def build_hierarchical(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0,
                       grid: tuple[int, ...] | None = None, algos: tuple[str, ...] | None = None) -> Schedule:
    """Intra-node reduce-scatter, inter-node allreduce on 1/X of the data, intra-node all-gather."""
    dims = tuple(grid) if grid else (nranks,)
    two_level = (dims[0], nranks // dims[0])
    algos = tuple(algos) if algos else ("ring", "ring")
    return build_grid("hierarchical", collective, nranks, count, chunk_elems=chunk_elems, dims=two_level,
                      algos=algos)


def default_algorithms(dims: tuple[int, ...]) -> tuple[str, ...]:
    """Ring inside a node (bandwidth-optimal over shm); rhd across nodes (log-depth latency)."""
    return tuple("ring" if d == 0 else "rhd" for d in range(len(dims)))
