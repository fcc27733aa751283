"""Schedules: pure functions (collective, nranks, count, params) -> Schedule, by registry name.

``count`` means: allreduce and broadcast, the tensor's elements; reduce_scatter,
the elements each rank receives; all_gather, the elements each rank contributes;
all_to_all, the elements each rank sends to each peer.
"""
from __future__ import annotations

import functools

from . import grid, native, one_shot, ring, two_shot
from .check import check
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
    native.NAME: (native.build, ("allreduce",), True),
}


def count_for(collective: str, in_numel: int, nranks: int) -> int:
    """The schedule ``count`` of a call whose input tensor has ``in_numel`` elements per rank
    (see the module doc): the per-rank block for reduce_scatter and all_to_all."""
    return in_numel // nranks if collective in ("reduce_scatter", "all_to_all") else in_numel


def bus_factor(collective: str, nranks: int) -> float:
    """NCCL's bus-bandwidth factor: the bytes each rank's link carries per input byte by the best
    schedule of ``collective`` among ``nranks`` (allreduce 2(n-1)/n; reduce_scatter and all_gather
    (n-1)/n; else 1), so that bus bandwidth = algorithm bandwidth * factor compares across sizes."""
    if collective == "allreduce":
        return 2 * (nranks - 1) / nranks
    if collective in ("reduce_scatter", "all_gather"):
        return (nranks - 1) / nranks
    return 1.0


def names() -> tuple[str, ...]:
    """Every registered schedule name."""
    return tuple(_REGISTRY)


def register(name: str, builder, collectives, *, uses_grid: bool = False, replace: bool = False) -> None:
    """Add a schedule: from now on ``build``, ``DDL_SCHEDULE``, the planner's cost model and
    ``ddl-tune`` all know it by ``name``. Example (examples/custom_schedule.py)::

        def build_star(collective, nranks, count, *, chunk_elems, root=0):
            ...  # draft steps per rank, then return assemble("star", collective, ...)
        schedules.register("star", build_star, ["allreduce"])

    ``builder(collective, nranks, count, *, chunk_elems, root=0)`` returns a Schedule (built
    with ``assemble``, which validates it); with ``uses_grid=True`` it also receives ``grid``
    and ``algos`` keywords. Check a new schedule with ``schedules.check`` before forcing it.
    An existing name is refused unless ``replace=True``; names are identifiers.
    """
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"schedule name must be an identifier, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"schedule {name!r} is already registered (pass replace=True to replace it)")
    if not callable(builder):
        raise TypeError(f"schedule {name!r}: builder must be callable, got {type(builder).__name__}")
    collectives = tuple(collectives)
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if not collectives or unknown:
        raise ValueError(f"schedule {name!r}: collectives must be a non-empty subset of {', '.join(COLLECTIVES)}; "
                         f"got {list(collectives)}")
    _REGISTRY[name] = (builder, collectives, bool(uses_grid))
    build.cache_clear()


def unregister(name: str) -> None:
    """Remove a schedule added with ``register`` (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"schedule {name!r} is built in and cannot be removed")
    _entry(name)
    del _REGISTRY[name]
    build.cache_clear()


_BUILT_IN = frozenset(_REGISTRY)


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


__all__ = ["COLLECTIVES", "IN", "OUT", "Recv", "Schedule", "Span", "Step", "assemble", "build", "check", "count_for",
           "names", "register", "supports", "unregister",
           "uses_grid", "validate"]
