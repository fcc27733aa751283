"""Recursive halving-doubling (Rabenseifner) allreduce, for any number of ranks.

Naive semantics: an allreduce is a reduce-scatter (member j of the group ends
owning the full sum of block j) followed by an all-gather of those blocks, as
for the ring, but each phase takes log2(p) exchange rounds instead of p-1:

- reduce-scatter by recursive halving: in the round at distance d (p/2, p/4,
  ..., 1) member j swaps half of the range it is still responsible for with
  member j ^ d (the lower member keeps the lower half) and adds what it gets to
  the half it keeps;
- all-gather by recursive doubling: the same rounds backwards (d = 1, 2, ...,
  p/2), each member sending everything it holds and storing what it receives.

A rank count n that is not a power of two is folded first: with p the largest
power of two <= n and r = n - p, members 2i and 2i+1 (i < r) pair up, 2i sends
its whole region to 2i+1, which adds it to its own, and drops out; the p
remaining members run the power-of-two algorithm. The folded-out member gets
the result back from its partner during the all-gather: every chunk the
partner holds (its own block, then each chunk it receives) is also sent to it,
as one multicast message with the partner's exchange. For n = 5 (p = 4, r = 1;
members 1..4 renumbered j = 0..3, blocks b0..b3):

    fold     0 -> 1: everything             1: in_0 + in_1
    rs d=2   1 <-> 3, 2 <-> 4: b01 | b23    1, 2 keep b01; 3, 4 keep b23 (partial sums)
    rs d=1   1 <-> 2, 3 <-> 4: b0 | b1 ...  1, 2, 3, 4 own b0, b1, b2, b3 fully reduced (final)
    ag d=1   1 <-> 2, 3 <-> 4               1, 2 hold b01; 3, 4 hold b23 (1 forwards b0, b1 to 0)
    ag d=2   1 <-> 3, 2 <-> 4               everyone holds b0..b3 (1 forwards b23 to 0)

Each element is fully reduced once, by its owner, and then only copied, so all
ranks hold the same bits. Every transfer is cut into messages of at most
``chunk_elems`` elements; within a round, sends and receives alternate chunk by
chunk, so a member sends chunk k+1 only after the partner's chunk k arrived,
which the partner sent after reading the member's chunk k-1: the member's
slot for k+1 (that of k-1, on a two-slot transport) is always free or about to
be, and nothing deadlocks. Per rank, a power-of-two group sends 2(p-1)/p of the
region, the bandwidth optimum, in 2 log2(p) rounds. With a fold, member 2i
sends the region once and 2i+1 sends 3(p-1)/p of it (the forwards to 2i are
extra messages, except for its own block, which is multicast), plus two rounds
of latency.

The two phases are separate functions over a ``group`` of world ranks and a
``region`` of the buffer, so hierarchical schedules can compose them (e.g. a
reduce-scatter inside a node, then one across nodes on the owned block).
"""
from __future__ import annotations

from .ir import OUT, Recv, Schedule, Span, Step, assemble
from .partition import blocks, chunk_of, rounds


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    """The recursive halving-doubling schedule of ``collective`` (allreduce only)."""
    if collective != "allreduce":
        raise ValueError(f"rhd: unsupported collective {collective!r}")
    group = tuple(range(nranks))
    region = (0, count)
    rs, owned = reduce_scatter_phase(group, region, chunk_elems, final=True)
    ag = all_gather_phase(group, region, owned, chunk_elems)
    drafts = [rs[r] + ag[r] for r in range(nranks)]
    return assemble("rhd", "allreduce", nranks, count, count, drafts, params={"chunk_elems": chunk_elems},
                    single_pass=False)


def _fold(g: int) -> tuple[int, int, list[int]]:
    """(p, r, active): p = largest power of two <= g, r = g - p folded pairs, and
    ``active[j]`` the group index of the member playing j in the power-of-two part
    (2j+1 for the first r, which absorbed member 2j; then j+r)."""
    p = 1 << (g.bit_length() - 1)
    r = g - p
    active = [2 * j + 1 if j < r else j + r for j in range(p)]
    return p, r, active


def _chunks(span: tuple[int, int], chunk_elems: int) -> list[tuple[int, int]]:
    return [chunk_of(span, k, chunk_elems) for k in range(rounds(span[1], chunk_elems))]


def _span_of(blk: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """The contiguous element span of blocks lo..hi-1."""
    return blk[lo][0], blk[hi - 1][0] + blk[hi - 1][1] - blk[lo][0]


def reduce_scatter_phase(group: tuple[int, ...], region: tuple[int, int], chunk_elems: int, *,
                         final: bool) -> tuple[dict[int, list[Step]], dict[int, tuple[int, int]]]:
    """Recursive-halving reduce-scatter of ``region`` (start, count) of buffer OUT over ``group``.

    Returns (draft steps per world rank of the group, owned (start, count) per world
    rank): active member j owns block j of ``blocks(count, p)``; folded-out members own
    an empty span. The steps producing each fully reduced element carry ``final``.
    With one member, ``final`` asks for a single local step so the scale is applied.
    """
    g = len(group)
    start, count = region
    steps: dict[int, list[Step]] = {w: [] for w in group}
    if g == 1:
        if final and count:
            span = Span(OUT, start, count)
            steps[group[0]].append(Step(count, src=span, dst=span, final=True, label="local"))
        return steps, {group[0]: region}
    p, r, active = _fold(g)
    owned = {w: (start, 0) for w in group}
    blk = [(start + s, c) for s, c in blocks(count, p)]
    for j in range(p):
        owned[group[active[j]]] = blk[j]

    # Fold: 2i sends everything to 2i+1, which adds it in place (lower member's data first).
    for i in range(r):
        lo, hi = group[2 * i], group[2 * i + 1]
        for k, (s, c) in enumerate(_chunks(region, chunk_elems)):
            span = Span(OUT, s, c)
            steps[lo].append(Step(c, src=span, send=(hi,), label=f"rs fold chunk {k}"))
            steps[hi].append(Step(c, src=span, dst=span, recv=(Recv(lo, -1),), reduce=True, local_pos=1,
                                  label=f"rs fold chunk {k}"))

    # Halving: member j is responsible for blocks [lo, hi); each round keeps the half on
    # j's side of bit d and sends the other half to j ^ d.
    lo_hi = [(0, p) for _ in range(p)]
    d = p // 2
    while d >= 1:
        for j in range(p):
            partner = j ^ d
            lo, hi = lo_hi[j]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if j & d == 0 else ((mid, hi), (lo, mid))
            lo_hi[j] = keep
            me, peer = group[active[j]], group[active[partner]]
            sends = _chunks(_span_of(blk, *give), chunk_elems)
            recvs = _chunks(_span_of(blk, *keep), chunk_elems)  # the partner's `give`, chunked alike
            for k in range(max(len(sends), len(recvs))):
                # Alternate send/receive so at most one message per direction is unread.
                if k < len(sends):
                    s, c = sends[k]
                    steps[me].append(Step(c, src=Span(OUT, s, c), send=(peer,), label=f"rs d={d} chunk {k}"))
                if k < len(recvs):
                    s, c = recvs[k]
                    span = Span(OUT, s, c)
                    # Operands in member order, so the lower member's data comes first.
                    steps[me].append(Step(c, src=span, dst=span, recv=(Recv(peer, -1),), reduce=True,
                                          local_pos=0 if j < partner else 1, final=final and d == 1,
                                          label=f"rs d={d} chunk {k}"))
        d //= 2
    return steps, owned


def all_gather_phase(group: tuple[int, ...], region: tuple[int, int], owned: dict[int, tuple[int, int]],
                     chunk_elems: int) -> dict[int, list[Step]]:
    """Recursive-doubling all-gather: from each member holding ``owned[w]`` of ``region``
    in buffer OUT (as :func:`reduce_scatter_phase` leaves it), every member ends with
    the whole region. Copies only. Raises ValueError if ``owned`` is not that layout."""
    g = len(group)
    start, count = region
    steps: dict[int, list[Step]] = {w: [] for w in group}
    if g == 1:
        return steps
    p, r, active = _fold(g)
    blk = [owned[group[active[j]]] for j in range(p)]
    pos = start
    for j, (s, c) in enumerate(blk):
        if s != pos or c < 0:
            raise ValueError(f"rhd all_gather: member {group[active[j]]} owns {(s, c)}, expected to start at {pos}")
        pos += c
    folded = [group[2 * i] for i in range(r)]
    if pos != start + count or any(owned[w][1] for w in folded):
        raise ValueError(f"rhd all_gather: owned regions {owned} do not partition {region}")

    # Member j holds blocks [lo, hi), doubling each round; what it gets is also forwarded to
    # its folded-out partner (if any), who thus receives its block and then every new chunk.
    lo_hi = [(j, j + 1) for j in range(p)]
    forward: dict[int, tuple[int, ...]] = {group[active[j]]: (group[2 * j],) for j in range(r)}
    d = 1
    while d < p:
        for j in range(p):
            partner = j ^ d
            me, peer = group[active[j]], group[active[partner]]
            extra = forward.get(me, ())
            sends = _chunks(_span_of(blk, *lo_hi[j]), chunk_elems)
            recvs = _chunks(_span_of(blk, *lo_hi[partner]), chunk_elems)
            for k in range(max(len(sends), len(recvs))):
                if k < len(sends):
                    s, c = sends[k]
                    # Only the first round sends the member's own block, which the folded
                    # partner still needs; later rounds send what it was already forwarded.
                    to = (peer,) + (extra if d == 1 else ())
                    steps[me].append(Step(c, src=Span(OUT, s, c), send=to, label=f"ag d={d} chunk {k}"))
                    for f in to[1:]:
                        steps[f].append(Step(c, dst=Span(OUT, s, c), recv=(Recv(me, -1),),
                                             label=f"ag from {me} chunk {k}"))
                if k < len(recvs):
                    s, c = recvs[k]
                    steps[me].append(Step(c, dst=Span(OUT, s, c), recv=(Recv(peer, -1),), send=extra,
                                          label=f"ag d={d} chunk {k}"))
                    for f in extra:
                        steps[f].append(Step(c, dst=Span(OUT, s, c), recv=(Recv(me, -1),),
                                             label=f"ag from {me} d={d} chunk {k}"))
        lo_hi = [(min(lo_hi[j][0], lo_hi[j ^ d][0]), max(lo_hi[j][1], lo_hi[j ^ d][1])) for j in range(p)]
        d *= 2
    return steps
