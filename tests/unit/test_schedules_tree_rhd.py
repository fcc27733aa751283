"""The double binary tree and recursive halving-doubling schedules, and rhd's composable phases,
on the simulator: every element reduced exactly once and scaled exactly once, every rank ends with
every element, nothing deadlocks on a two-slot transport."""
from __future__ import annotations

import numpy as np
import pytest

from ddl_triton.schedules import OUT, assemble, rhd, tree
from ddl_triton.schedules.dry_run import contributions, execute

RANKS = list(range(1, 10))
COUNTS = [0, 1, 2, 7, 13, 64, 101]
CHUNKS = [1, 3, 16, 1000]
BUILDERS = {"tree": tree.build, "rhd": rhd.build}


def finals(schedule, mask):
    """Per rank, how many ``final`` steps each out element's value went through.

    Walks the schedule like the simulator (no slot limit) on one-hot contribution
    rows plus a final-count column, and asserts that every final step scales a value
    reduced over exactly the ranks in ``mask`` (i.e. fully reduced, each rank once).
    """
    n = schedule.nranks
    bufs = []
    for q in range(n):
        a = np.zeros((schedule.out_count, n + 1), np.int64)
        a[:, q] = 1
        bufs.append(a)
    mailbox = {}
    pc = [0] * n
    while any(pc[r] < len(schedule.steps[r]) for r in range(n)):
        progressed = False
        for r in range(n):
            while pc[r] < len(schedule.steps[r]):
                s = schedule.steps[r][pc[r]]
                if any((rv.peer, rv.msg) not in mailbox for rv in s.recv):
                    break
                incoming = [mailbox[(rv.peer, rv.msg)][rv.offset:rv.offset + s.count] for rv in s.recv]
                local = bufs[r][s.src.start:s.src.stop] if s.src is not None else None
                if s.reduce:
                    operands = list(incoming)
                    operands.insert(s.local_pos, local)
                    result = sum(operands[1:], operands[0].copy())
                else:
                    result = (incoming[0] if incoming else local).copy()
                if s.final:
                    assert (result[:, :n] == mask).all(), f"rank {r} step {pc[r]} ({s.label}): final on a partial value"
                    result[:, n] += 1
                if s.dst is not None:
                    bufs[r][s.dst.start:s.dst.stop] = result
                if s.send:
                    mailbox[(r, s.msg)] = result
                pc[r] += 1
                progressed = True
        assert progressed, "deadlock"
    return [b[:, n] for b in bufs]


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("n", RANKS)
def test_allreduce_reduces_and_scales_every_element_exactly_once(name, n):
    for count in COUNTS:
        for ce in CHUNKS:
            s = BUILDERS[name]("allreduce", n, count, chunk_elems=ce)
            assert s.name == name and not s.single_pass
            assert all(st.count <= ce for steps in s.steps for st in steps if st.send)
            for r, c in enumerate(contributions(s, depth=2)):
                assert c.shape == (count, n)
                assert (c == 1).all(), f"{name} n={n} count={count} chunk={ce}: rank {r} got {c.tolist()}"
            for r, f in enumerate(finals(s, np.ones(n, np.int64))):
                assert (f == 1).all(), f"{name} n={n} count={count} chunk={ce}: rank {r} finals {f.tolist()}"


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("n", [1, 3, 4, 6, 7])
def test_allreduce_numeric_oracle(name, n):
    for count, ce in [(37, 5), (101, 16), (8, 1000)]:
        ins = [((np.arange(count) * (q + 3) + q) % 11).astype(np.int64) for q in range(n)]
        s = BUILDERS[name]("allreduce", n, count, chunk_elems=ce)
        for op, fn in (("sum", np.add.reduce), ("min", np.minimum.reduce), ("max", np.maximum.reduce)):
            for out in execute(s, ins, op=op, depth=2):
                assert (out == fn(ins)).all(), (name, n, count, ce, op)


@pytest.mark.parametrize("n", RANKS)
def test_tree_broadcast_from_every_root(n):
    for count in COUNTS:
        for ce in CHUNKS:
            for root in range(n):
                s = tree.build("broadcast", n, count, chunk_elems=ce, root=root)
                assert s.single_pass and not any(st.reduce or st.final for steps in s.steps for st in steps)
                outs = execute(s, [np.arange(count) * 10 + q for q in range(n)], depth=2)
                for out in outs:
                    assert (out == np.arange(count) * 10 + root).all(), (n, count, ce, root)


def test_unsupported_collectives():
    for coll in ("reduce_scatter", "all_gather"):
        with pytest.raises(ValueError, match=f"tree: unsupported collective '{coll}'"):
            tree.build(coll, 4, 8, chunk_elems=4)
    for coll in ("reduce_scatter", "all_gather", "broadcast"):
        with pytest.raises(ValueError, match=f"rhd: unsupported collective '{coll}'"):
            rhd.build(coll, 4, 8, chunk_elems=4)


def test_single_rank_is_one_local_step():
    for build in BUILDERS.values():
        s = build("allreduce", 1, 10, chunk_elems=3)
        (step,) = s.steps[0]
        assert step.final and not step.send and step.src.count == step.dst.count == 10
        assert build("allreduce", 1, 0, chunk_elems=3).steps == ((),)
    assert tree.build("broadcast", 1, 10, chunk_elems=3).steps == ((),)


@pytest.mark.parametrize("n", range(1, 18))
def test_double_tree_shape(n):
    pairs = [("allreduce", tree.double_tree(n))] + [(f"bcast {root}", tree.broadcast_trees(n, root))
                                                    for root in range(n)]
    for what, trees in pairs:
        for t in trees:
            assert t.parent[t.root] is None
            for r in range(n):
                if r != t.root:
                    assert r in t.children[t.parent[r]], (what, r)
                    hops, x = 0, r
                    while x != t.root:  # every rank reaches the root: a spanning tree, no cycles
                        x, hops = t.parent[x], hops + 1
                        assert hops < n
                assert len(t.children[r]) <= (1 if r == t.root else 2)
            assert sorted(c for kids in t.children for c in kids) == sorted(set(range(n)) - {t.root})
        if what.startswith("bcast"):
            a, b = trees
            assert a.root == b.root == int(what.split()[1])
            assert not any(a.children[r] and b.children[r] for r in range(n) if r != a.root)
    if n % 2 == 0:
        a, b = tree.double_tree(n)
        assert not any(a.children[r] and b.children[r] for r in range(n)), "a rank interior in both trees"


def test_bandwidth():
    # rhd on a power of two moves the ring's optimum, 2(n-1)/n of the data per rank.
    for n in (2, 4, 8):
        count = 4000
        s = rhd.build("allreduce", n, count, chunk_elems=64)
        for r in range(n):
            assert sum(st.count for st in s.steps[r] if st.send) == 2 * (n - 1) * count // n
    # The double tree: a rank is interior in at most one tree, so it sends at most 1.5x the data.
    for n in (4, 8):
        s = tree.build("allreduce", n, 4000, chunk_elems=64)
        for r in range(n):
            assert sum(st.count for st in s.steps[r] if st.send) <= 6000


# The phases alone, on groups that are (strided, unordered) subsets of a larger world, over a
# region that does not start at 0: world, group, (region start, region count), buffer size.
GROUPS = [(6, (1, 3, 5)), (6, (4,)), (6, (2, 5)), (7, (0, 2, 3, 5, 6)), (7, (6, 4, 2, 0)), (9, tuple(range(9)))]


def _drafts(world, *phases):
    drafts = [[] for _ in range(world)]
    for steps in phases:
        for w, ss in steps.items():
            drafts[w] += ss
    return drafts


@pytest.mark.parametrize("world,group", GROUPS)
def test_reduce_scatter_phase_owned_regions_partition_the_region(world, group):
    mask = np.zeros(world, np.int64)
    mask[list(group)] = 1
    for count in [0, 1, 2, 7, 13, 64]:
        for ce in [1, 3, 1000]:
            start, size = 5, count + 8
            steps, owned = rhd.reduce_scatter_phase(group, (start, count), ce, final=True)
            assert set(steps) == set(owned) == set(group)
            s = assemble("rs", "allreduce", world, size, size, _drafts(world, steps))
            assert all(sp.buffer == OUT for ss in s.steps for st in ss for sp in (st.src, st.dst) if sp)
            covered = np.zeros(size, np.int64)
            for w, (o, c) in owned.items():
                assert start <= o and o + c <= start + count
                covered[o:o + c] += 1
            assert (covered[start:start + count] == 1).all() and covered.sum() == count
            contrib = contributions(s, depth=2)
            fin = finals(s, mask)
            for w in range(world):
                c = contrib[w]
                alone = np.eye(world, dtype=np.int64)[w]
                assert (c[:start] == alone).all() and (c[start + count:] == alone).all()  # outside: untouched
                if w in group:
                    o, k = owned[w]
                    assert (c[o:o + k] == mask).all(), (world, group, count, ce, w)
                    assert (fin[w][o:o + k] == 1).all()
                else:
                    assert (c == alone).all()


@pytest.mark.parametrize("world,group", GROUPS)
def test_all_gather_phase_and_composition(world, group):
    mask = np.zeros(world, np.int64)
    mask[list(group)] = 1
    for count in [0, 1, 2, 7, 13, 64]:
        for ce in [1, 3, 1000]:
            start, size = 3, count + 5
            rs, owned = rhd.reduce_scatter_phase(group, (start, count), ce, final=False)
            ag = rhd.all_gather_phase(group, (start, count), owned, ce)
            # The all-gather alone: members start with only their owned block right.
            s = assemble("ag", "allreduce", world, size, size, _drafts(world, ag))
            assert not any(st.reduce or st.final for ss in s.steps for st in ss)
            truth = np.arange(size) + 100
            ins = []
            for w in range(world):
                x = np.full(size, -1 - w)
                if w in owned:
                    o, c = owned[w]
                    x[o:o + c] = truth[o:o + c]
                ins.append(x)
            for w, out in enumerate(execute(s, ins, depth=2)):
                if w in group:
                    assert (out[start:start + count] == truth[start:start + count]).all(), (world, group, count, ce)
                    assert (out[:start] == -1 - w).all() and (out[start + count:] == -1 - w).all()
                else:
                    assert (out == -1 - w).all()
            # Composed: an allreduce of the region over the group.
            s = assemble("rs+ag", "allreduce", world, size, size, _drafts(world, rs, ag))
            for w, c in enumerate(contributions(s, depth=2)):
                if w in group:
                    assert (c[start:start + count] == mask).all()


def test_all_gather_phase_rejects_a_foreign_layout():
    group = (0, 1, 2)
    _, owned = rhd.reduce_scatter_phase(group, (0, 10), 4, final=True)
    bad = dict(owned)
    a, b = [w for w in group if owned[w][1]]
    bad[a], bad[b] = owned[b], owned[a]
    with pytest.raises(ValueError, match="rhd all_gather"):
        rhd.all_gather_phase(group, (0, 10), bad, 4)
