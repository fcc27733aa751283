"""ddlrun signals only its own ranks (issue 41, row 2): a pid in a rank's start record is signalled
only when the record proves it is that rank, on this host (ddl_triton/status_files.py's identity records,
launch/supervision.py's _signal_ranks); another host's rank is reached through its own rank guard.

Each case runs a live ``sleep`` as the process a record points at (SIGUSR2's default action ends
it), so a wrong signal shows as a dead process, and the genuine rank's case shows the signal still
arrives: the tests fail whichever way the choice goes wrong."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from ddl_triton import status_files
from ddl_triton.launch import supervision

GUARD = Path(supervision.__file__).with_name("rank_guard.py")


@pytest.fixture
def sleeper():
    """Start ``sleep 30`` children with SIGUSR2 at its default action (terminate); killed after."""
    started = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "30"], restore_signals=True)
        started.append(p)
        for _ in range(200):  # until it has exec'd: its identity is sleep's, not Python's
            if status_files.identity(p.pid)["cmdline"].startswith("sleep"):
                return p
            time.sleep(0.005)
        raise AssertionError("sleep did not start")

    yield start
    for p in started:
        p.kill()
        p.wait()


def _alive(p: subprocess.Popen) -> bool:
    time.sleep(0.05)
    return p.poll() is None


def _write_rank(folder: Path, rank: int, pid: int, **changes) -> None:
    """The records a rank writes at init (status_files.start) for process ``pid``, with ``changes``."""
    record = dict(status_files.identity(pid), **changes)
    status_files.record(str(folder), rank, "host", record["host"])
    status_files.record(str(folder), rank, "identity", json.dumps(record))
    status_files.record(str(folder), rank, "start", str(pid))


def _cases(folder: Path, sleeper) -> dict[str, subprocess.Popen]:
    """rank 0: ours, here; rank 1: "another host" whose pid is a live local process; rank 2: the
    same host and boot, another boot id; rank 3: a pid of this host reused by another program;
    rank 4: the same program restarted at that pid (another start time); rank 5: no identity."""
    procs = {name: sleeper() for name in ("ours", "other_host", "other_boot", "reused", "restarted", "bare")}
    _write_rank(folder, 0, procs["ours"].pid)
    _write_rank(folder, 1, procs["other_host"].pid, host="h-elsewhere", boot_id="0d7c1c7e-other-boot")
    _write_rank(folder, 2, procs["other_boot"].pid, boot_id="0d7c1c7e-other-boot")
    _write_rank(folder, 3, procs["reused"].pid, cmdline=f"{sys.executable}\0train.py\0")
    _write_rank(folder, 4, procs["restarted"].pid, start_time="1")
    status_files.record(str(folder), 5, "start", str(procs["bare"].pid))  # an old-style record: nothing proven
    return procs


def _only_ours_was_signalled(folder: Path, procs: dict[str, subprocess.Popen]) -> None:
    procs["ours"].wait(5)
    assert procs["ours"].returncode == -signal.SIGUSR2  # the genuine rank of this host is signalled
    for name, p in procs.items():
        if name != "ours":
            assert _alive(p), f"{name}: a process that is not provably our rank was signalled"
    # The ranks not provably here are asked through their own guards, which signal only their child.
    for rank in (1, 2, 3, 4, 5):
        assert (folder / f"rank{rank}.signal").read_text() == "SIGUSR2"
    assert not (folder / "rank0.signal").exists()


def test_signal_ranks_signals_only_a_rank_proven_ours_on_this_host(tmp_path, sleeper):
    procs = _cases(tmp_path, sleeper)
    supervision._signal_ranks(str(tmp_path), signal.SIGUSR2)
    _only_ours_was_signalled(tmp_path, procs)


def test_sigusr2_sent_to_ddlrun_reaches_only_its_own_ranks(tmp_path, sleeper):
    procs = _cases(tmp_path, sleeper)
    with supervision._signals_passed_to(mock.Mock(), str(tmp_path)):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)  # the handler runs between bytecodes of this thread
    _only_ours_was_signalled(tmp_path, procs)


def test_after_a_lost_rank_the_dump_request_reaches_only_its_own_ranks(tmp_path, sleeper, monkeypatch):
    procs = _cases(tmp_path, sleeper)
    status_files.record(str(tmp_path), 6, "returncode", "137")  # a rank was lost
    monkeypatch.setattr(supervision, "_DUMP_SECONDS", 0.0)
    mpiexec = sleeper()
    supervision._end_stragglers(mpiexec, str(tmp_path), grace=0.0, ranks=7)
    assert mpiexec.wait(5) == -signal.SIGTERM  # the job is then ended through mpiexec
    _only_ours_was_signalled(tmp_path, procs)


def test_a_record_that_is_not_json_or_lacks_fields_proves_nothing():
    for identity in ("", "not json", "[1]", json.dumps({"pid": os.getpid()}), json.dumps({"pid": "1"})):
        assert status_files.signallable({"identity": identity, "start": str(os.getpid())}) is None
    mine = status_files.identity(os.getpid())
    assert status_files.signallable({"identity": json.dumps(mine), "start": str(os.getpid())}) == os.getpid()
    assert status_files.signallable({"identity": json.dumps(mine), "start": "1"}) is None


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_the_rank_guard_passes_a_requested_sigusr2_to_its_own_rank_only(tmp_path):
    """How a rank on another host is reached: its guard reads ``rank<r>.signal`` and signals the
    child it started; any other signal named there is dropped."""
    rank = [sys.executable, "-c", "import signal, sys, time\n"
            "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(7))\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(9))\n"
            "print('up', flush=True); time.sleep(30)"]
    env = dict(os.environ, DDL_STATUS_DIR=str(tmp_path), PMI_RANK="3")
    env.pop("PMI_SIZE", None)
    guard = subprocess.Popen([sys.executable, str(GUARD), *rank], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert guard.stdout.readline().strip() == "up"
        status_files.request_signal(str(tmp_path), 3, "SIGTERM")  # not a signal ddlrun relays
        deadline = time.monotonic() + 3  # the guard reads (and removes) a request at each 1 s beat
        while (tmp_path / "rank3.signal").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        assert guard.poll() is None and not (tmp_path / "rank3.signal").exists()
        status_files.request_signal(str(tmp_path), 3)
        assert guard.wait(5) == 7
        assert (tmp_path / "rank3.returncode").read_text() == "7"
    finally:
        guard.kill()
        guard.wait()
