"""Faults end in clear errors on every rank, never a hang: mismatched calls and a missing rank."""
from __future__ import annotations

import re

import pytest

from _launch import assert_clean_run, ddl_segments, run_ranks

_LINE = re.compile(r"FAULT case=(\w+) rank=(\d+) error=(\w+) seconds=([\d.]+) msg=(.*)")


def _faults(stdout: str) -> list[tuple[str, int, str, float, str]]:
    return [(c, int(r), e, float(s), m) for c, r, e, s, m in _LINE.findall(stdout)]


@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_mismatched_calls_raise_on_every_rank_with_each_ranks_call(transport):
    before = ddl_segments()
    proc = run_ranks(3, "fault_worker.py", "mismatch", env={"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "20"})
    assert_clean_run(proc, before)
    rows = _faults(proc.stdout)
    cases = {"collective", "numel", "dtype", "op", "barrier", "root"}
    assert {c for c, *_ in rows} == cases
    for case in cases:
        mine = [row for row in rows if row[0] == case]
        assert sorted(r for _, r, *_ in mine) == [0, 1, 2], f"{case}: not every rank reported"
        for _, rank, error, seconds, msg in mine:
            assert error == "CollectiveMismatch", f"{case} rank {rank}: {error} {msg}"
            assert seconds < 5, f"{case} rank {rank}: took {seconds} s (the deadline is 20 s)"
            assert f"rank {rank}:" in msg and all(f"rank {q}: " in msg for q in range(3)), msg


def test_a_rank_that_never_calls_times_out_the_others_naming_it():
    before = ddl_segments()
    proc = run_ranks(3, "fault_worker.py", "skip", env={"DDL_TIMEOUT": "3"})
    rows = _faults(proc.stdout)
    waiting = [row for row in rows if row[1] != 2]
    assert len(waiting) == 2, proc.stdout + proc.stderr
    for _, rank, error, seconds, msg in waiting:
        assert error == "CollectiveTimeout" and "rank 2" in msg and "allreduce #2" in msg, msg
        assert 3 <= seconds < 3 + 3, f"rank {rank}: error after {seconds} s for a 3 s deadline"
    assert not (ddl_segments() - before)
