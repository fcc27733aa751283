"""Per-level compression across two real hosts (the testbed: namespaces with their own /dev/shm,
hostname and boot id, joined by a 1 Gbit/s shaped link), under ddlrun with 2 ranks per host.

tests/multirank/per_level_worker.py --quick on the detected 2x2 grid: exact int8 results where
the blocks are exact, the same bits on every rank, fp32 only on each host's shm and only the
compressed bytes on the link (per level, from ``transport_bytes``), the 1-bit error-feedback
identity, and ``auto`` deciding alike on every rank from its probe of the real link.
"""
from __future__ import annotations

import sys
from pathlib import Path

from support.real_hosts import namespaces, skip_unless_available
from support.report import read_report

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_per_level_compression_across_two_real_hosts():
    skip_unless_available()  # with the reason; under CI_REQUIRE_REAL_HOSTS=1 a failure
    from ddl_triton.testbed import Testbed

    before = namespaces()
    env = ["env", "-u", "DDL_TOPOLOGY", "UCX_NET_DEVICES=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}",
           "DDL_TUNING_FILE=off", "OMP_NUM_THREADS=1", "DDL_TIMEOUT=60", "PYTHONPATH=" + str(ROOT / "tests")]
    with Testbed(hosts=2, rate="1gbit") as bed:
        done = bed.run("h1", [*env, str(BIN / "ddlrun"), "-n", "4", "-H", "h1:2,h2:2", "--", sys.executable,
                              str(ROOT / "tests" / "multirank" / "per_level_worker.py"), "--quick"],
                       cwd=str(ROOT), timeout=120, restore_signals=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = read_report(done.stdout, "per_level_worker: 4 ranks", 4)  # every rank of the 4, each of world size 4
    assert sum(checks) > 150, done.stdout[-3000:]
    assert namespaces() <= before, "the testbed left namespaces behind"
