"""One-shot: every rank publishes its data once and reads what it needs straight
from the peers' buffers, then reduces all n operands in one pass.

Naive semantics of an allreduce: ``out = op(in_0, in_1, ..., in_{n-1})`` on every
rank, operands in rank order, so every rank computes the same bits and 16-bit
data is accumulated in fp32 and rounded once.

Cost: one message latency (one flag wait) instead of 2(n-1) for the ring, at the
price of each rank reading (n-1)x the data; the choice for small messages.
The reduce-scatter is the direct variant: rank r exchanges block r+j / r-j with
its peers at step j, so it needs n-1 latencies but moves each block only once.
Large buffers are cut into chunks so each message fits one transport slot:

    chunk k:  r publishes in[k] to all  |  r waits for every peer's chunk k,
                                        |  out[k] = op(in_0[k], ..., in_{n-1}[k])
"""
from __future__ import annotations

from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble
from .partition import blocks, chunk_of, rounds


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    """The one-shot schedule of ``collective`` (see ``schedules.build`` for ``count``)."""
    n = nranks
    drafts: list[list[Step]] = [[] for _ in range(n)]
    if collective == "allreduce":
        in_count = out_count = count
        for r in range(n):
            peers = tuple(p for p in range(n) if p != r)
            for k in range(rounds(count, chunk_elems)):
                start, size = chunk_of((0, count), k, chunk_elems)
                span = Span(IN, start, size)
                if peers:
                    drafts[r].append(Step(size, src=span, send=peers, label=f"publish chunk {k}"))
                drafts[r].append(Step(size, src=span, dst=Span(OUT, start, size),
                                      recv=tuple(Recv(p, -1) for p in peers), reduce=bool(peers),
                                      local_pos=r, final=True, label=f"reduce chunk {k}"))
    elif collective == "reduce_scatter":
        # Direct exchange: at step j rank r sends block r+j to its owner and folds in what
        # rank r-j sent for block r. Sends and receives alternate so that no rank ever has
        # more than one unread message per peer, whatever the pipeline depth.
        m = count
        in_count, out_count = n * m, m
        for r in range(n):
            for k in range(rounds(m, chunk_elems)):
                lo, size = chunk_of((0, m), k, chunk_elems)
                dst = Span(OUT, lo, size)
                if n == 1:
                    drafts[r].append(Step(size, src=Span(IN, lo, size), dst=dst, final=True, label=f"local chunk {k}"))
                for j in range(1, n):
                    to, frm = (r + j) % n, (r - j) % n
                    drafts[r].append(Step(size, src=Span(IN, to * m + lo, size), send=(to,),
                                          label=f"to {to} chunk {k}"))
                    local = Span(IN, r * m + lo, size) if j == 1 else dst
                    drafts[r].append(Step(size, src=local, dst=dst, recv=(Recv(frm, -1),), reduce=True, local_pos=0,
                                          final=j == n - 1, label=f"from {frm} chunk {k}"))
    elif collective == "all_gather":
        m = count
        in_count, out_count = m, n * m
        for r in range(n):
            peers = tuple(p for p in range(n) if p != r)
            for k in range(rounds(m, chunk_elems)):
                lo, size = chunk_of((0, m), k, chunk_elems)
                drafts[r].append(Step(size, src=Span(IN, lo, size), dst=Span(OUT, r * m + lo, size), send=peers,
                                      label=f"publish chunk {k}"))
                for p in peers:
                    drafts[r].append(Step(size, dst=Span(OUT, p * m + lo, size), recv=(Recv(p, -1),),
                                          label=f"from {p} chunk {k}"))
    elif collective == "broadcast":
        in_count = out_count = count
        for r in range(n):
            others = tuple(p for p in range(n) if p != root)
            for k in range(rounds(count, chunk_elems)):
                start, size = chunk_of((0, count), k, chunk_elems)
                if r == root:
                    if others:
                        drafts[r].append(Step(size, src=Span(IN, start, size), send=others, label=f"publish chunk {k}"))
                else:
                    drafts[r].append(Step(size, dst=Span(OUT, start, size), recv=(Recv(root, -1),),
                                          label=f"from root chunk {k}"))
    elif collective == "all_to_all":
        # Direct exchange: at step j rank r sends block r+j to its owner and receives block r-j.
        m = count
        in_count = out_count = n * m
        for r in range(n):
            for k in range(rounds(m, chunk_elems)):
                lo, size = chunk_of((0, m), k, chunk_elems)
                drafts[r].append(Step(size, src=Span(IN, r * m + lo, size), dst=Span(OUT, r * m + lo, size),
                                      label=f"own block chunk {k}"))
                for j in range(1, n):
                    to, frm = (r + j) % n, (r - j) % n
                    drafts[r].append(Step(size, src=Span(IN, to * m + lo, size), send=(to,), label=f"to {to} chunk {k}"))
                    drafts[r].append(Step(size, dst=Span(OUT, frm * m + lo, size), recv=(Recv(frm, -1),),
                                          label=f"from {frm} chunk {k}"))
    else:
        raise ValueError(f"one_shot: unsupported collective {collective!r}")
    # Only the direct reduce-scatter carries partial sums from step to step.
    return assemble("one_shot", collective, n, in_count, out_count, drafts,
                    params={"chunk_elems": chunk_elems, "root": root}, single_pass=collective != "reduce_scatter")


def reduce_scatter_phase(group: tuple[int, ...], region: tuple[int, int], chunk_elems: int, *, final: bool):
    """In-place direct reduce-scatter of OUT[region] over ``group`` (member i ends owning block i):
    at step j member i sends block i+j to its owner and folds in block i from member i-j."""
    n = len(group)
    blk = [(region[0] + s, c) for s, c in blocks(region[1], n)]
    steps: dict[int, list[Step]] = {w: [] for w in group}
    for me, w in enumerate(group):
        own_start, own_count = blk[me]
        for k in range(rounds(max(c for _, c in blk), chunk_elems)):
            for j in range(1, n):
                to, frm = (me + j) % n, (me - j) % n
                lo, size = chunk_of(blk[to], k, chunk_elems)
                if size:
                    steps[w].append(Step(size, src=Span(OUT, lo, size), send=(group[to],), label=f"to {to} chunk {k}"))
                lo, size = chunk_of(blk[me], k, chunk_elems)
                if size:
                    span = Span(OUT, lo, size)
                    steps[w].append(Step(size, src=span, dst=span, recv=(Recv(group[frm], -1),), reduce=True,
                                         final=final and j == n - 1, label=f"from {frm} chunk {k}"))
    return steps, {w: blk[me] for me, w in enumerate(group)}


def all_gather_phase(group: tuple[int, ...], region: tuple[int, int], owned: dict[int, tuple[int, int]],
                     chunk_elems: int) -> dict[int, list[Step]]:
    """In-place direct all-gather: each member publishes its owned block to all, then copies the others'."""
    n = len(group)
    steps: dict[int, list[Step]] = {w: [] for w in group}
    for k in range(rounds(max(owned[w][1] for w in group), chunk_elems)):
        for me, w in enumerate(group):
            others = tuple(p for p in group if p != w)
            lo, size = chunk_of(owned[w], k, chunk_elems)
            if size:
                steps[w].append(Step(size, src=Span(OUT, lo, size), send=others, label=f"publish chunk {k}"))
            for p in others:
                lo, size = chunk_of(owned[p], k, chunk_elems)
                if size:
                    steps[w].append(Step(size, dst=Span(OUT, lo, size), recv=(Recv(p, -1),),
                                         label=f"from {group.index(p)} chunk {k}"))
    return steps
