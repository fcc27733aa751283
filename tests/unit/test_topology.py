"""Topology parsing, detection and printing; the grid lines the multidim schedule reduces along."""
from __future__ import annotations

import pytest

from ddl_triton.schedules.grid import lines
from ddl_triton.planning.topology import Topology, detect, parse


def test_parse_grid_and_coordinates():
    t = parse("2x1x2", 4)
    assert t.dims == (2, 1, 2) and t.size == 4 and t.ranks_per_node == 2 and t.nodes == 2
    assert [t.coords(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.signature == "2x1x2"


@pytest.mark.parametrize("spec,size,match", [
    ("3x2", 4, "describes 6 ranks, but the communicator has 4"),
    ("2by2", 4, "not of the form XxY"),
    ("2x2x1x1", 4, "not of the form"),
    ("0x4", 0, "empty dimension"),
    ("", 4, "not of the form"),
])
def test_bad_grids_are_refused_with_the_rank(spec, size, match):
    with pytest.raises(ValueError, match=match) as e:
        parse(spec, size, rank=3)
    assert "rank 3" in str(e.value)


def test_detect_regular_and_irregular_layouts():
    assert detect([0, 0, 0, 0]).dims == (4,)
    assert detect([0, 0, 2, 2]).dims == (2, 2)
    irregular = detect([0, 0, 0, 3])
    assert irregular.dims == (4,) and "irregular" in irregular.source
    interleaved = detect([0, 1, 0, 1])  # round-robin placement is not node-contiguous
    assert interleaved.dims == (4,)


def test_printed_grid_names_every_node():
    text = str(parse("2x2", 4))
    assert "Topology 2x2" in text and "node 0" in text and "ranks 2 3" in text


def test_grid_lines():
    assert lines((2, 2), 0) == [(0, 1), (2, 3)]
    assert lines((2, 2), 1) == [(0, 2), (1, 3)]
    assert lines((2, 1, 2), 2) == [(0, 2), (1, 3)]
    assert lines((3, 1), 1) == [(0,), (1,), (2,)]
    assert Topology((4,), "x").nodes == 1
