"""What multi-rank test workers print: whole lines, and one closing line gathered over all ranks."""
from __future__ import annotations

import os
import sys


def print_line(text: str) -> None:
    """Write ``text`` and a newline to stdout as one write, so that ranks sharing a pipe never
    split each other's lines: under ``PYTHONUNBUFFERED=1`` (as in CI) ``print`` writes the text and
    its newline separately, and another rank's line can land in between."""
    sys.stdout.flush()
    data = (text + "\n").encode()
    while data:                        # a line under PIPE_BUF (4 KiB) enters a pipe whole, in one write
        data = data[os.write(sys.stdout.fileno(), data):]


def gather_and_report(heading: str, failures: list[str], cases: int, comm=None) -> int:
    """Rank 0 prints up to 50 failures and ``"<heading>, <cases> checks, <k> failures"``;
    returns the exit status (1 on rank 0 if any rank failed)."""
    # Imported here, not at the top: importing it starts MPI, and print_line's users may not run under MPI.
    from mpi4py import MPI
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
