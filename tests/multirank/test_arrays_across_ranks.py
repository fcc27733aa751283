"""NumPy and JAX arrays through shm and MPI between processes: one launch of 3 ranks running
tests/multirank/arrays_worker.py (every collective x numpy/JAX against the torch path, exact,
bitwise alike on every rank; then arrays that differ in shape or dtype across ranks, which every
rank must be told of). The in-process cases are tests/unit/test_arrays.py."""
from __future__ import annotations

import pytest

from arrays_worker import planned_checks  # this folder: pytest puts it on sys.path

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report


def test_numpy_and_jax_arrays_through_shm_and_mpi_on_3_ranks():
    pytest.importorskip("jax", reason="the worker runs JAX arrays (the [jax] extra)")
    before = ddl_segments()
    proc = run_ranks(3, "multirank/arrays_worker.py", env={"DDL_TUNING_FILE": "off"}, timeout=240)
    assert_clean_run(proc, before)  # first: its message holds stderr too (once a launch printed nothing on stdout)
    checks = read_report(proc.stdout, "arrays_worker: 3 ranks", 3)
    assert checks == [planned_checks()] * 3, f"checks per rank {checks}, planned {planned_checks()}"
