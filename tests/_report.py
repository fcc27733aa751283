"""The closing line every multi-rank test worker prints, gathered over all ranks."""
from __future__ import annotations

from mpi4py import MPI


def gather_and_report(heading: str, failures: list[str], cases: int, comm=None) -> int:
    """Rank 0 prints up to 50 failures and ``"<heading>, <cases> checks, <k> failures"``;
    returns the exit status (1 on rank 0 if any rank failed)."""
    comm = comm or MPI.COMM_WORLD
    every = comm.gather(failures, root=0)
    total = comm.reduce(cases, op=MPI.SUM, root=0)
    if comm.Get_rank() != 0:
        return 0
    flat = [f for fs in every for f in fs]
    for f in flat[:50]:
        print("FAIL", f)
    print(f"{heading}, {total} checks, {len(flat)} failures")
    return 1 if flat else 0
