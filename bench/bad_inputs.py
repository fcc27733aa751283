"""Every bad input the test suite tries, and the error each raised: the table for the
reliability notes. Runs tests/multirank/multirank_worker.py's bad-input cases through the
tests' checker (tests/support/checker.py), which keeps what each call raised.

    mpiexec -n 2 python bench/bad_inputs.py

Rank 0 prints: case, the error expected, the error raised, seconds, the first line of the
message. A case that raised the wrong type, or nothing, is marked ✘ (exit status 1).
"""
from __future__ import annotations

import os
import sys

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "multirank")]  # multirank_worker, and the support/ it imports

from mpi4py import MPI  # noqa: E402

import ddl_triton as ddl  # noqa: E402
import multirank_worker  # noqa: E402
from support.checker import Checker  # noqa: E402


def main() -> int:
    comm = ddl.init()
    ck = Checker(MPI.COMM_WORLD)
    multirank_worker.run_bad_input(ck, comm, "")
    bad = [r for r in ck.raised if r[1] != r[2]]
    if comm.rank == 0:
        print(f"| bad input ({comm.size} ranks) | expected | raised | s | message (rank 0) |")
        print("|---|---|---|---|---|")
        for what, want, got, secs, msg in ck.raised:
            mark = "" if want == got else " ✘"
            print(f"| {what.strip()} | {want} | {got}{mark} | {secs:.3f} | {msg[:110]} |")
        print(f"{len(ck.raised)} bad inputs, {len(bad)} not raising the expected error, 0 hangs "
              f"(the slowest took {max(r[3] for r in ck.raised):.3f} s)")
    total_bad = MPI.COMM_WORLD.allreduce(len(bad))
    ddl.finalize()
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
