"""The exact multi-rank suite: tests/multirank/multirank_worker.py under mpiexec, one launch per configuration
(the default suite, the matrix and the random mix of a world size share one launch, each with its
own report).

Each launch must report every rank of the world it asked for (rank 0..n-1, each of world size n), and
each rank exactly the number of checks its mode's case lists give (``planned_checks``)."""
from __future__ import annotations

import functools
import subprocess

import pytest
from multirank_worker import planned_checks  # this folder: pytest puts it on sys.path

from support.launch import ddl_segments, run_ranks
from support.report import read_report


# The quick cases through DDL_* variables (multirank_worker.py's ENV_VARIANTS), in the 3-rank launch.
ENV_MODES = ["quick:ring", "quick:one_shot", "quick:mpi"]
# The quick cases on the Triton kernels (under the interpreter), in the 2-rank launch.
TRITON_MODES = {2: ["quick:triton"]}
# The seed of each world size's random mix (test_seeded_random_mix_of_schedules_topologies_and_async).
FUZZ_SEEDS = {2: 11, 3: 12, 4: 13}


# The test that reads each mode's report, by the mode's name and the world size.
_READER = {"suite": "test_exact_default_dispatch[{n}]", "matrix": "test_every_schedule_on_every_topology[{n}]",
           "fuzz": "test_seeded_random_mix_of_schedules_topologies_and_async[{n}-{seed}]",
           "quick:ring": "test_exact_forced_schedule_through_environment[ring]",
           "quick:one_shot": "test_exact_forced_schedule_through_environment[one_shot]",
           "quick:mpi": "test_exact_over_mpi_transport", "quick:triton": "test_exact_with_triton_kernels"}


@pytest.fixture(scope="module")
def selected(request) -> set[str]:
    """The names of this file's tests that the session runs (``-k`` or a node id may select a few)."""
    return {item.name for item in request.session.items if item.module is request.module}


def _wanted(n: int, selected: set[str]) -> tuple[str, ...]:
    """The modes of the ``n``-rank launch whose tests run: all of them in a whole run, the default
    suite alone under ``make check``'s ``-k`` (a mode nobody reads costs its launch time for nothing)."""
    modes = ["suite", "matrix"] + (["fuzz"] if n in FUZZ_SEEDS else []) + (ENV_MODES if n == 3 else []) \
        + TRITON_MODES.get(n, [])
    return tuple(m for m in modes if _READER[m].format(n=n, seed=FUZZ_SEEDS.get(n)) in selected)


@functools.cache
def _suite_and_matrix(n: int, modes: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """One launch of ``n`` ranks running ``modes``: the default suite, the matrix, then (2-4 ranks)
    the seeded random mix and the quick cases, each with its own report (the worker's ``--modes``):
    the tests of a world size read their report from it, so each world size pays one launch, not
    one per mode. The launch, and the segments it left behind."""
    before = ddl_segments()
    fuzz = ("--fuzz", str(FUZZ_SEEDS[n])) if n in FUZZ_SEEDS else ()
    # At 2 ranks the Triton kernels' quick cases come last, interpreted: nothing before them loads a
    # Triton kernel (on a CPU only DDL_KERNELS=triton does), so the variable changes nothing else.
    env = {"TRITON_INTERPRET": "1"} if n == 2 else None
    proc = run_ranks(n, "multirank/multirank_worker.py", "--modes", ",".join(modes), *fuzz, env=env, timeout=480)
    return proc, ddl_segments() - before


def _read_mode(n: int, mode: str, selected: set[str]) -> None:
    """The checks of ``mode`` in the shared launch of ``n`` ranks: every rank, exactly as planned; then
    the launch's own verdict (exit 0, no segment left), which the other modes' tests check too."""
    proc, leaked = _suite_and_matrix(n, _wanted(n, selected))
    checks = read_report(proc.stdout, f"multirank_worker: {n} ranks, {mode}", n)
    planned = planned_checks(mode.split(":")[0], n)  # "quick:ring": the quick cases
    assert checks == [planned] * n, f"checks per rank {checks}, planned {planned}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_exact_default_dispatch(n, selected):
    _read_mode(n, "suite", selected)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_schedule_on_every_topology(n, selected):
    # Flat and emulated grids (2x2, 1x4, 4x1, 2x1x2, 3x1, ...): see TOPOLOGIES in multirank_worker.py.
    _read_mode(n, "matrix", selected)


@pytest.mark.parametrize("schedule", ["ring", "one_shot"])
def test_exact_forced_schedule_through_environment(schedule, selected):
    # DDL_SCHEDULE=<schedule>, DDL_CHUNK_BYTES=512, read by a communicator of the 3-rank shared launch.
    _read_mode(3, f"quick:{schedule}", selected)


def test_exact_over_mpi_transport(selected):
    # DDL_TRANSPORT=mpi, DDL_CHUNK_BYTES=1024, likewise.
    _read_mode(3, "quick:mpi", selected)


def test_exact_with_triton_kernels(selected):
    # DDL_KERNELS=triton, DDL_CHUNK_BYTES=2048 under TRITON_INTERPRET=1: the Triton kernels perform every
    # reduction step, on a communicator of the 2-rank shared launch.
    _read_mode(2, "quick:triton", selected)


@pytest.mark.parametrize("n,seed", list(FUZZ_SEEDS.items()))
def test_seeded_random_mix_of_schedules_topologies_and_async(n, seed, selected):
    _read_mode(n, "fuzz", selected)
