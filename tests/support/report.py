"""What multi-rank test workers print: whole lines, and one closing report gathered over all ranks.

The closing report is rank 0's: one line per rank that took part, ``"<heading>: rank R of N:
C checks, K failed"`` (R and N as that rank's own communicator gives them), then
``"<heading>, <total> checks, <k> failures"``. ``read_report`` is the tests' side: a launcher that
started N singletons instead of one world of N ranks prints N reports of ``rank 0 of 1``, and a
test that only looked for "0 failures" would pass while testing one rank.
"""
from __future__ import annotations

import os
import re
import sys


def print_line(text: str) -> None:
    """Write ``text`` and a newline to stdout as one write, so that ranks sharing a pipe never
    split each other's lines: under ``PYTHONUNBUFFERED=1`` (as in CI) ``print`` writes the text and
    its newline separately, and another rank's line can land in between."""
    sys.stdout.flush()
    data = (text + "\n").encode()
    while data:                        # a line under PIPE_BUF (4 KiB) enters a pipe whole, in one write
        data = data[os.write(sys.stdout.fileno(), data):]


def rank_lines(heading: str, every: list[tuple[int, int, int, int]]) -> list[str]:
    """The per-rank lines of a closing report: ``every`` holds (rank, size, checks, failed) per rank."""
    return [f"{heading}: rank {r} of {n}: {c} checks, {k} failed" for r, n, c, k in every]


def gather_and_report(heading: str, failures: list[str], cases: int, comm=None) -> int:
    """Rank 0 prints up to 50 failures, one line per rank (``rank_lines``) and
    ``"<heading>, <cases> checks, <k> failures"``; returns the exit status (1 on rank 0 if any rank failed)."""
    # Imported here, not at the top: importing it starts MPI, and print_line's users may not run under MPI.
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    every = comm.gather((comm.Get_rank(), comm.Get_size(), cases, failures), root=0)
    if comm.Get_rank() != 0:
        return 0
    flat = [f for _, _, _, fs in every for f in fs]
    for f in flat[:50]:
        print("FAIL", f)
    for line in rank_lines(heading, [(r, n, c, len(fs)) for r, n, c, fs in every]):
        print(line)
    print(f"{heading}, {sum(c for _, _, c, _ in every)} checks, {len(flat)} failures", flush=True)
    return 1 if flat else 0


def read_report(out: str, heading: str, n: int, same_on_every_rank: bool = True) -> list[int]:
    """Check a worker's closing report in ``out`` (a launch's output) and return each rank's
    number of checks, in rank order. ``heading`` is the report's heading, or its start (the
    text before the first comma that follows it is ignored: ``"multirank_worker"`` matches
    ``"multirank_worker: 4 ranks"``). Raises AssertionError, naming what is wrong, unless there
    is exactly one report, it says 0 failures, and ranks 0..n-1 each reported once, each with
    world size ``n`` and a nonzero number of checks, summing to the report's total; with
    ``same_on_every_rank`` (for workers that run the same checks on every rank), the same number."""
    head = re.escape(heading) + r"[^\n]*?"
    totals = re.findall(rf"^{head}, (\d+) checks, (\d+) failures$", out, re.M)
    ranks = [tuple(map(int, m)) for m in re.findall(rf"^{head}: rank (\d+) of (\d+): (\d+) checks, (\d+) failed$",
                                                      out, re.M)]
    tail = out[-3000:]
    assert len(totals) == 1, f"expected one closing report of {heading!r}, found {len(totals)}:\n{tail}"
    total, failed = map(int, totals[0])
    assert failed == 0, f"{heading}: {failed} failures:\n{tail}"
    seen = sorted((r, size) for r, size, _, _ in ranks)
    assert seen == [(r, n) for r in range(n)], (
        f"{heading}: asked for {n} ranks, but the ranks that reported (rank, world size) were {seen}: "
        f"is mpiexec the one that matches mpi4py's MPI?\n{tail}")
    checks = [c for _, _, c, _ in sorted(ranks)]
    assert min(checks) > 0, f"{heading}: a rank ran no checks: {checks}\n{tail}"
    assert not same_on_every_rank or len(set(checks)) == 1, f"{heading}: checks per rank differ: {checks}\n{tail}"
    assert sum(checks) == total, f"{heading}: the ranks' checks {checks} do not add up to the total {total}"
    _log_checks(heading, n, checks)
    return checks


def _log_checks(heading: str, n: int, checks: list[int]) -> None:
    """Append one line (the running test, the heading, each rank's checks) to the file named by
    ``TEST_CHECK_LOG`` when set: how a suite run's check counts are compared before and after a
    change to the tests (docs/testing.md). Not a ``DDL_*`` name: those are ddl_triton's options."""
    path = os.environ.get("TEST_CHECK_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{test}\t{heading}\t{n}\t{' '.join(map(str, checks))}\n".encode())
    finally:
        os.close(fd)
