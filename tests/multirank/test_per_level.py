"""Per-level compression (ddl_triton/runtime/compression/per_level.py, hooks.auto_compress_hook, Options.compression).

Each test launches tests/multirank/per_level_worker.py under mpiexec; its docstring lists the
checks: on emulated hosts (DDL_TOPOLOGY) exact int8 results where the blocks are exact, the
same bits on every rank, fp32 on shm and only compressed bytes on the link (measured per
level with ``transport_bytes``), the 1-bit error-feedback identity, the hook and the option
path agreeing bitwise; on one host, never compressing.
"""
from __future__ import annotations


import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report


def _run(n: int, env: dict[str, str], min_checks: int) -> str:
    before = ddl_segments()
    proc = run_ranks(n, "multirank/per_level_worker.py", env=env, timeout=180)
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, f"per_level_worker: {n} ranks", n)  # every rank, each of n
    assert sum(checks) >= min_checks, f"the worker ran suspiciously few checks: {checks}\n{proc.stdout[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("n, topology", [(4, "2x2"), (2, "1x2")])
def test_per_level_across_emulated_hosts(n, topology):
    # 2x2: the three phases; 1x2: one rank per host, the compressed allreduce over the world.
    _run(n, {"DDL_TOPOLOGY": topology, "DDL_COMPRESSION": "int8", "DDL_TUNING_FILE": "off"}, min_checks=300)


def test_per_level_never_compresses_on_one_host():
    _run(2, {"DDL_TUNING_FILE": "off"}, min_checks=60)
