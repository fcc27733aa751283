"""What ``ddl-tune`` times for one call shape: every candidate way to run it.

A candidate is a schedule that implements the collective (the grid schedules only on
multi-level topologies; ``multidim`` once per per-dimension algorithm choice) on one
communicator layout: slot bytes (which are also the pipeline chunk) and pipeline depth
(slots per rank). The layout is part of the candidate because it is fixed when a
communicator is made: the sweep keeps one communicator per layout.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    depth: int
    schedule: str
    chunk_bytes: int
    algos: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        algos = f"[{'/'.join(self.algos)}]" if self.algos else ""
        return f"{self.schedule}{algos} chunk {self.chunk_bytes >> 10}K depth {self.depth}"

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "chunk_bytes": self.chunk_bytes,
                "algos": list(self.algos) if self.algos else None, "depth": self.depth}


def candidates(collective: str, count: int, elem: int, dims: tuple[int, ...], chunks: list[int],
               depths: list[int]) -> list[Candidate]:
    """Every candidate for one call shape: a schedule (and, for multidim, its per-dimension
    algorithms) on each communicator layout (slot bytes = pipeline chunk, depth). Layouts
    are timed even where they cut the call alike: the slot size changes what stays cached."""
    from .. import schedules
    from ..schedules import grid as grid_mod

    out = []
    for name in schedules.names():
        if not schedules.supports(name, collective) or (schedules.uses_grid(name) and len(dims) < 2):
            continue
        variants = [None]
        if name == "multidim":
            choices = [grid_mod.PHASE_ALGORITHMS if d > 1 else (grid_mod.default_algorithms(dims)[i],)
                       for i, d in enumerate(dims)]
            variants = list(itertools.product(*choices))
        for depth in depths:
            for chunk in sorted(chunks):
                for algos in variants:
                    out.append(Candidate(depth, name, chunk, tuple(algos) if algos else None))
    return out
