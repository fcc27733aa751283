"""Two-shot allreduce: reduce-scatter straight from the peers' buffers, then all-gather.

Naive semantics, per chunk c of the buffer (c split into n blocks, block r owned by rank r):

    shot 1:  every rank publishes in[c] once, to all peers
             rank r reads block r of every peer's published chunk (in place, on shm)
             out[c, block r] = op(in_0[c, r], ..., in_{n-1}[c, r])     # rank order, one pass
    shot 2:  rank r publishes out[c, block r]; every rank copies the other blocks

Two message latencies instead of one-shot's one, but each rank reduces only
1/n of the data (one-shot reduces all of it on every rank), so it wins once
the reduction, not the latency, dominates. Each element is reduced once, in
rank order, and then copied, so every rank holds the same bits.
"""
from __future__ import annotations

from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble
from .partition import blocks, chunk_of, rounds


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    if collective != "allreduce":
        raise ValueError(f"two_shot: unsupported collective {collective!r}")
    n = nranks
    drafts: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        peers = tuple(p for p in range(n) if p != r)
        for k in range(rounds(count, chunk_elems)):
            start, size = chunk_of((0, count), k, chunk_elems)
            blk = [(start + s, c) for s, c in blocks(size, n)]
            if not peers:
                drafts[r].append(Step(size, src=Span(IN, start, size), dst=Span(OUT, start, size), final=True,
                                      label=f"local chunk {k}"))
                continue
            readers = tuple(p for p in peers if blk[p][1])  # a rank with an empty block reads nothing
            if readers:
                drafts[r].append(Step(size, src=Span(IN, start, size), send=readers, label=f"publish chunk {k}"))
            lo, own = blk[r]
            if own:
                drafts[r].append(Step(own, src=Span(IN, lo, own), dst=Span(OUT, lo, own),
                                      recv=tuple(Recv(p, -1, offset=lo - start) for p in peers), reduce=True,
                                      local_pos=r, final=True, send=peers, label=f"reduce block {r} chunk {k}"))
            for p in peers:
                plo, pcount = blk[p]
                if pcount:
                    drafts[r].append(Step(pcount, dst=Span(OUT, plo, pcount), recv=(Recv(p, -1),),
                                          label=f"gather block {p} chunk {k}"))
    return assemble("two_shot", "allreduce", n, count, count, drafts,
                    params={"chunk_elems": chunk_elems}, single_pass=True)
