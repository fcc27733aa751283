"""The alpha-beta-gamma model times schedules from their IR: sanity of its orderings."""
from __future__ import annotations

import pytest

from ddl_triton import schedules
from ddl_triton.planning.costmodel import CostModel


def _flat(link="shm"):
    return lambda a, b: link


def test_small_messages_prefer_one_latency():
    m = CostModel()
    one = m.time(schedules.build("one_shot", "allreduce", 4, 16, chunk_elems=1 << 16), _flat(), 4)
    ring = m.time(schedules.build("ring", "allreduce", 4, 16, chunk_elems=1 << 16), _flat(), 4)
    assert one < ring


def test_large_messages_prefer_bandwidth_optimal_schedules():
    m = CostModel(step_overhead=1e-6)
    count, ce = 1 << 22, 1 << 18
    one = m.time(schedules.build("one_shot", "allreduce", 8, count, chunk_elems=ce), _flat("mpi"), 4)
    ring = m.time(schedules.build("ring", "allreduce", 8, count, chunk_elems=ce), _flat("mpi"), 4)
    assert ring < one


def test_time_grows_with_bytes_and_slower_links():
    m = CostModel()
    s_small = schedules.build("ring", "allreduce", 3, 1000, chunk_elems=256)
    s_big = schedules.build("ring", "allreduce", 3, 100000, chunk_elems=256)
    assert m.time(s_small, _flat(), 4) < m.time(s_big, _flat(), 4)
    assert m.time(s_big, _flat("shm"), 4) < m.time(s_big, _flat("mpi"), 4)


def test_hierarchical_beats_flat_ring_when_inter_node_links_are_slow():
    m = CostModel(mpi=CostModel().mpi.__class__(alpha=50e-6, beta=1 / 0.5e9))
    link = lambda a, b: "shm" if a // 4 == b // 4 else "mpi"  # noqa: E731
    count, ce = 1 << 20, 1 << 16
    flat = m.time(schedules.build("ring", "allreduce", 8, count, chunk_elems=ce), link, 4)
    hier = m.time(schedules.build("hierarchical", "allreduce", 8, count, chunk_elems=ce, grid=(4, 2)), link, 4)
    assert hier < flat


def test_empty_schedule_costs_nothing():
    assert CostModel().time(schedules.build("ring", "allreduce", 2, 0, chunk_elems=8), _flat(), 4) == 0.0


@pytest.mark.parametrize("name", ["ring", "one_shot", "two_shot"])
def test_model_agrees_with_step_count_at_zero_bandwidth_cost(name):
    m = CostModel(step_overhead=1.0, shm=CostModel().shm.__class__(alpha=0.0, beta=0.0), gamma=0.0, beta_copy=0.0)
    s = schedules.build(name, "allreduce", 2, 8, chunk_elems=100)
    # Two ranks run symmetric step lists in lockstep: the time is the per-rank step count.
    assert m.time(s, _flat(), 4) == pytest.approx(max(len(steps) for steps in s.steps))


@pytest.mark.parametrize("name,grid", [("ring", None), ("one_shot", None), ("rhd", None), ("tree", None),
                                       ("hierarchical", (2, 2)), ("multidim", (2, 2))])
def test_terms_are_the_critical_paths_coefficients(name, grid):
    """``terms`` gives the time and coefficients with time == coefficients . parameters, and the
    same time as ``time``: the linearity a least-squares fit of the parameters relies on."""
    m = CostModel(calls=(7e-6, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6))
    link = lambda a, b: "shm" if a // 2 == b // 2 else "mpi"  # noqa: E731
    s = schedules.build(name, "allreduce", 4, 5000, chunk_elems=512, grid=grid)
    t, coeffs = m.terms(s, link, 4)
    assert t == pytest.approx(m.time(s, link, 4), rel=1e-12)
    assert t == pytest.approx(sum(c * p for c, p in zip(coeffs, m.vector())), rel=1e-12)
    assert coeffs[0] == 1 and sum(coeffs[:6]) == 1  # one allreduce call
    assert coeffs[6] >= 1  # at least one step on the path


def test_parameters_round_trip_through_plain_data():
    m = CostModel(calls=(3e-6, 1e-6, 0.0, 0.0, 2e-6, 0.0), gamma=1e-10)
    assert CostModel.from_dict(m.to_dict()) == m
    assert CostModel.from_vector(m.vector()) == m
    with pytest.raises(ValueError, match=">= 0"):
        CostModel.from_dict(dict(m.to_dict(), gamma=-1.0))
    with pytest.raises(ValueError, match="incomplete"):
        CostModel.from_dict({"gamma": 1.0})
