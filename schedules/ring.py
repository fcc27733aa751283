"""Chunked, pipelined ring: reduce-scatter then all-gather (and the pieces alone).

Naive semantics: an allreduce is a reduce-scatter (rank r ends owning the full
sum of block r) followed by an all-gather of those blocks. Each rank only
talks to its ring neighbours: it sends to ``next = r+1`` and receives from
``prev = r-1``. Each block is cut into chunks of ``chunk_elems``; round k moves
chunk k of every block, so the transfer of chunk k overlaps the reduction of
chunk k-1 on the neighbour. For n = 3 ranks, one round (b = block index):

    reduce-scatter                         all-gather
    t=0  r sends in[b=r-1]                 (t=n-1 of rs also sends the owned block)
    t=1  r: in[r-2] + recv -> send         t=1 r: recv block r-1 -> out, send on
    t=2  r: in[r]   + recv -> out[r], send t=2 r: recv block r-2 -> out

Per rank it sends 2(n-1)/n of the data, the bandwidth optimum.
"""
from __future__ import annotations

from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble
from .partition import blocks, chunk_of, rounds


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    """The ring schedule of ``collective`` (see ``schedules.build`` for ``count``)."""
    if collective == "allreduce":
        return _allreduce(nranks, count, chunk_elems)
    if collective == "reduce_scatter":
        return _reduce_scatter(nranks, count, chunk_elems)
    if collective == "all_gather":
        return _all_gather(nranks, count, chunk_elems)
    if collective == "broadcast":
        return _broadcast(nranks, count, chunk_elems, root)
    raise ValueError(f"ring: unsupported collective {collective!r}")


def _reduce_scatter_steps(me: int, group: tuple[int, ...], blk: list[tuple[int, int]], k: int, chunk_elems: int,
                          out_base: int, forward_result: bool, *, src_buf: str = IN, final: bool = True
                          ) -> list[Step]:
    """Round k of the reduce-scatter on member ``me`` of ``group``, ending with it owning block ``me``.

    At step t the member works on block (me-1-t) mod n, which its predecessor worked on
    at step t-1. The final step stores the owned block at ``out_base`` (+ offset inside
    the block) of OUT and, for an allreduce, also starts the all-gather. Peers are the
    group's (world) ranks; ``src_buf`` is where the local operands live (IN, or OUT when
    the phase runs in place inside a larger schedule).
    """
    n = len(group)
    nxt, prev = group[(me + 1) % n], group[(me - 1) % n]
    steps = []
    for t in range(n):
        b = (me - 1 - t) % n
        start, size = chunk_of(blk[b], k, chunk_elems)
        if size == 0:
            continue
        src = Span(src_buf, start, size)
        label = f"rs[{t}] block {b} chunk {k}"
        if t == 0:
            steps.append(Step(size, src=src, send=(nxt,), label=label))
        elif t < n - 1:
            steps.append(Step(size, src=src, recv=(Recv(prev, -1),), reduce=True, local_pos=1,
                              send=(nxt,), label=label))
        else:
            dst = Span(OUT, out_base + start - blk[b][0], size)
            steps.append(Step(size, src=src, dst=dst, recv=(Recv(prev, -1),), reduce=True, local_pos=1,
                              send=(nxt,) if forward_result else (), final=final, label=label))
    return steps


def _all_gather_steps(me: int, group: tuple[int, ...], blk: list[tuple[int, int]], k: int,
                      chunk_elems: int) -> list[Step]:
    """Round k of the all-gather steps t=1..n-1 on member ``me`` (block ``me`` left it at t=0)."""
    n = len(group)
    nxt, prev = group[(me + 1) % n], group[(me - 1) % n]
    steps = []
    for t in range(1, n):
        b = (me - t) % n
        start, size = chunk_of(blk[b], k, chunk_elems)
        if size == 0:
            continue
        steps.append(Step(size, dst=Span(OUT, start, size), recv=(Recv(prev, -1),),
                          send=(nxt,) if t < n - 1 else (), label=f"ag[{t}] block {b} chunk {k}"))
    return steps


def reduce_scatter_phase(group: tuple[int, ...], region: tuple[int, int], chunk_elems: int, *, final: bool):
    """In-place ring reduce-scatter of OUT[region] over ``group``: member i ends owning block i.

    Returns (draft steps per world rank, owned (start, count) per world rank); see schedules/grid.py.
    """
    n = len(group)
    blk = [(region[0] + s, c) for s, c in blocks(region[1], n)]
    steps: dict[int, list[Step]] = {w: [] for w in group}
    for k in range(rounds(blk[0][1], chunk_elems)):
        for me, w in enumerate(group):
            steps[w] += _reduce_scatter_steps(me, group, blk, k, chunk_elems, out_base=blk[me][0],
                                              forward_result=False, src_buf=OUT, final=final)
    return steps, {w: blk[me] for me, w in enumerate(group)}


def all_gather_phase(group: tuple[int, ...], region: tuple[int, int], owned: dict[int, tuple[int, int]],
                     chunk_elems: int) -> dict[int, list[Step]]:
    """In-place ring all-gather over ``group``: member i starts with ``owned[group[i]]`` of OUT[region]
    and every member ends with the whole region."""
    n = len(group)
    blk = [owned[w] for w in group]
    steps: dict[int, list[Step]] = {w: [] for w in group}
    for k in range(rounds(max(c for _, c in blk), chunk_elems)):
        for me, w in enumerate(group):
            start, size = chunk_of(blk[me], k, chunk_elems)
            if size:
                steps[w].append(Step(size, src=Span(OUT, start, size), send=(group[(me + 1) % n],),
                                     label=f"ag[0] block {me} chunk {k}"))
            steps[w] += _all_gather_steps(me, group, blk, k, chunk_elems)
    return steps


def _allreduce(n: int, count: int, chunk_elems: int) -> Schedule:
    blk = blocks(count, n)
    everyone = tuple(range(n))
    drafts: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        if n == 1:
            if count:
                drafts[r].append(Step(count, src=Span(IN, 0, count), dst=Span(OUT, 0, count), final=True,
                                      label="local"))
            continue
        for k in range(rounds(blk[0][1], chunk_elems)):
            drafts[r] += _reduce_scatter_steps(r, everyone, blk, k, chunk_elems, out_base=blk[r][0],
                                               forward_result=True)
            drafts[r] += _all_gather_steps(r, everyone, blk, k, chunk_elems)
    return assemble("ring", "allreduce", n, count, count, drafts, params={"chunk_elems": chunk_elems})


def _reduce_scatter(n: int, block_count: int, chunk_elems: int) -> Schedule:
    blk = [(b * block_count, block_count) for b in range(n)]
    drafts: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        for k in range(rounds(block_count, chunk_elems)):
            if n == 1:
                start, size = chunk_of(blk[0], k, chunk_elems)
                drafts[r].append(Step(size, src=Span(IN, start, size), dst=Span(OUT, start, size), final=True,
                                      label=f"local chunk {k}"))
                continue
            drafts[r] += _reduce_scatter_steps(r, tuple(range(n)), blk, k, chunk_elems, out_base=0,
                                               forward_result=False)
    return assemble("ring", "reduce_scatter", n, n * block_count, block_count, drafts,
                    params={"chunk_elems": chunk_elems})


def _all_gather(n: int, block_count: int, chunk_elems: int) -> Schedule:
    blk = [(b * block_count, block_count) for b in range(n)]
    drafts: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        for k in range(rounds(block_count, chunk_elems)):
            lo, size = chunk_of((0, block_count), k, chunk_elems)
            drafts[r].append(Step(size, src=Span(IN, lo, size), dst=Span(OUT, r * block_count + lo, size),
                                  send=((r + 1) % n,) if n > 1 else (), label=f"ag[0] block {r} chunk {k}"))
            drafts[r] += _all_gather_steps(r, tuple(range(n)), blk, k, chunk_elems)
    return assemble("ring", "all_gather", n, block_count, n * block_count, drafts,
                    params={"chunk_elems": chunk_elems})


def _broadcast(n: int, count: int, chunk_elems: int, root: int) -> Schedule:
    """A pipelined chain root -> root+1 -> ... -> root-1, chunk by chunk."""
    drafts: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        d = (r - root) % n  # distance from the root along the chain
        for k in range(rounds(count, chunk_elems)):
            start, size = chunk_of((0, count), k, chunk_elems)
            nxt = ((r + 1) % n,) if d < n - 1 else ()
            label = f"bcast hop {d} chunk {k}"
            if d == 0:
                if nxt:
                    drafts[r].append(Step(size, src=Span(IN, start, size), send=nxt, label=label))
            else:
                drafts[r].append(Step(size, dst=Span(OUT, start, size), recv=(Recv((r - 1) % n, -1),),
                                      send=nxt, label=label))
    return assemble("ring", "broadcast", n, count, count, drafts, params={"chunk_elems": chunk_elems, "root": root})
