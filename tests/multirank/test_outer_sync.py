"""Outer-sync training (ddl_triton.torch.DiLoCo on ddl_triton/outer_sync/) across ranks.

tests/multirank/outer_sync_worker.py on reused rank worlds; its docstring lists the checks: with
sync_every=1 DiLoCo equals per-step parameter averaging (==), the pseudo-gradient mean is exact,
replicas hold the same bits after every fragment's sync (fp32, int8, fragments=2 with
fragment_sync_delay=1), on 2 hosts of 2 ranks with DDP inside each host the outer sync sends one
shard per rank across hosts, and the contract's errors name the rank."""
from __future__ import annotations

import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report


@pytest.mark.slow
@pytest.mark.parametrize("n, topology", [(2, "1x2"), (3, "1x3"), (4, "2x2"), (2, "")])
def test_diloco_across_ranks(n, topology):
    # 1xN: one rank per emulated host (int8 between them); 2x2: two hosts of two ranks (replicas="hosts");
    # "": one host (int8 has no link to save bytes on: full precision).
    before = ddl_segments()
    env = {"DDL_TUNING_FILE": "off"}
    if topology:
        env["DDL_TOPOLOGY"] = topology
    proc = run_ranks(n, "multirank/outer_sync_worker.py", env=env, timeout=240)
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, f"outer_sync_worker: {n} ranks", n)
    assert sum(checks) >= 60 * n, checks
