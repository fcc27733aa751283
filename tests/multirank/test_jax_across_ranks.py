"""ddl_triton.jax between processes: tests/multirank/jax_worker.py in two launches, 3 ranks under
mpiexec and 2 ranks over env:// (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, no MPI world, no
torch.distributed call in the worker). Each launch must report every rank, the same checks on
each, 0 failures, then every rank's bad-input checks (after the report: the shape mismatch
poisons the communicator), exit 0 and leave no shared memory behind. The in-process cases are
tests/unit/test_jax.py."""
from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from support.launch import TESTS, assert_clean_run, ddl_segments, run_ranks, torch_launcher_env
from support.report import read_report

pytest.importorskip("jax", reason="the JAX tier needs the [jax] extra")
pytest.importorskip("optax", reason="the JAX tier needs the [jax] extra")


def _check(out: str, n: int, launcher: str) -> None:
    checks = read_report(out, f"jax_worker: {n} ranks, {launcher}", n)
    assert checks[0] >= 250, f"too few checks ran: {checks}"
    bad = sorted((int(r), int(c), int(k)) for r, c, k in
                 re.findall(r"^jax_worker bad input: rank (\d+): (\d+) checks, (\d+) failed$", out, re.M))
    assert [r for r, _, _ in bad] == list(range(n)), f"bad-input lines {bad}\n{out[-3000:]}"
    assert all(k == 0 and c > checks[0] for _, c, k in bad), f"bad-input checks {bad}\n{out[-3000:]}"


def test_jax_on_3_ranks_under_mpiexec():
    before = ddl_segments()
    proc = run_ranks(3, "multirank/jax_worker.py", env={"DDL_TUNING_FILE": "off"}, timeout=240)
    _check(proc.stdout, 3, "mpi")
    assert_clean_run(proc, before)


def test_jax_on_2_ranks_over_env_variables():
    before = ddl_segments()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "multirank/jax_worker.py"], cwd=str(TESTS), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=torch_launcher_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=str(port), DDL_TUNING_FILE="off"))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "".join(outs)
    assert [p.returncode for p in procs] == [0, 0], out[-6000:]
    _check(out, 2, "env")
    assert not ddl_segments() - before, f"shared-memory segments left behind: {sorted(ddl_segments() - before)}"
