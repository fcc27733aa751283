"""Outer-sync training (ddl_triton.torch.DiLoCo and ddl_triton.jax.DiLoCo on ddl_triton/outer_sync/) across ranks.

tests/multirank/outer_sync_worker.py on reused rank worlds; its docstring lists the checks: with
sync_every=1 DiLoCo equals per-step parameter averaging (==), the pseudo-gradient mean is exact,
replicas hold the same bits after every fragment's sync (fp32, int8, fragments=2 with
fragment_sync_delay=1), on 2 hosts of 2 ranks with DDP inside each host the outer sync sends one
shard per rank across hosts, and the contract's errors name the rank; tests/multirank/outer_sync_jax_worker.py
the same for JAX."""
from __future__ import annotations

import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report


@pytest.mark.slow
@pytest.mark.parametrize("n, topology", [(2, "1x2"), (3, "1x3"), (4, "2x2")])
def test_diloco_across_ranks(n, topology):
    # 1xN: one rank per emulated host (int8 between them); 2x2: two hosts of two ranks (replicas="hosts").
    before = ddl_segments()
    env = {"DDL_TUNING_FILE": "off", "DDL_TOPOLOGY": topology}
    proc = run_ranks(n, "multirank/outer_sync_worker.py", env=env, timeout=240)
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, f"outer_sync_worker: {n} ranks", n)
    assert sum(checks) >= 60 * n, checks


@pytest.mark.slow
def test_jax_diloco_across_two_emulated_hosts():
    # ddl_triton.jax.DiLoCo on the same core: per-step averaging ==, identical leaves after each sync (fp32, int8).
    import importlib.util
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
        pytest.skip("JAX or optax is not installed")
    before = ddl_segments()
    proc = run_ranks(2, "multirank/outer_sync_jax_worker.py", env={"DDL_TUNING_FILE": "off", "DDL_TOPOLOGY": "1x2"},
                     timeout=240)
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, "outer_sync_jax_worker: 2 ranks", 2)
    assert sum(checks) >= 60, checks
