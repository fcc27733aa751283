"""Faults end in clear errors on every rank, never a hang: mismatched calls and a missing rank."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.launch import assert_clean_run, ddl_segments, run_ranks

HERE = Path(__file__).resolve().parent
DDLRUN = Path(sys.executable).parent / "ddlrun"

_LINE = re.compile(r"FAULT case=(\w+) rank=(\d+) error=(\w+) seconds=([\d.]+) msg=(.*)")


def _faults(stdout: str) -> list[tuple[str, int, str, float, str]]:
    return [(c, int(r), e, float(s), m) for c, r, e, s, m in _LINE.findall(stdout)]


# auto: every peer on shm; mpi: every peer over MPI; 2x2: emulated hosts of 2 ranks, where the call
# lane (small allreduces included) reaches shm peers over MPI too.
MISMATCH_LAYOUTS = {"auto": (3, {}), "mpi": (3, {"DDL_TRANSPORT": "mpi"}), "2x2": (4, {"DDL_TOPOLOGY": "2x2"})}


@pytest.mark.parametrize("layout", list(MISMATCH_LAYOUTS))
def test_mismatched_calls_raise_on_every_rank_with_each_ranks_call(layout):
    before = ddl_segments()
    n, env = MISMATCH_LAYOUTS[layout]
    proc = run_ranks(n, "multirank/faults_worker.py", "mismatch", env={**env, "DDL_TIMEOUT": "20"}, own_launch=True)
    assert_clean_run(proc, before)
    rows = _faults(proc.stdout)
    cases = {"collective", "numel", "dtype", "op", "barrier", "root", "small_vs_large", "fast_entry"}
    assert {c for c, *_ in rows} == cases
    for case in cases:
        mine = [row for row in rows if row[0] == case]
        assert sorted(r for _, r, *_ in mine) == list(range(n)), f"{case}: not every rank reported"
        for _, rank, error, seconds, msg in mine:
            assert error == "CollectiveMismatch", f"{case} rank {rank}: {error} {msg}"
            assert seconds < 2, f"{case} rank {rank}: took {seconds} s (the deadline is 20 s)"
            assert f"rank {rank}:" in msg and all(f"rank {q}: " in msg for q in range(n)), msg


def test_a_rank_that_never_calls_times_out_the_others_naming_it():
    before = ddl_segments()
    proc = run_ranks(3, "multirank/faults_worker.py", "skip", env={"DDL_TIMEOUT": "3"}, own_launch=True)
    rows = _faults(proc.stdout)
    waiting = [row for row in rows if row[1] != 2]
    assert len(waiting) == 2, proc.stdout + proc.stderr
    for _, rank, error, seconds, msg in waiting:
        assert error == "CollectiveTimeout" and "rank 2" in msg and "allreduce #2" in msg, msg
        assert 3 <= seconds < 3 + 3, f"rank {rank}: error after {seconds} s for a 3 s deadline"
    assert not (ddl_segments() - before)


def test_init_under_mpi_with_a_rank_that_never_calls_it_ends_within_the_deadline():
    # dist.init_process_group("ddl") under mpiexec once blocked in MPI's blocking Dup() for ever
    # (15-20 s at DDL_TIMEOUT=3 before the launcher gave up): each step is now bounded by DDL_TIMEOUT.
    proc = run_ranks(2, "multirank/faults_worker.py", "absent_init", env={"DDL_TIMEOUT": "3"}, timeout=60,
                     own_launch=True)
    rows = [row for row in _faults(proc.stdout) if row[1] == 0]
    assert len(rows) == 1, proc.stdout + proc.stderr
    _, _, error, seconds, msg = rows[0]
    assert error == "BootstrapTimeout" and "did not complete within 3 s" in msg, msg
    assert seconds < 3 + 3, f"rank 0: error after {seconds} s for a 3 s deadline"


@pytest.mark.parametrize("victim,transport", [(0, "auto"), (1, "auto"), (2, "auto"), (1, "mpi"), (1, "native")])
def test_a_killed_rank_makes_every_survivor_raise_and_exit_nonzero(tmp_path, victim, transport):
    """Under ddlrun (mpiexec -disable-auto-cleanup, each rank below its guard) nobody kills the
    survivors for us: each must notice the loss itself, name it, and exit with status 1."""
    before = ddl_segments()
    stamp = tmp_path / "stamp"
    env = dict(os.environ, DDL_TRANSPORT=transport, PYTHONUNBUFFERED="1")
    if transport == "native":  # MPI's own allreduce (a group step), entered with no call check first
        env.update(DDL_TRANSPORT="auto", DDL_TOPOLOGY="1x3", DDL_SCHEDULE="hierarchical_native", DDL_CHECK_CALLS="0")
    deadline = 10
    proc = subprocess.run([str(DDLRUN), "-n", "3", "--timeout", str(deadline), "--", sys.executable,
                           str(HERE / "faults_worker.py"), "kill", str(victim), "--stamp", str(stamp)],
                          env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert re.search(rf"ddlrun: rank {victim} \(pid \d+\) was killed by SIGKILL", proc.stderr), proc.stderr
    rows = _faults(proc.stdout)
    survivors = sorted(r for r in range(3) if r != victim)
    assert sorted(r for _, r, *_ in rows) == survivors, proc.stdout + proc.stderr
    for _, rank, error, seconds, msg in rows:
        assert error == "CollectiveTimeout", msg
        assert seconds < 3, f"rank {rank} took {seconds} s to notice (deadline {deadline} s)"
        if transport == "auto":  # over shm the survivor finds the dead rank by its pid
            assert re.search(rf"rank {victim} on \S+ died", msg), msg  # the peer and its host (errors.py)
        else:  # over MPI, hydra's notice ends the wait (MPI cannot say which rank)
            assert "the launcher reported that a process of this job died" in msg, msg
        if transport == "native":
            assert "schedule hierarchical_native, step 'native allreduce'" in msg and "MPI allreduce among" in msg, msg
    codes = ", ".join(f"{r}: {137 if r == victim else 1}" for r in range(3))
    assert f"ddlrun: exit status per rank: {codes}" in proc.stderr, proc.stderr
    assert not (ddl_segments() - before)


def test_killing_every_rank_mid_collective_leaves_no_shared_memory(tmp_path):
    before, mpich_before = ddl_segments(), ddl_segments("mpich_shm_")  # MPICH's: one per host and job
    stamp = tmp_path / "stamp"
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    job = subprocess.Popen([mpiexec, "-n", "3", sys.executable, str(HERE / "faults_worker.py"), "kill", "3",
                            "--stamp", str(stamp)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=dict(os.environ, DDL_TIMEOUT="30"))
    try:
        deadline = time.monotonic() + 60
        # Wait until the ranks are inside their stream of collectives (every rank has mapped every segment).
        while len(list(tmp_path.glob("stamp.started.rank*"))) < 3:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("stamp.started.rank*")]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert not (ddl_segments() - before)
    assert not (ddl_segments("mpich_shm_") - mpich_before)  # no rank reached MPI_Finalize


# -- a rank that leaves while the others wait (issue 51, item 4) ---------------------------------------------------
# faults_worker.py's leave cases: what rank 1 does instead of the collective the others wait in.
_DID = {"close_small": "closed its communicator", "close_large": "closed its communicator",
        "close_barrier": "closed its communicator", "finalize": "called finalize",
        "destroy_group": "destroyed its process group", "exit": "reached exit"}
# auto: every peer on shm (the small-message lane, the general path's long waits, the barrier's
# fingerprint wait); 1x3: three emulated hosts, every peer through the call lane (MPI's, or the
# lane's own TCP connections when a store bootstrapped the ranks).
LEAVE_LAYOUTS = {"auto": {}, "1x3": {"DDL_TOPOLOGY": "1x3"}}


def _check_leave_rows(rows, codes: dict[int, int], out: str, tmpdir) -> None:
    """Every case: rank 1 reports no error; ranks 0 and 2 raise CollectiveSkipped within 2 s (the
    deadline is 30 s) naming rank 1 and what it did instead; the waiting ranks exit 1 (the error of the
    last case, uncaught), rank 1 exits 0. Every dump (named in the errors) is in one folder per job
    under the user's default folder in ``tmpdir`` ($TMPDIR): the ranks agreed on the job's id, and
    kept it across the job's six world communicators."""
    from faults_worker import LEAVE_CASES

    folders = {os.path.dirname(p) for p in re.findall(r"\[flight recorder: (\S+)\]", out)}
    assert len(folders) == 1, folders
    job = Path(folders.pop())
    assert job.parent == tmpdir / f"ddl_triton-flight-{os.getuid()}", job
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", job.name), job
    assert sorted(p.name for p in job.iterdir()) == ["flight-rank0.json", "flight-rank2.json"]

    assert [c for c, r, *_ in rows if r == 1] == list(LEAVE_CASES), out[-6000:]
    for case in LEAVE_CASES:
        waiting = sorted((row for row in rows if row[0] == case and row[1] != 1), key=lambda row: row[1])
        assert [r for _, r, *_ in waiting] == [0, 2], f"{case}: {out[-6000:]}"
        for _, rank, error, seconds, msg in waiting:
            call = "barrier" if case == "close_barrier" else "allreduce"
            assert error == "CollectiveSkipped", f"{case} rank {rank}: {error} {msg}"
            assert re.match(rf"rank {rank}: rank 1 on \S+ {_DID[case]} while rank {rank} waits in {call} #2 "
                            r"\(rank 1 had issued 1 collective on this communicator\)", msg), msg
            assert seconds < 2, f"{case} rank {rank}: raised after {seconds} s"
    assert codes == {0: 1, 1: 0, 2: 1}, out[-6000:]


@pytest.mark.parametrize("layout", list(LEAVE_LAYOUTS))
def test_a_rank_that_leaves_instead_of_calling_is_named_at_once_under_mpi(tmp_path, layout):
    before = ddl_segments()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), **LEAVE_LAYOUTS[layout])
    proc = subprocess.run([str(DDLRUN), "-n", "3", "--timeout", "30", "--", sys.executable,
                           str(HERE / "faults_worker.py"), "leave"], env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL, cwd=str(HERE.parent))
    out = proc.stdout + proc.stderr
    status = re.search(r"ddlrun: exit status per rank: (.*)", proc.stderr)
    codes = {int(r): int(c) for r, c in re.findall(r"(\d+): (\d+)", status.group(1))} if status else {}
    _check_leave_rows(_faults(proc.stdout), codes, out, tmp_path)
    assert not (ddl_segments() - before)


@pytest.mark.parametrize("layout", list(LEAVE_LAYOUTS))
def test_a_rank_that_leaves_instead_of_calling_is_named_at_once_over_a_store(tmp_path, layout):
    """The same cases with ranks a store bootstrapped (env://, as torchrun's): shm within the host, the
    lane's own TCP connections across emulated hosts, and no exit rendezvous (rank 1's process ends)."""
    from support.launch import TESTS, torch_launcher_env

    before = ddl_segments()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(HERE / "faults_worker.py"), "leave"], cwd=str(TESTS),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=torch_launcher_env(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=str(port), DDL_TIMEOUT="30",
                                                     TMPDIR=str(tmp_path), **LEAVE_LAYOUTS[layout]))
             for r in range(3)]
    outs, codes = [], {}
    try:
        for r, p in enumerate(procs):
            outs.append(p.communicate(timeout=180)[0])
            codes[r] = p.returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "\n".join(outs)
    _check_leave_rows(_faults(out), codes, out, tmp_path)
    assert not (ddl_segments() - before)
