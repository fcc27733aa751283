"""Property tests (hypothesis): any schedule, collective, rank count, size, chunk, root and grid
gives every rank the exact answer, with no deadlock on a two-slot transport."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddl_triton import schedules
from ddl_triton.schedules.dry_run import execute

GRIDS = [(1,), (2,), (3,), (4,), (5,), (2, 2), (1, 4), (4, 1), (2, 1, 2), (3, 1), (2, 3), (3, 2)]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(schedules.names()))
    collective = draw(st.sampled_from([c for c in schedules.COLLECTIVES if schedules.supports(name, c)]))
    grid = draw(st.sampled_from(GRIDS)) if schedules.uses_grid(name) else (draw(st.integers(1, 6)),)
    n = math.prod(grid)
    count = draw(st.integers(0, 300))
    chunk = draw(st.integers(1, 64))
    root = draw(st.integers(0, n - 1))
    op = draw(st.sampled_from(["sum", "min", "max"]))
    algos = None
    if name == "multidim":
        algos = tuple(draw(st.sampled_from(["ring", "rhd", "direct"])) for _ in grid)
    return name, collective, grid, n, count, chunk, root, op, algos


def _expected(collective, n, count, ins, root, op, r):
    fold = {"sum": np.add.reduce, "min": np.minimum.reduce, "max": np.maximum.reduce}[op]
    if collective == "allreduce":
        return fold(ins)
    if collective == "reduce_scatter":
        return fold(ins)[r * count:(r + 1) * count]
    if collective == "all_gather":
        return np.concatenate(ins)
    if collective == "broadcast":
        return ins[root]
    return np.concatenate([ins[q][r * count:(r + 1) * count] for q in range(n)])  # all_to_all


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
@settings(max_examples=300, deadline=None)
@given(cases())
def test_any_schedule_is_exact(case):
    name, collective, grid, n, count, chunk, root, op, algos = case
    s = schedules.build(name, collective, n, count, chunk_elems=chunk, root=root,
                        grid=grid if schedules.uses_grid(name) else None, algos=algos)
    in_count = s.in_count
    rng = np.random.default_rng(count * 31 + n)
    ins = [rng.integers(-50, 50, size=in_count).astype(np.int64) for _ in range(n)]
    outs = execute(s, ins, op=op if collective in ("allreduce", "reduce_scatter") else "sum", depth=2)
    for r, out in enumerate(outs):
        exp = _expected(collective, n, count, ins, root, op, r)
        assert out.shape == exp.shape and (out == exp).all(), f"{case}: rank {r}"
