"""Prove a schedule right before any rank runs it: the IR checks plus the simulator's oracle.

``check(name)`` builds schedule ``name`` for every collective it implements, over a grid
of rank counts, sizes (0, 1, primes, sizes not divisible by the ranks or the chunk) and
chunk sizes, and for each:

- ``validate`` (via ``assemble``): spans in bounds, every message received exactly by its
  addressees, per-pair FIFO order;
- the simulator on a transport with two slots per sender: no deadlock;
- exact results against the collective's definition on integer data (schedules/dry_run.py):
  every element reduced exactly once on every rank (allreduce, reduce_scatter), every block
  delivered where it belongs (all_gather, broadcast from every root, all_to_all).

It raises ``AssertionError`` naming the first failing case, and returns the number of cases.
"""
from __future__ import annotations

import numpy as np

from .dry_run import contributions, execute

_COUNTS = (0, 1, 2, 7, 13, 64, 101)
_CHUNKS = (1, 3, 16, 1000)


def check(name: str, *, ranks=(1, 2, 3, 4, 5), counts=_COUNTS, chunks=_CHUNKS, grids=None) -> int:
    """Check schedule ``name`` (see the module doc); ``grids`` (for grid schedules) maps a rank
    count to its grid, default: (2, n // 2) for even n, else skipped."""
    from . import COLLECTIVES, build, supports, uses_grid

    cases = 0
    for collective in COLLECTIVES:
        if not supports(name, collective):
            continue
        for n in ranks:
            grid = None
            if uses_grid(name):
                grid = (grids or {}).get(n) or ((2, n // 2) if n % 2 == 0 and n >= 4 else None)
                if grid is None:
                    continue
            roots = range(n) if collective == "broadcast" else (0,)
            for count in counts:
                for ce in chunks:
                    for root in roots:
                        where = f"{name} {collective} ranks={n} count={count} chunk={ce} root={root}"
                        try:
                            s = build(name, collective, n, count, chunk_elems=ce, root=root, grid=grid)
                        except ValueError as e:
                            raise AssertionError(f"{where}: the IR checks refuse it: {e}") from None
                        _check_one(s, collective, n, count, root, where)
                        cases += 1
    if not cases:
        raise AssertionError(f"{name}: no case checked (no collective, or no rank count fits its grid)")
    return cases


def _check_one(s, collective: str, n: int, count: int, root: int, where: str) -> None:
    try:
        if collective in ("allreduce", "reduce_scatter"):
            for r, c in enumerate(contributions(s, depth=2)):
                expected_rows = count
                if c.shape != (expected_rows, n) or not (c == 1).all():
                    raise AssertionError(f"{where}: rank {r} did not reduce every element exactly once "
                                         f"(counts {c.tolist()[:8]}...)")
            return
        ins = [np.arange(s.in_count, dtype=np.int64) + 1000 * (q + 1) for q in range(n)]
        outs = execute(s, ins, depth=2)
    except RuntimeError as e:  # the simulator's deadlock report
        raise AssertionError(f"{where}: {e}") from None
    for r, out in enumerate(outs):
        if collective == "all_gather":
            expected = np.concatenate(ins) if count else np.zeros(0, np.int64)
        elif collective == "broadcast":
            expected = ins[root]
        else:  # all_to_all: block q of rank r's output is block r of rank q's input
            expected = np.concatenate([ins[q][r * count:(r + 1) * count] for q in range(n)]) if count else \
                np.zeros(0, np.int64)
        if out.shape != expected.shape or not (out == expected).all():
            raise AssertionError(f"{where}: rank {r} ends with {out.tolist()[:8]}..., expected "
                                 f"{expected.tolist()[:8]}...")
