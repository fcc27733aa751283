"""Every bad input the test suite tries, and the error each raised: the table for the
reliability notes. Reuses tests/multirank/multirank_worker.py's bad-input cases with a recording checker.

    mpiexec -n 2 python bench/bad_inputs.py

Rank 0 prints: case, the error expected, the error raised, seconds, the first line of the
message. A case that raised the wrong type, or nothing, is marked ✘ (exit status 1).
"""
from __future__ import annotations

import os
import sys
import time

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "multirank")]  # multirank_worker, and the support/ it imports

from mpi4py import MPI  # noqa: E402

import ddl_triton as ddl  # noqa: E402
import multirank_worker  # noqa: E402


class Recorder:
    """The one Checker method run_bad_input uses, recording instead of asserting."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, float, str]] = []

    def raises(self, what: str, exc: type, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
            got, msg = "nothing", ""
        except Exception as e:  # noqa: BLE001
            got, msg = type(e).__name__, str(e).splitlines()[0]
        self.rows.append((what, exc.__name__, got, time.monotonic() - t0, msg))

    def equal(self, *_args) -> None:
        pass  # run_bad_input checks ReduceOp enums first; they are correct results, not bad input


def main() -> int:
    comm = ddl.init()
    rec = Recorder()
    multirank_worker.run_bad_input(rec, comm, "")
    bad = [r for r in rec.rows if r[1] != r[2]]
    if comm.rank == 0:
        print(f"| bad input ({comm.size} ranks) | expected | raised | s | message (rank 0) |")
        print("|---|---|---|---|---|")
        for what, want, got, secs, msg in rec.rows:
            mark = "" if want == got else " ✘"
            print(f"| {what.strip()} | {want} | {got}{mark} | {secs:.3f} | {msg[:110]} |")
        print(f"{len(rec.rows)} bad inputs, {len(bad)} not raising the expected error, 0 hangs "
              f"(the slowest took {max(r[3] for r in rec.rows):.3f} s)")
    total_bad = MPI.COMM_WORLD.allreduce(len(bad))
    ddl.finalize()
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
