"""Hierarchical allreduce whose inter-node phase is the inter-node transport's own allreduce.

Naive semantics, X ranks per node and N nodes (rank = x + X*node), allreduce in place:

    1. ring reduce-scatter inside each node (over shm): rank (node, x) holds the node's sum of block x
    2. one group step per block: the ranks with local index x on every node allreduce block x
       with the engine that carries their link (gloo's or MPI's own allreduce: transports/*.py)
    3. ring all-gather inside each node: every rank holds every reduced block

It is Horovod's hierarchical allreduce. ``hierarchical`` (schedules/grid.py) runs phase 2 as
steps of its own over the transport's point-to-point messages; here the engine runs it, on its
own threads and in its own buffers, so the rank's Python pays one call per block instead of a
step (a staging copy, a reduction, a message hand-off) per chunk. Under torchrun across 2 hosts
that was the difference between ddl and torch's gloo: 2.3-2.7 ms more CPU per 2 MB bucket
(bench/results/train_scaling_across_hosts.md). What phase 2 gives up is pipelining with the
node's phases: a group step starts once its block is reduced inside the node.

One rank per node (X = 1) leaves phase 2 alone: the whole tensor in one group step. One node
(N = 1) leaves phases 1 and 3: a ring allreduce, with no group step.

``expand`` turns every group step into the ring allreduce the engines run for it (a chunked
reduce-scatter and all-gather among the group's ranks), marked ``native``: that is what the
simulator's oracle checks, what the cost model and the shaped-link simulator time (as link and
reduction only: no executor step overhead, no staging copy), and what the executor runs where
a transport has no allreduce of its own (a GPU transport, an emulated link).
"""
from __future__ import annotations

from . import ring
from .grid import lines
from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble, replace_step

NAME = "hierarchical_native"


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0,
          grid: tuple[int, ...] | None = None, algos: tuple[str, ...] | None = None) -> Schedule:
    """The schedule of the module doc over ``grid`` (innermost first; its first dimension is the
    ranks per node, the rest are nodes); ``algos`` is not used (the inner phases are rings)."""
    if collective != "allreduce":
        raise ValueError(f"{NAME}: unsupported collective {collective!r}")
    per_node = tuple(grid)[0] if grid else nranks
    if per_node < 1 or nranks % per_node:
        raise ValueError(f"{NAME}: {nranks} ranks do not fill nodes of {per_node}")
    dims = (per_node, nranks // per_node)
    params = {"chunk_elems": chunk_elems, "dims": dims}
    drafts: list[list[Step]] = [[] for _ in range(nranks)]
    if count == 0:
        return assemble(NAME, collective, nranks, 0, 0, drafts, params=params)
    if nranks == 1:
        drafts[0].append(Step(count, src=Span(IN, 0, count), dst=Span(OUT, 0, count), final=True, label="local"))
        return assemble(NAME, collective, nranks, count, count, drafts, params=params)
    whole = (0, count)
    owned = {r: whole for r in range(nranks)}
    node_lines = lines(dims, 0) if per_node > 1 else []
    for line in node_lines:
        steps, got = ring.reduce_scatter_phase(line, whole, chunk_elems, final=dims[1] == 1)
        for r, s in steps.items():
            drafts[r] += s
        owned.update(got)
    if dims[1] > 1:
        for line in lines(dims, 1):
            start, size = owned[line[0]]  # the same block on every member: the same local index
            if size:
                span = Span(OUT, start, size)
                for r in line:
                    drafts[r].append(Step(size, src=span, dst=span, group=tuple(line), final=True,
                                          label=f"native allreduce of block {line[0] % per_node}"
                                          if per_node > 1 else "native allreduce"))
    for line in node_lines:
        for r, s in ring.all_gather_phase(line, whole, {w: owned[w] for w in line}, chunk_elems).items():
            drafts[r] += s
    return assemble(NAME, collective, nranks, count, count, drafts, params=params)


_EXPANDED: dict[int, tuple[Schedule, Schedule]] = {}


def expand(schedule: Schedule) -> Schedule:
    """``schedule`` with every group step replaced by the ring allreduce its engine runs (see the
    module doc); a schedule without group steps is returned as it is. Cached by identity."""
    if not schedule.native:
        return schedule
    hit = _EXPANDED.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    chunk = max(1, int(schedule.params.get("chunk_elems") or max(1, schedule.out_count)))
    drafts: list[list[Step]] = [[] for _ in range(schedule.nranks)]
    # A group's k-th step on each member becomes that member's share of one ring phase.
    pending: dict[tuple[tuple[int, ...], int], dict[int, list[Step]]] = {}
    taken: dict[tuple[int, tuple[int, ...]], int] = {}
    for r, steps in enumerate(schedule.steps):
        for s in steps:
            if not s.group:
                drafts[r].append(replace_step(s, msg=-1, recv=tuple(Recv(rv.peer, -1, rv.offset) for rv in s.recv)))
                continue
            k = taken.get((r, s.group), 0)
            taken[(r, s.group)] = k + 1
            ring_steps = pending.get((s.group, k))
            if ring_steps is None:
                region = (s.dst.start, s.count)
                rs, owned = ring.reduce_scatter_phase(s.group, region, chunk, final=s.final)
                ag = ring.all_gather_phase(s.group, region, owned, chunk)
                ring_steps = pending[(s.group, k)] = {w: rs[w] + ag[w] for w in s.group}
            drafts[r] += [replace_step(x, native=True, label=f"{s.label}: {x.label}") for x in ring_steps[r]]
    expanded = assemble(schedule.name, schedule.collective, schedule.nranks, schedule.in_count,
                        schedule.out_count, drafts, params=schedule.params, single_pass=schedule.single_pass)
    if len(_EXPANDED) > 64:
        _EXPANDED.clear()
    _EXPANDED[id(schedule)] = (schedule, expanded)
    return expanded
