"""Ranks that disagree are told so at init, on every rank, by name; a rank that never arrives
at init cannot hang the others (ddl_triton/runtime/setup/option_agreement.py, bootstrap_values.py), and
ranks at exit wait for a late one at most DDL_TIMEOUT (ddl_triton/runtime/world.py).

Before option agreement, different DDL_CHUNK_BYTES or DDL_PIPELINE_DEPTH ended in "mmap length
is greater than file size" on one rank and the other killed, and different DDL_SCHEDULE in a
CollectiveTimeout much later that named no cause."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

from support.launch import TESTS, ddl_segments, run_ranks, torch_launcher_env

WORKER = "multirank/option_mismatch_worker.py"
_LINE = re.compile(r"^INIT scenario=(\w+) rank=(\d+) error=(\w+) seconds=([\d.]+) msg=(.*)$", re.M)
EXPECTED = {
    "chunk_bytes": "options differ across ranks: chunk_bytes is 1048576 on rank 0, 4194304 on rank 1 (DDL_CHUNK_BYTES)",
    "pipeline_depth": "options differ across ranks: pipeline_depth is 2 on rank 0, 4 on rank 1 (DDL_PIPELINE_DEPTH)",
    "schedule": "options differ across ranks: schedule is 'ring' on rank 0, 'one_shot' on rank 1 (DDL_SCHEDULE)",
}


def _rows(out: str) -> dict[tuple[str, int], tuple[str, float, str]]:
    return {(s, int(r)): (e, float(t), m) for s, r, e, t, m in _LINE.findall(out)}


def _assert_told(rows: dict, scenarios: list[str], out: str) -> None:
    for scenario in scenarios:
        for rank in range(2):
            assert (scenario, rank) in rows, f"{scenario}: rank {rank} reported nothing\n{out[-4000:]}"
            error, seconds, msg = rows[(scenario, rank)]
            assert (error, msg) == ("OptionsDiffer", f"rank {rank}: {EXPECTED[scenario]}"), (scenario, rank, error, msg)
            assert seconds < 5, f"{scenario}: rank {rank} was told after {seconds} s"


def test_mismatched_options_are_named_on_every_rank_at_init_under_mpi():
    before = ddl_segments()
    scenarios = ["pipeline_depth", "schedule", "chunk_bytes"]  # the last one ends the ranks
    proc = run_ranks(2, WORKER, *scenarios, env={"DDL_TIMEOUT": "20"}, timeout=120, own_launch=True)
    out = proc.stdout + proc.stderr
    _assert_told(_rows(proc.stdout), scenarios, out)
    assert proc.returncode != 0, out[-4000:]
    assert "OptionsDiffer: rank 0: options differ" in proc.stderr and "OptionsDiffer: rank 1:" in proc.stderr, out
    assert not ddl_segments() - before, "shared-memory segments left behind"


def test_mismatched_options_are_named_on_every_rank_at_init_over_a_store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = ddl_segments()
    procs = [subprocess.Popen([sys.executable, str(TESTS / WORKER), "chunk_bytes"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=torch_launcher_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=str(port), DDL_TIMEOUT="20"))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = "".join(o + e for o, e in outs)
    _assert_told(_rows("".join(o for o, _ in outs)), ["chunk_bytes"], out)
    assert all(p.returncode != 0 for p in procs), ([p.returncode for p in procs], out[-4000:])
    assert not ddl_segments() - before, "shared-memory segments left behind"


def test_a_rank_that_never_arrives_at_init_cannot_hang_the_others():
    before = ddl_segments()
    proc = run_ranks(2, WORKER, "absent", env={"DDL_TIMEOUT": "2"}, timeout=60, own_launch=True)
    out = proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert ("absent", 0) in rows, out[-4000:]
    error, seconds, msg = rows[("absent", 0)]
    assert error == "BootstrapTimeout" and msg.startswith("rank 0: ddl_triton init (") and \
        "did not complete within 2 s" in msg, msg
    assert 2 <= seconds < 2 + 3, f"rank 0 gave up after {seconds} s for a 2 s deadline"
    assert proc.returncode != 0, out[-4000:]
    assert not ddl_segments() - before, "shared-memory segments left behind"


def test_a_rank_that_fails_init_is_named_by_the_others_at_the_deadline():
    before = ddl_segments()
    proc = run_ranks(2, WORKER, "fails_in_shm", env={"DDL_TIMEOUT": "2"}, timeout=60, own_launch=True)
    out = proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert rows.get(("fails_in_shm", 1), ("",))[0] == "OSError", out[-4000:]
    error, seconds, msg = rows[("fails_in_shm", 0)]
    assert error == "BootstrapTimeout" and msg.startswith("rank 0: ddl_triton init (barrier) did not complete within "
                                                         "2 s: rank(s) 1 of 2 did not arrive."), msg
    assert 2 <= seconds < 2 + 3, f"rank 0 gave up after {seconds} s for a 2 s deadline"
    assert proc.returncode != 0, out[-4000:]
    assert not ddl_segments() - before, "shared-memory segments left behind"


def test_a_rank_that_never_makes_a_ddl_subgroup_is_named_at_the_deadline():
    """MPI's Create_group (a "ddl" subgroup under mpiexec) blocks until every member arrives; the
    members meet first within DDL_TIMEOUT (bootstrap_values.mpi_members_meet), so a member that never
    comes is named at the deadline instead of holding the others for ever."""
    proc = run_ranks(2, WORKER, "subgroup_absent", env={"DDL_TIMEOUT": "2"}, timeout=60, own_launch=True)
    out = proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert ("subgroup_absent", 0) in rows, out[-4000:]
    error, seconds, msg = rows[("subgroup_absent", 0)]
    assert error == "BootstrapTimeout" and msg == (
        "rank 0: creating the 'ddl' subgroup [0, 1] did not complete within 2 s: member rank(s) 1 of [0, 1] did "
        "not arrive (each member must create the group; DDL_TIMEOUT bounds the wait)"), msg
    assert 2 <= seconds < 2 + 3, f"rank 0 gave up after {seconds} s for a 2 s deadline"
    assert proc.returncode != 0, out[-4000:]


def test_ranks_at_exit_wait_for_a_late_rank_at_most_the_deadline():
    # Rank 1 stays busy 8 s after its last collective; rank 0, at exit, gives up after DDL_TIMEOUT
    # (2 s), reports, and leaves without finalizing (exit 1); the launcher then ends rank 1.
    proc = run_ranks(2, WORKER, "slow_exit", env={"DDL_TIMEOUT": "2"}, timeout=60, own_launch=True)
    ended = time.time()
    out = proc.stdout + proc.stderr
    at_exit = re.search(r"^EXIT rank=0 at=([\d.]+)$", proc.stdout, re.M)
    assert at_exit, out[-4000:]
    assert re.search(r"ddl_triton: rank 0: at exit, before MPI_Finalize: .*every rank at exit within 2 s "
                     r"\(DDL_TIMEOUT", proc.stderr), out[-4000:]
    assert proc.returncode != 0, out[-4000:]
    waited = ended - float(at_exit.group(1))  # rank 1 is busy for 8 s from about when rank 0 reached exit
    assert waited < 6, f"the job ended {waited:.1f} s after rank 0 reached exit: it waited past its 2 s deadline"
