"""hierarchical_native with no ranks: its group steps, their p2p stand-in, how the IR checks them,
how the cost model prices them and when the planner offers them (schedules/native.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ddl_triton import schedules
from ddl_triton.planning.costmodel import CostModel
from ddl_triton.planning.planner import Planner
from ddl_triton.planning.topology import parse
from ddl_triton.schedules import IN, OUT, Span, Step, assemble
from ddl_triton.schedules.native import NAME, expand
from ddl_triton.schedules.dry_run import contributions, execute

GRIDS = {2: (1, 2), 3: (1, 3), 4: (2, 2), 6: (2, 3), 8: (4, 2), 9: (3, 3)}


def _build(n, count, chunk, grid=None):
    return schedules.build(NAME, "allreduce", n, count, chunk_elems=chunk, grid=grid or GRIDS.get(n))


def test_every_element_reduced_once_and_no_deadlock_on_every_grid():
    # schedules.check: the IR checks, the two-slot walk and exact integer results, on the
    # group steps' stand-in, for sizes 0, 1, primes and sizes no rank count or chunk divides.
    assert schedules.check(NAME, ranks=tuple(GRIDS), grids=GRIDS) > 100


@pytest.mark.parametrize("n,grid", [(2, (1, 2)), (4, (2, 2)), (6, (2, 3)), (6, (3, 2)), (8, (4, 2))])
def test_one_group_step_per_block_among_the_ranks_with_one_local_index(n, grid):
    count = 101
    s = _build(n, count, 7, grid)
    per_node = grid[0]
    assert s.native
    for r, steps in enumerate(s.steps):
        groups = [x for x in steps if x.group]
        assert len(groups) == 1, (r, groups)
        g = groups[0]
        assert g.group == tuple(q for q in range(n) if q % per_node == r % per_node)
        assert g.src == g.dst and g.dst.buffer == OUT and g.final and not g.send and not g.recv
        # the block this rank owns after the node's reduce-scatter: count / per_node elements
        assert abs(g.count - count / per_node) < 1
    # One rank per node: the whole tensor in one group step, and nothing else.
    if per_node == 1:
        assert all(len(steps) == 1 and steps[0].count == count for steps in s.steps)


def test_numeric_oracle_sums_min_max_exactly():
    s = _build(6, 37, 4, (2, 3))
    ins = [np.arange(37, dtype=np.int64) * (q + 1) - 5 * q for q in range(6)]
    for op, want in (("sum", sum(ins)), ("min", np.minimum.reduce(ins)), ("max", np.maximum.reduce(ins))):
        for r, out in enumerate(execute(s, ins, op=op, depth=2)):
            assert (out == want).all(), (op, r)


def test_one_node_is_a_plain_ring_and_an_empty_call_has_no_steps():
    s = _build(4, 50, 8, (4,))
    assert not s.native and all(not x.group for steps in s.steps for x in steps)
    assert all(c.shape == (50, 4) and (c == 1).all() for c in contributions(s, depth=2))
    assert not any(_build(4, 0, 8, (2, 2)).steps)


def test_expand_replaces_each_group_step_by_a_ring_marked_native():
    s = _build(4, 40, 5, (2, 2))
    e = expand(s)
    assert not e.native and expand(e) is e and expand(s) is e  # cached, idempotent
    assert all(not x.group for steps in e.steps for x in steps)
    marked = [x for steps in e.steps for x in steps if x.native]
    assert marked and all(x.label.startswith("native allreduce") for x in marked)
    # the node's own phases stay as they were (messages renumbered around the ring's)
    def shape(x):
        return x.label, x.src, x.dst, x.reduce, x.send, tuple(rv.peer for rv in x.recv)
    assert [shape(x) for x in e.steps[0] if not x.native] == [shape(x) for x in s.steps[0] if not x.group]


def _group(r, count, group, start=0, **kw):
    span = Span(OUT, start, count)
    return Step(count, src=kw.pop("src", span), dst=span, group=group, final=True, label="g", **kw)


@pytest.mark.parametrize("drafts,problem", [
    ([[_group(0, 4, (0, 1))], [_group(1, 3, (0, 1))]], "one count"),
    ([[_group(0, 4, (0, 1))], []], "every member once"),
    ([[_group(0, 4, (1, 0))], [_group(1, 4, (1, 0))]], "sorted distinct"),
    ([[_group(0, 4, (1, 2))], [], []], "this one included"),
    ([[_group(0, 4, (0, 1), src=Span(IN, 0, 4))], [_group(1, 4, (0, 1), src=Span(IN, 0, 4))]], "in place"),
])
def test_the_ir_refuses_a_broken_group_step(drafts, problem):
    n = len(drafts)
    with pytest.raises(ValueError, match=problem):
        assemble("bad", "allreduce", n, 4, 4, drafts)


def _planner(topo: str, size: int, engines: bool, model: CostModel | None = None) -> Planner:
    t = parse(topo, size, 0)
    p = Planner(rank=0, size=size, topology=t, link_of=lambda a, b: "shm" if t.node_of(a) == t.node_of(b) else "mpi",
                forced="", slot_bytes=1 << 20, wire_chunk_bytes=512 << 10)
    if model is not None:
        p.model = model
    p.group_engines = engines
    return p


def test_the_planner_offers_it_only_where_the_link_between_nodes_has_an_engine():
    nbytes = 2115712  # the CNN's last DDP bucket
    without = _planner("1x2", 2, False).plan("allreduce", nbytes, torch.float32)
    assert NAME not in dict(without.estimates)
    with_engines = _planner("1x2", 2, True).plan("allreduce", nbytes, torch.float32)
    assert with_engines.schedule == NAME, with_engines
    assert with_engines.grid == (1, 2) and with_engines.algos is None
    # Several ranks per node: hierarchical's pipelined phases, unless tuned or forced.
    two_per_node = _planner("2x2", 4, True).plan("allreduce", nbytes, torch.float32)
    assert NAME not in dict(two_per_node.estimates) and two_per_node.schedule == "hierarchical"


def test_its_stand_in_pays_the_link_and_the_reduction_but_no_executor_step():
    # Making every executor step cost a second leaves the native phase's time unchanged.
    cheap, dear = CostModel(), CostModel(step_overhead=1.0, beta_copy=1.0)
    count = 1 << 18
    args = (NAME, "allreduce", count, 1 << 16, 4, (1, 2), None)
    t_cheap = _planner("1x2", 2, True, cheap).model_time(*args)
    t_dear = _planner("1x2", 2, True, dear).model_time(*args)
    assert t_dear == pytest.approx(t_cheap)
    # ... where hierarchical's own steps pay it
    hier = ("hierarchical",) + args[1:]
    assert _planner("1x2", 2, True, dear).model_time(*hier) > 1.0
