"""Schedule math with no ranks: every chunk is reduced exactly once, every rank ends with every chunk,
no schedule deadlocks on a two-slot transport, and the IR checks catch broken schedules."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddl_triton import schedules
from ddl_triton.schedules import Recv, Schedule, validate
from ddl_triton.schedules.partition import blocks, chunk_of, rounds
from ddl_triton.schedules.dry_run import contributions, execute

NAMES = schedules.names()


def supporting(collective: str) -> list[str]:
    return [n for n in NAMES if schedules.supports(n, collective)]

RANKS = [1, 2, 3, 4, 5]
COUNTS = [0, 1, 2, 7, 13, 64, 101]
CHUNKS = [1, 3, 16, 1000]


@pytest.mark.parametrize("name", supporting("allreduce"))
@pytest.mark.parametrize("n", RANKS)
def test_allreduce_reduces_every_element_exactly_once_on_every_rank(name, n):
    for count in COUNTS:
        for ce in CHUNKS:
            s = schedules.build(name, "allreduce", n, count, chunk_elems=ce)
            for r, c in enumerate(contributions(s, depth=2)):
                assert c.shape == (count, n)
                assert (c == 1).all(), f"{name} n={n} count={count} chunk={ce}: rank {r} got counts {c.tolist()}"


@pytest.mark.parametrize("name", supporting("reduce_scatter"))
@pytest.mark.parametrize("n", RANKS)
def test_reduce_scatter_gives_rank_r_block_r_reduced_once(name, n):
    for m in [0, 1, 5, 33]:
        for ce in CHUNKS:
            s = schedules.build(name, "reduce_scatter", n, m, chunk_elems=ce)
            assert (s.in_count, s.out_count) == (n * m, m)
            for r, c in enumerate(contributions(s, depth=2)):
                assert (c == 1).all(), f"{name} n={n} m={m} chunk={ce}: rank {r}"
            # The numeric oracle: rank r's output is the sum of block r.
            ins = [np.arange(n * m, dtype=np.int64) * (q + 1) for q in range(n)]
            total = sum(ins)
            for r, out in enumerate(execute(s, ins, depth=2)):
                assert (out == total[r * m:(r + 1) * m]).all()


@pytest.mark.parametrize("name", supporting("all_gather"))
@pytest.mark.parametrize("n", RANKS)
def test_all_gather_delivers_every_chunk(name, n):
    for m in [0, 1, 5, 33]:
        for ce in CHUNKS:
            s = schedules.build(name, "all_gather", n, m, chunk_elems=ce)
            ins = [np.full(m, q + 1, dtype=np.int64) for q in range(n)]
            expected = np.concatenate(ins) if m else np.zeros(0, np.int64)
            for out in execute(s, ins, depth=2):
                assert (out == expected).all()


@pytest.mark.parametrize("name", supporting("broadcast"))
@pytest.mark.parametrize("n", RANKS)
def test_broadcast_delivers_every_chunk_from_every_root(name, n):
    for m in [0, 1, 5, 33]:
        for ce in CHUNKS:
            for root in range(n):
                s = schedules.build(name, "broadcast", n, m, chunk_elems=ce, root=root)
                outs = execute(s, [np.full(m, q + 1, dtype=np.int64) for q in range(n)], depth=2)
                for out in outs:
                    assert (out == root + 1).all()


@pytest.mark.parametrize("name", supporting("allreduce"))
def test_min_max_oracle(name):
    n, count = 4, 37
    ins = [((np.arange(count) * (q + 3)) % 11).astype(np.int64) for q in range(n)]
    for op, fn in (("min", np.minimum.reduce), ("max", np.maximum.reduce)):
        s = schedules.build(name, "allreduce", n, count, chunk_elems=5)
        for out in execute(s, ins, op=op, depth=2):
            assert (out == fn(ins)).all()


def test_ring_moves_the_bandwidth_optimal_volume():
    n, count = 4, 4000
    s = schedules.build("ring", "allreduce", n, count, chunk_elems=64)
    for r in range(n):
        sent = sum(st.count for st in s.steps[r] if st.send)
        assert sent == 2 * (n - 1) * count // n


def test_one_shot_allreduce_reduces_in_rank_order():
    s = schedules.build("one_shot", "allreduce", 3, 10, chunk_elems=100)
    for r in range(3):
        (red,) = [st for st in s.steps[r] if st.reduce]
        peers = [rv.peer for rv in red.recv]
        order = peers[:red.local_pos] + [r] + peers[red.local_pos:]
        assert order == [0, 1, 2]


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (4, 1), (2, 1, 2), (3, 1), (2, 3)])
@pytest.mark.parametrize("name", ["hierarchical", "multidim"])
def test_grid_schedules_on_every_topology(name, grid):
    n = int(np.prod(grid))
    algo_sets = [None] if name == "hierarchical" else [None] + [
        tuple(a for _ in grid) for a in ("ring", "rhd", "direct")]
    for algos in algo_sets:
        for count in [0, 1, 7, 13, 101]:
            for ce in [1, 3, 16]:
                s = schedules.build(name, "allreduce", n, count, chunk_elems=ce, grid=grid, algos=algos)
                for r, c in enumerate(contributions(s, depth=2)):
                    assert (c == 1).all(), f"{name} {grid} {algos} count={count} chunk={ce}: rank {r}"


def test_forced_schedule_support_table():
    assert schedules.supports("ring", "broadcast") and schedules.supports("tree", "broadcast")
    assert not schedules.supports("rhd", "all_gather") and not schedules.supports("two_shot", "broadcast")
    with pytest.raises(ValueError, match="two_shot: unsupported collective"):
        schedules.build("two_shot", "broadcast", 2, 4, chunk_elems=2)


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="valid: ring, one_shot, two_shot, rhd, tree, hierarchical, multidim"):
        schedules.build("butterfly", "allreduce", 2, 10, chunk_elems=4)


def test_validate_rejects_a_lost_message():
    s = schedules.build("ring", "allreduce", 3, 30, chunk_elems=4)
    broken_rank = [st for st in s.steps[1] if st.send or not st.recv]  # drop rank 1's receive-only steps
    bad = dataclasses.replace(s, steps=(s.steps[0], tuple(broken_rank), s.steps[2]))
    with pytest.raises(ValueError, match="received by"):
        validate(bad)


def test_validate_rejects_fifo_violation():
    s = schedules.build("ring", "allreduce", 2, 40, chunk_elems=4)
    steps = list(s.steps[1])
    recv_idx = [i for i, st in enumerate(steps) if st.recv]
    a, b = recv_idx[0], recv_idx[1]
    ra, rb = steps[a].recv, steps[b].recv
    steps[a] = dataclasses.replace(steps[a], recv=rb)
    steps[b] = dataclasses.replace(steps[b], recv=ra)
    with pytest.raises(ValueError, match="FIFO|size mismatch"):
        validate(dataclasses.replace(s, steps=(s.steps[0], tuple(steps))))


def test_simulator_detects_deadlock():
    # Two ranks that each wait for the other's message before sending theirs.
    from ddl_triton.schedules import IN, OUT, Span, Step
    steps = tuple(
        (Step(1, src=Span(IN, 0, 1), dst=Span(OUT, 0, 1), recv=(Recv(1 - r, 0, 0, 1),), reduce=True),
         Step(1, src=Span(IN, 0, 1), send=(1 - r,), msg=0))
        for r in range(2))
    s = Schedule("crossed", "allreduce", 2, 1, 1, steps)
    validate(s)
    with pytest.raises(RuntimeError, match="deadlock"):
        contributions(s)


def test_partition_helpers():
    assert blocks(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert blocks(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert chunk_of((6, 2), 0, 4) == (6, 2) and chunk_of((6, 2), 1, 4) == (8, 0)
    assert rounds(0, 4) == 0 and rounds(9, 4) == 3


@pytest.mark.parametrize("name", supporting("all_to_all"))
@pytest.mark.parametrize("n", RANKS)
def test_all_to_all_routes_every_block(name, n):
    for m in [0, 1, 5, 33]:
        for ce in CHUNKS:
            s = schedules.build(name, "all_to_all", n, m, chunk_elems=ce)
            ins = [np.arange(n * m, dtype=np.int64) + 1000 * q for q in range(n)]
            for r, out in enumerate(execute(s, ins, depth=2)):
                expected = np.concatenate([ins[q][r * m:(r + 1) * m] for q in range(n)]) if m else out
                assert (out == expected).all()
