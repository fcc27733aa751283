"""Pipelined double binary tree (NCCL's "tree" algorithm): allreduce and broadcast.

Naive semantics of an allreduce: a reduce to one root followed by a broadcast
from it. Each element's full sum is computed once, at the root, so every rank
holds the same bits. A single tree would leave half the ranks (the leaves)
sending almost nothing and the interior ones sending twice the data, so the
buffer is cut in two halves, each carried by its own tree; for an even rank
count the second tree is the first one mirrored (r -> n-1-r), which makes every
interior node of one tree a leaf of the other (ncclGetDtree). For n = 4:

    tree 1 (half 0)        tree 2 (half 1, mirrored)
        0                       3
        |                       |
        2                       1
       / \\                     / \\
      1   3                   2   0

Each half is cut into chunks of at most ``chunk_elems`` and pipelined. Per
chunk k, a node's reduce step R_k receives its children's partial sums of
chunk k, adds its own data and sends the sum to its parent; the root's R_k
stores the final value (the only ``final`` step of that chunk); a node's
broadcast step B_k receives chunk k from its parent (the root: takes it from
its buffer), stores it and forwards it to its children (one message,
multicast). Every rank runs, for both trees at once (tree 1's step, then tree
2's),

    R_0  R_1  B_0  R_2  B_1  R_3  B_2 ...  B_{K-1}

so chunk k+1 climbs the tree while chunk k comes down. The one-chunk lag is
what keeps a two-slot transport from deadlocking: in one tree, a node may send
R_{k+1} once its parent has read R_k (two messages back), and it has: the
node already consumed B_{k-1}, which the parent sends after its R_k. Every
rank orders its steps by the same key (phase, chunk, tree), so each pair's
messages are received in the order they are sent even where two ranks are
linked in both trees. ``tests/unit/test_schedules_tree_rhd.py`` runs the two
interleaved trees on the two-slot simulator.

A node's parent and children come from :func:`btree` (ranks by lowest set
bit: r's parent clears its lowest bit and sets the next one, as in
ncclGetBtree). Per-rank volume for an allreduce: a rank interior in one tree
and a leaf in the other sends count/2 up and count/2 down in the first tree and
count/2 up in the second, 1.5 x count messages' worth (the down message is one
multicast to two children), against 2(n-1)/n x count for the ring; latency is
O(log n) hops instead of O(n).

A broadcast uses the same machinery with both trees rooted at ``root`` (the
root has a single child in each): tree A is ``btree`` on the labels
(r - root) mod n, tree B relabels the non-root ranks so that A's interior nodes
are B's leaves, so no rank but the root forwards more than count elements.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble
from .partition import chunk_of, rounds


@dataclass(frozen=True)
class Tree:
    """A spanning tree of world ranks: ``parent[r]`` (None at the root), ``children[r]``
    and ``label[r]``, the rank's position in :func:`btree` (partial sums are combined in
    label order: left child, self, right child)."""

    root: int
    parent: tuple[int | None, ...]
    children: tuple[tuple[int, ...], ...]
    label: tuple[int, ...]


def btree(n: int) -> tuple[list[int | None], list[list[int]]]:
    """NCCL's binary tree over labels 0..n-1 (ncclGetBtree): (parent, children) per label.

    Label 0 is the root with a single child, the highest power of two below n;
    label l with lowest set bit b has parent (l ^ b) | 2b (or l ^ b if that is out
    of range) and children l - b/2 and l + b/2 (the latter halved again until in
    range). Odd labels are leaves. For n = 6: 0 -> 4 -> {2, 5}, 2 -> {1, 3}.
    """
    parent: list[int | None] = [None] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for label in range(1, n):
        bit = label & -label
        up = (label ^ bit) | (bit << 1)
        if up >= n:
            up = label ^ bit
        parent[label] = up
    for label in range(1, n):
        children[parent[label]].append(label)
    for kids in children:
        kids.sort()
    return parent, children


def _relabelled(n: int, rank_of: list[int]) -> Tree:
    """``btree(n)`` with label l placed on world rank ``rank_of[l]``."""
    parent_l, children_l = btree(n)
    parent: list[int | None] = [None] * n
    children: list[tuple[int, ...]] = [()] * n
    labels = [0] * n
    for label in range(n):
        r = rank_of[label]
        labels[r] = label
        p = parent_l[label]
        parent[r] = None if p is None else rank_of[p]
        children[r] = tuple(rank_of[c] for c in children_l[label])
    return Tree(rank_of[0], tuple(parent), tuple(children), tuple(labels))


def double_tree(n: int) -> tuple[Tree, Tree]:
    """The two allreduce trees (ncclGetDtree): ``btree`` on the ranks, and ``btree`` on
    the mirrored ranks n-1-r for even n (every interior node of one is a leaf of the
    other) or on the shifted ranks r-1 for odd n (a mirror would map odd onto odd)."""
    first = _relabelled(n, list(range(n)))
    if n % 2 == 0:
        second = _relabelled(n, [n - 1 - label for label in range(n)])
    else:
        second = _relabelled(n, [(label + 1) % n for label in range(n)])
    return first, second


def broadcast_trees(n: int, root: int) -> tuple[Tree, Tree]:
    """Two trees both rooted at ``root``. Tree A is ``btree`` on d = (r - root) mod n;
    tree B permutes the non-root distances 1..n-1 so that even labels (A's interior
    nodes) land on odd ones (leaves): d -> n-d for odd n, d -> d-1 (1 -> n-1) for even n."""
    a = [(root + d) % n for d in range(n)]
    if n % 2 == 1:
        sigma = [0] + [n - d for d in range(1, n)]
    else:
        sigma = [0] + [(d - 2) % (n - 1) + 1 for d in range(1, n)]
    # sigma maps a distance to its tree-B label; invert it to place labels on ranks.
    b = [0] * n
    for d in range(n):
        b[sigma[d]] = (root + d) % n
    return _relabelled(n, a), _relabelled(n, b)


def build(collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    """The double-binary-tree schedule of ``collective`` ("allreduce" or "broadcast")."""
    if collective not in ("allreduce", "broadcast"):
        raise ValueError(f"tree: unsupported collective {collective!r}")
    n = nranks
    drafts: list[list[Step]] = [[] for _ in range(n)]
    params = {"chunk_elems": chunk_elems, "root": root}
    reduce = collective == "allreduce"
    if n == 1:
        if reduce and count:
            drafts[0].append(Step(count, src=Span(IN, 0, count), dst=Span(OUT, 0, count), final=True,
                                  label="local"))
        return assemble("tree", collective, n, count, count, drafts, params=params, single_pass=not reduce)
    trees = double_tree(n) if reduce else broadcast_trees(n, root)
    # Half 0 over tree 0, half 1 over tree 1 (the larger half first when count is odd).
    half = (count + 1) // 2
    halves = [(0, half), (half, count - half)]
    nchunks = [rounds(size, chunk_elems) for _, size in halves]

    def phase(r: int, k: int, down: bool) -> list[Step]:
        """Rank r's R_k (or B_k) of both trees, tree 0 first: the same key order on every rank."""
        out = []
        for t, tr in enumerate(trees):
            if 0 <= k < nchunks[t]:
                chunk = chunk_of(halves[t], k, chunk_elems)
                out += _down_step(tr, r, chunk, t, k, reduce) if down else _reduce_step(tr, r, chunk, t, k)
        return out

    for r in range(n):
        if reduce:
            # R_0 R_1 B_0 R_2 B_1 ...: the reduce runs one chunk ahead of the broadcast.
            drafts[r] += phase(r, 0, down=False)
            for k in range(max(nchunks)):
                drafts[r] += phase(r, k + 1, down=False) + phase(r, k, down=True)
        else:
            for k in range(max(nchunks)):
                drafts[r] += phase(r, k, down=True)
    return assemble("tree", collective, n, count, count, drafts, params=params, single_pass=not reduce)


def _reduce_step(tree: Tree, r: int, chunk: tuple[int, int], t: int, k: int) -> list[Step]:
    """R_k on rank r: children's partial sums + own data, sent up (stored, final, at the root)."""
    start, size = chunk
    kids = tree.children[r]
    src = Span(IN, start, size)
    label = f"tree{t} reduce chunk {k}"
    # Operands in label order (left child, self, right child): a fixed, documented order.
    local_pos = sum(1 for c in kids if tree.label[c] < tree.label[r])
    if r == tree.root:
        # The root stores the finished chunk and sends it down later, in its B_k (see _down_step).
        return [Step(size, src=src, dst=Span(OUT, start, size), recv=tuple(Recv(c, -1) for c in kids),
                     reduce=True, local_pos=local_pos, final=True, label=label)]
    if not kids:
        return [Step(size, src=src, send=(tree.parent[r],), label=label)]
    return [Step(size, src=src, recv=tuple(Recv(c, -1) for c in kids), reduce=True, local_pos=local_pos,
                 send=(tree.parent[r],), label=label)]


def _down_step(tree: Tree, r: int, chunk: tuple[int, int], t: int, k: int, reduced: bool) -> list[Step]:
    """B_k on rank r: the finished chunk from the parent, stored and forwarded to the children.

    The root sends what its R_k stored (allreduce) or its own data (broadcast). Fusing
    that send into the root's R_k would save a step but break per-pair FIFO: with two
    trees, a pair can be root->child in one tree and child->parent in the other, and
    the child consumes the root's message at B_k time, so the root must send it there.
    """
    start, size = chunk
    kids = tree.children[r]
    label = f"tree{t} bcast chunk {k}"
    if r == tree.root:
        if not kids:
            return []
        return [Step(size, src=Span(OUT if reduced else IN, start, size), send=kids, label=label)]
    return [Step(size, dst=Span(OUT, start, size), recv=(Recv(tree.parent[r], -1),), send=kids, label=label)]

