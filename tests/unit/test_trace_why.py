"""`python -m ddl_triton.trace why` on dumps written by the flight recorder itself (no ranks): it names
the rank that never issued the call, also when that rank left no dump (it left the communicator while
the others waited, and they recorded how), and it never reads the dumps of two jobs as one (issue 51,
item 4). The same diagnosis on a real job: tests/multirank/test_observability.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from ddl_triton.observability import flight
from ddl_triton.observability.diagnose import diagnose, load_dumps

_ALLREDUCE = ("allreduce", "sum", 1000, torch.float32, None)


def _dump(folder, rank: int, calls: int, job: str, last: str = "done", left: dict | None = None,
          size: int = 3) -> str:
    """Rank ``rank``'s dump after ``calls`` allreduces on communicator 1, the last one ending ``last``
    (``left``: the peer that left without issuing it, as the issue path records a CollectiveSkipped)."""
    recorder = flight.FlightRecorder(capacity=100)
    recorder.configure(rank=rank, size=size, capacity=100, dump_dir=str(folder))
    recorder.job = job  # as init's agreement sets it (ddl_triton/runtime/setup/job_id.py)
    for seq in range(1, calls + 1):
        record = recorder.issue(1, seq, _ALLREDUCE)
        record.state = "done" if seq < calls else last
        if seq == calls and left is not None:
            record.left = left
    return recorder.dump("test")


def test_a_rank_that_left_without_a_dump_is_named_as_the_one_that_never_issued_the_call(tmp_path):
    """Rank 1 called finalize after 5 allreduces; ranks 0 and 2 raised CollectiveSkipped in #6 and
    dumped; rank 1 dumped nothing. The old diagnosis said "all ranks reached ... allreduce #6"."""
    left = {"rank": 1, "did": "called finalize", "calls": 5, "failed": False}
    for rank in (0, 2):
        _dump(tmp_path, rank, 6, "job-a", last="failed", left=left)
    lines = diagnose(load_dumps(str(tmp_path)))
    site = lines[0].split("issued it from ")[1].split(")")[0]
    assert lines[0] == (f"rank 1 never issued allreduce #6 (ranks 0, 2 issued it from {site}): it called finalize "
                        "after 5 collectives on this communicator, as ranks 0, 2 saw (it left no dump)"), lines
    assert "rank 0 was waiting in allreduce #6 when rank 1 called finalize" in lines, lines
    assert "rank 2 was waiting in allreduce #6 when rank 1 called finalize" in lines, lines
    assert not any(line.startswith("all ranks") for line in lines), lines


def test_a_rank_without_a_dump_is_not_counted_among_those_that_reached_the_call(tmp_path):
    """Nobody recorded why rank 1 is missing (killed, say): the diagnosis must not claim it reached #6."""
    for rank in (0, 2):
        _dump(tmp_path, rank, 6, "job-a", last="failed")
    lines = diagnose(load_dumps(str(tmp_path)))
    assert lines[0].startswith("ranks 0, 2 reached step '(before its first step)' of allreduce #6; whether rank 1 "
                               "(no dump) issued it is unknown"), lines


def test_dumps_of_another_job_in_the_same_folder_are_set_aside_and_named(tmp_path):
    """An older job's rank 1 dumped into the folder (DDL_DUMP_DIR reused) in #9; this job's rank 1
    left after #5 without a dump: the diagnosis is this job's, and says what it set aside."""
    _dump(tmp_path, 1, 9, "job-old", last="failed")
    time.sleep(0.01)
    left = {"rank": 1, "did": "reached exit", "calls": 5, "failed": False}
    for rank in (0, 2):
        _dump(tmp_path, rank, 6, "job-new", last="failed", left=left)
    from ddl_triton.observability.diagnose import load_job
    dumps, notes = load_job(str(tmp_path))
    assert sorted(dumps) == [0, 2] and {d["job"] for d in dumps.values()} == {"job-new"}
    assert notes == ["set aside 1 dump of another job (job-old) than the newest here (job-new): flight-rank1.json"]
    assert diagnose(dumps)[0].startswith("rank 1 never issued allreduce #6 "), diagnose(dumps)


def test_why_reads_the_newest_job_of_a_folder_of_job_folders(tmp_path):
    """The default dump folder holds a folder per job: `why` on it reads the newest job's, and says so."""
    _dump(tmp_path / "job-old", 0, 3, "job-old", last="failed")
    time.sleep(0.01)
    left = {"rank": 1, "did": "destroyed its process group", "calls": 0, "failed": False}
    _dump(tmp_path / "job-new", 0, 1, "job-new", last="failed", left=left, size=2)
    why = subprocess.run([sys.executable, "-m", "ddl_triton.trace", "why", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert why.returncode == 0, why.stderr
    lines = why.stdout.splitlines()
    assert lines[0].startswith("rank 1 never issued allreduce #1 (rank 0 issued it from ") and \
        lines[0].endswith("): it destroyed its process group after 0 collectives on this communicator, as rank 0 "
                          "saw (it left no dump)"), lines
    assert f"{tmp_path} holds the dumps of 2 jobs; this is the newest, job-new (the others: job-old; name a job's " \
           "folder to read it)" in lines, lines
    assert os.path.isdir(tmp_path / "job-old")
