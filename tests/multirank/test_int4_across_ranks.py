"""The int4 compressed allreduce on 2, 3 and 4 real ranks (reused rank worlds):
tests/multirank/int4_worker.py's docstring lists the checks (identical bits on every rank, exact
results for representable inputs, the row's error bound, the error-feedback identity, bad input
refused naming the rank)."""
from __future__ import annotations

import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_int4_allreduce_across_ranks(n):
    before = ddl_segments()
    proc = run_ranks(n, "multirank/int4_worker.py", timeout=180)
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, f"int4_worker: {n} ranks", n)
    assert sum(checks) >= 45 * n, f"the worker ran suspiciously few checks: {checks}\n{proc.stdout[-3000:]}"
