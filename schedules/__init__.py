"""Schedules: pure functions (collective, nranks, count, params) -> Schedule, by registry name.

``count`` means: allreduce and broadcast, the tensor's elements; reduce_scatter,
the elements each rank receives; all_gather, the elements each rank contributes.
"""
from __future__ import annotations

import functools

from . import one_shot, ring
from .ir import IN, OUT, Recv, Schedule, Span, Step, assemble, validate

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast")

_REGISTRY = {
    "ring": ring.build,
    "one_shot": one_shot.build,
}


def names() -> tuple[str, ...]:
    """Every registered schedule name."""
    return tuple(_REGISTRY)


@functools.lru_cache(maxsize=512)  # schedules are immutable plain data: reuse them across calls
def build(name: str, collective: str, nranks: int, count: int, *, chunk_elems: int, root: int = 0) -> Schedule:
    """Build schedule ``name`` for ``collective``; unknown names list the valid ones."""
    try:
        fn = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(names())}") from None
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    return fn(collective, nranks, count, chunk_elems=chunk_elems, root=root)


__all__ = ["COLLECTIVES", "IN", "OUT", "Recv", "Schedule", "Span", "Step", "assemble", "build", "names", "validate"]
