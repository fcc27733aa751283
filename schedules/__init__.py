"""Schedules: pure functions (collective, nranks, count, params) -> Schedule, by registry name.

``count`` means: allreduce and broadcast, the tensor's elements; reduce_scatter,
the elements each rank receives; all_gather, the elements each rank contributes;
all_to_all, the elements each rank sends to each peer.
"""
from __future__ import annotations

import functools

from . import grid, one_shot, ring, two_shot
from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble, validate

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
_CLASSIC = ("allreduce", "reduce_scatter", "all_gather", "broadcast")


def _rhd(*args, **kwargs):
    from . import rhd
    return rhd.build(*args, **kwargs)


def _tree(*args, **kwargs):
    from . import tree
    return tree.build(*args, **kwargs)


# name -> (builder, collectives it implements, whether it uses the topology grid)
_REGISTRY = {
    "ring": (ring.build, _CLASSIC, False),
    "one_shot": (one_shot.build, COLLECTIVES, False),
    "two_shot": (two_shot.build, ("allreduce",), False),
    "rhd": (_rhd, ("allreduce",), False),
    "tree": (_tree, ("allreduce", "broadcast"), False),
    "hierarchical": (grid.build_hierarchical, ("allreduce",), True),
    "multidim": (grid.build_multidim, ("allreduce",), True),
}


def names() -> tuple[str, ...]:
    """Every registered schedule name."""
    return tuple(_REGISTRY)


def supports(name: str, collective: str) -> bool:
    """Whether schedule ``name`` implements ``collective`` (others fall back to a general schedule)."""
    return collective in _entry(name)[1]


def uses_grid(name: str) -> bool:
    return _entry(name)[2]


def _entry(name: str):
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(names())}") from None


@functools.lru_cache(maxsize=128)  # schedules are immutable plain data: reuse them across calls
def build(name: str, collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0,
          grid: tuple[int, ...] | None = None, algos: tuple[str, ...] | None = None) -> Schedule:
    """Build schedule ``name`` for ``collective``; unknown names list the valid ones.

    ``grid`` (innermost first, e.g. (X, Y)) and ``algos`` (one per grid dimension) are used
    by the topology-aware schedules only.
    """
    fn, _, topology_aware = _entry(name)
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    if topology_aware:
        return fn(collective, nranks, count, chunk_elems=chunk_elems, root=root, grid=grid, algos=algos)
    return fn(collective, nranks, count, chunk_elems=chunk_elems, root=root)


__all__ = ["COLLECTIVES", "IN", "OUT", "Recv", "Schedule", "Span", "Step", "assemble", "build", "names", "supports",
           "uses_grid", "validate"]
