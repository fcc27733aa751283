"""The exact multi-rank suite: tests/multirank/multirank_worker.py under mpiexec, one launch per configuration."""
from __future__ import annotations

import re

import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks


def _run(n: int, *args: str, env: dict[str, str] | None = None) -> str:
    before = ddl_segments()
    proc = run_ranks(n, "multirank/multirank_worker.py", *args, env=env)
    assert_clean_run(proc, before)
    m = re.search(r"multirank_worker: (\d+) ranks, (\d+) checks, 0 failures", proc.stdout)
    assert m, proc.stdout[-3000:]
    assert int(m.group(2)) > 100, "the worker ran suspiciously few checks"
    return proc.stdout


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_exact_default_dispatch(n):
    _run(n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_schedule_on_every_topology(n):
    # Flat and emulated grids (2x2, 1x4, 4x1, 2x1x2, 3x1, ...): see TOPOLOGIES in multirank_worker.py.
    _run(n, "--matrix")


@pytest.mark.parametrize("schedule", ["ring", "one_shot"])
def test_exact_forced_schedule_through_environment(schedule):
    _run(3, "--quick", env={"DDL_SCHEDULE": schedule, "DDL_CHUNK_BYTES": "512"})


def test_exact_over_mpi_transport():
    _run(3, "--quick", env={"DDL_TRANSPORT": "mpi", "DDL_CHUNK_BYTES": "1024"})


def test_exact_with_triton_kernels():
    # The Triton kernels (under the interpreter) perform every reduction step.
    _run(2, "--quick", env={"DDL_KERNELS": "triton", "TRITON_INTERPRET": "1", "DDL_CHUNK_BYTES": "2048"})


@pytest.mark.parametrize("n,seed", [(2, 11), (3, 12), (4, 13)])
def test_seeded_random_mix_of_schedules_topologies_and_async(n, seed):
    _run(n, "--fuzz", str(seed))
