"""Outer-sync training (ddl_triton.torch.DiLoCo and ddl_triton.jax.DiLoCo on ddl_triton/outer_sync/) across ranks.

tests/multirank/outer_sync_worker.py on reused rank worlds; its docstring lists the checks: with
sync_every=1 DiLoCo equals per-step parameter averaging (==), the pseudo-gradient mean is exact,
replicas hold the same bits after every fragment's sync (fp32, int8, fragments=2 with
fragment_sync_delay=1), on 2 hosts of 2 ranks with DDP inside each host the outer sync sends one
shard per rank across hosts, and the contract's errors name the rank; tests/multirank/outer_sync_jax_worker.py
the same for JAX; examples/diloco_train.py under ddlrun exits 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.launch import TESTS, assert_clean_run, ddl_segments, run_ranks
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


@pytest.mark.slow
def test_the_example_runs_under_ddlrun_and_exits_0():
    # examples/diloco_train.py as docs/outer_sync.md runs it (shortened): Streaming DiLoCo with int8
    # pseudo-gradients between two emulated hosts; progress printed, replicas identical, exit status 0.
    before = ddl_segments()
    proc = subprocess.run([str(Path(sys.executable).parent / "ddlrun"), "-n", "2", "--topology", "1x2", "--",
                           sys.executable, "examples/diloco_train.py", "--steps", "32", "--sync-every", "8",
                           "--fragments", "2", "--delay", "1", "--compression", "int8"],
                          cwd=TESTS.parent, env={**os.environ, "DDL_TUNING_FILE": "off"},
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step 32/32: outer round 4" in proc.stdout, out
    assert "global parameters bitwise identical: True" in proc.stdout, out
    assert ddl_segments() - before == set()
