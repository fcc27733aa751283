"""ddlrun (ddl_triton.launch.ddlrun): the pre-launch checks, the printed command, and real 2-rank launches."""
from __future__ import annotations

import os
import re
import shlex
import socket
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest

from ddl_triton import status_files
from ddl_triton.launch import checks, command, host_list, report, supervision
from ddl_triton.launch.ddlrun import main

JOB_TIMEOUT_S = 60
_CONSOLE_SCRIPT = Path(sys.executable).parent / "ddlrun"

RANK_REPORT = """\
import hashlib, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
secret = hashlib.sha256(os.environ['DDL_JOB_SECRET'].encode()).hexdigest()[:12]
sys.stdout.write(f"rank {comm.Get_rank()} of {comm.Get_size()} topology {os.environ['DDL_TOPOLOGY']} secret {secret}\\n")
"""

EXIT_3_ON_RANK_1 = """\
import sys
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:
    sys.exit(3)
"""

# A plain MPI program that ddlrun's signal ends: it makes no communicator, so it releases MPICH's
# init segment itself (what ddl_triton.init does), or every run of the test left one in /dev/shm.
WAIT_FOREVER = """\
import os, sys, time
from pathlib import Path
from mpi4py import MPI
from ddl_triton.runtime.setup.mpich_segment import release_init_segment
release_init_segment()
ready = Path(sys.argv[1], f"ready-{MPI.COMM_WORLD.Get_rank()}")
Path(f"{ready}.tmp").write_text(str(os.getpid()))
os.replace(f"{ready}.tmp", ready)
time.sleep(60)
"""


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A script that exists; dry runs never run it."""
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('a dry run must not run the script')\n")
    return str(path)


def write_script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def ddlrun(*args: str) -> list[str]:
    """The installed console script when there is one, else the module: the way a user starts it."""
    program = [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "ddl_triton.launch.ddlrun"]
    return [*program, *args]


def run_ddlrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(ddlrun(*args), capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def refused(capsys, argv: list[str]) -> str:
    """Run main(argv), require the check failure (exit 2, one ddlrun line, nothing on stdout); return the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddlrun: "), err
    return lines[0]


# --- pre-launch checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", ["2by2", "4", "2x", "x2", "2x0", "0x4", "2x2x2x1", "2x-2", "2X2"])
def test_topology_must_be_XxY_or_XxYxZ(capsys, script, topology):
    line = refused(capsys, ["-n", "4", "--topology", topology, "--", sys.executable, script])
    assert line.startswith(f"ddlrun: --topology {topology!r} is not XxY[xZ]")


def test_topology_must_cover_every_rank(capsys, script):
    line = refused(capsys, ["-n", "4", "--topology", "3x2", "--", sys.executable, script])
    assert line == "ddlrun: --topology 3x2 has 6 ranks but -n is 4"


def test_three_level_topology_is_accepted(capsys, script):
    assert main(["-n", "8", "--topology", "2x2x2", "--dry-run", "--", sys.executable, script]) == 0
    assert "DDL_TOPOLOGY=2x2x2 " in capsys.readouterr().err


@pytest.mark.parametrize("ranks", ["0", "-1"])
def test_ranks_must_be_at_least_one(capsys, script, ranks):
    assert refused(capsys, ["-n", ranks, sys.executable, script]) == f"ddlrun: -n must be at least 1, got {ranks}"


@pytest.mark.parametrize("seconds", ["0", "-5", "inf", "nan"])
def test_timeout_must_be_positive(capsys, script, seconds):
    assert "--timeout must be a positive number" in refused(capsys, ["-n", "2", "--timeout", seconds,
                                                                      sys.executable, script])


def test_missing_script_is_refused(capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    assert refused(capsys, ["-n", "2", "--", sys.executable, "-u", missing]).startswith(
        f"ddlrun: script {missing!r} does not exist")


def test_missing_py_command_is_refused(capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    assert missing in refused(capsys, ["-n", "2", missing])


def test_unknown_command_is_refused(capsys):
    assert refused(capsys, ["-n", "2", "no-such-program-ddl", "x"]) == \
        "ddlrun: command 'no-such-program-ddl' is not found on PATH"


def test_missing_mpiexec_is_refused(capsys, script):
    line = refused(capsys, ["-n", "2", "--mpiexec", "/nonexistent", "--", sys.executable, script])
    assert line == "ddlrun: --mpiexec /nonexistent does not exist"


def test_mpiexec_of_another_mpi_is_refused(capsys, script, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3'\n")
    fake.chmod(0o755)
    line = refused(capsys, ["-n", "2", "--mpiexec", str(fake), sys.executable, script])
    assert "uses MPICH" in line and "Open MPI" in line and str(fake) in line


def test_no_command_is_a_usage_error(capsys):
    assert main(["-n", "2", "--"]) == 2
    assert "no command to run" in capsys.readouterr().err


@pytest.mark.parametrize("command, script", [
    (["python", "train.py", "-m", "x"], "train.py"),
    (["/usr/bin/python3.11", "-u", "-W", "ignore", "-X", "dev", "train.py"], "train.py"),
    (["python3", "-Wignore", "-O", "--check-hash-based-pycs", "always", "train.py"], "train.py"),
    (["python", "-m", "pkg.train"], None),
    (["python", "-um", "pkg.train"], None),
    (["python", "-c", "print(1)"], None),
    (["python", "-"], None),
    (["python"], None),
    (["./train.py", "--lr", "1"], "./train.py"),
    (["bash", "run.sh"], None),
])
def test_which_word_is_the_script(command, script):
    assert checks._script_of(command) == script


@pytest.mark.parametrize("text, family", [
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", "MPICH"),
    ("HYDRA build details:\n    Version: 4.2.0", "MPICH"),
    ("MVAPICH2 Version     :\t2.3.7", "MPICH"),
    ("Open MPI v5.0.3, package: Open MPI ...", "Open MPI"),
    ("mpiexec (OpenRTE) 4.1.5", "Open MPI"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "Intel MPI"),
    ("Microsoft MPI 10.1", None),
])
def test_mpi_family_from_version_text(text, family):
    assert checks._mpi_family(text) == family


# --- the command and its environment -------------------------------------------------------------------

def test_dry_run_prints_the_command_and_runs_nothing(capsys, script):
    assert main(["-n", "4", "--topology", "2x2", "--timeout", "30", "--dry-run", "--",
                 sys.executable, script, "--dry-run", "-n", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    line = err.strip()
    assert line.startswith("ddlrun: ") and "\n" not in line
    words = shlex.split(line.removeprefix("ddlrun: "))
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    # Options after the command (even ddlrun's own names) belong to the command.
    guard = [sys.executable, command.RANK_GUARD]  # MPICH: every rank below its guard (see rank_guard.py)
    assert words == ["DDL_TOPOLOGY=2x2", "DDL_TIMEOUT=30", mpiexec, "-disable-auto-cleanup", "-n", "4", *guard,
                     sys.executable, script, "--dry-run", "-n", "1"]


def test_command_without_double_dash(capsys, script):
    assert main(["-n", "2", "--dry-run", sys.executable, "-u", script, "--epochs", "3"]) == 0
    words = shlex.split(capsys.readouterr().err.removeprefix("ddlrun: "))
    assert words[1:] == ["-disable-auto-cleanup", "-n", "2", sys.executable, command.RANK_GUARD,
                         sys.executable, "-u", script, "--epochs", "3"]


@pytest.mark.parametrize("spec,hydra", [("h1:2,h2:2", "h1:2,h2:2"), ("h1,h2:3", "h1:1,h2:3"),
                                         ("node-01.example:4", "node-01.example:4")])
def test_hosts_go_to_hydra_with_the_ssh_launcher(capsys, script, monkeypatch, spec, hydra):
    monkeypatch.delenv("HYDRA_LAUNCHER", raising=False)
    assert main(["-n", "4", "-H", spec, "--dry-run", "--", sys.executable, script]) == 0
    words = shlex.split(capsys.readouterr().err.removeprefix("ddlrun: "))
    assert words[1:7] == ["-disable-auto-cleanup", "-hosts", hydra, "-launcher", "ssh", "-n"]


def test_a_hostfile_in_either_spelling_and_a_chosen_launcher(capsys, script, tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nh1 slots=2\n\nh2:2   # the second\n")
    monkeypatch.setenv("HYDRA_LAUNCHER", "rsh")  # the user's choice of launcher is kept
    assert main(["-n", "4", "--hostfile", str(hostfile), "--dry-run", "--", sys.executable, script]) == 0
    words = shlex.split(capsys.readouterr().err.removeprefix("ddlrun: "))
    assert words[1:5] == ["-disable-auto-cleanup", "-hosts", "h1:2,h2:2", "-n"]


@pytest.mark.parametrize("args,message", [
    (["-n", "5", "-H", "h1:2,h2:2"], "ddlrun: -n 5 needs 5 slots, but -H h1:2,h2:2 gives 4 (h1:2,h2:2)"),
    (["-n", "2", "-H", "h1:0"], "ddlrun: -H 'h1:0': entry 'h1:0': slots must be a positive integer, got '0'"),
    (["-n", "2", "-H", "h1,,h2"], "ddlrun: -H 'h1,,h2': entry '': '' is not a host name"),
    (["-n", "2", "-H", "h1,h1"], "ddlrun: -H 'h1,h1': h1 named twice (give one entry with its slots)"),
    (["-n", "2", "--hostfile", "/nonexistent/hosts"], "ddlrun: --hostfile /nonexistent/hosts: cannot read it "
                                                      "(No such file or directory)"),
])
def test_bad_hosts_are_refused_before_launch(capsys, script, args, message):
    assert refused(capsys, [*args, "--", sys.executable, script]) == message


def test_a_hostfile_line_that_is_not_a_host_is_named(capsys, script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2\nh2 cpus=2\n")
    line = refused(capsys, ["-n", "2", "--hostfile", str(hostfile), "--", sys.executable, script])
    assert line == f"ddlrun: --hostfile {hostfile}, line 2: 'h2 cpus=2' is not NAME, NAME:SLOTS or NAME slots=SLOTS"


def test_open_mpi_gets_its_host_list():
    words = command.mpiexec_command("mpiexec", "Open MPI", 4, {}, ["python", "t.py"], hosts="h1:2,h2:2")
    assert words == ["mpiexec", "--host", "h1:2,h2:2", "-n", "4", "-x", "DDL_JOB_SECRET", "python", "t.py"]


def test_a_host_that_no_rank_of_a_failed_job_started_on_is_unreached():
    hosts = [("h1", 2), ("h2", 2), ("h3", 1)]
    assert host_list.ranks_on(hosts, 3) == {"h1": [0, 1], "h2": [2]}  # h3: no rank placed there
    records = _records(r0={"alive": ""}, r1={"start": "12", "returncode": "1"})
    assert host_list.unreached(hosts, 3, records) == {"h2": [2]}
    assert host_list.unreached(hosts, 3, {**records, 2: {"alive": ""}}) == {}  # its guard ran: reached


def test_ddlrun_names_the_host_it_could_not_reach(tmp_path, capsys):
    """ssh's own words ("Could not resolve hostname ...") never say which host of the job; ddlrun does
    (a name under .invalid never resolves: RFC 6761). Nothing starts, so no rank runs."""
    code = main(["-n", "1", "-H", "nosuchhost.invalid", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code != 0, err
    assert "ddlrun: could not reach host nosuchhost.invalid: none of its ranks (0) started there; its name does " \
           "not resolve" in err, err
    assert err.rstrip().splitlines()[-1].startswith("ddlrun: job failed with exit code ") and \
        err.rstrip().endswith("(could not reach host nosuchhost.invalid)"), err


def test_the_report_names_the_host_of_a_rank_on_another_host(capsys):
    here = socket.gethostname()
    ranks = _records(r0={"start": "11", "host": here}, r1={"start": "12", "host": "elsewhere-h2"})
    report.report_ranks(ranks, failed_pids=[11, 12])
    err = capsys.readouterr().err
    assert "rank 0 (pid 11)" in err and "rank 1 (pid 12 on elsewhere-h2)" in err, err


def test_every_rank_ended_needs_each_ranks_end_record(tmp_path):
    for rank in (0, 1, 3):
        status_files.record(str(tmp_path), rank, "returncode", "1")
    status_files.record(str(tmp_path), 2, "start", "123")
    assert not supervision._every_rank_ended(str(tmp_path), 4)  # rank 2 is still running
    status_files.record(str(tmp_path), 2, "returncode", "0")
    assert supervision._every_rank_ended(str(tmp_path), 4)
    assert not supervision._every_rank_ended(str(tmp_path), 5)


def test_a_rank_whose_guard_fell_silent_counts_as_ended_and_is_reported_with_its_host(tmp_path, capsys):
    folder = str(tmp_path)
    for rank in (0, 1):
        status_files.record(folder, rank, "returncode", "1")
    for rank in (2, 3):
        status_files.record(folder, rank, "start", str(100 + rank))
        status_files.record(folder, rank, "host", "far-h2")
        status_files.record(folder, rank, "alive", "")
    assert not supervision._every_rank_ended(folder, 4)  # their guards beat a moment ago: still running
    stale = time.time() - status_files.SILENT_SECONDS - 1
    os.utime(tmp_path / "rank2.alive", (stale, stale))
    assert status_files.silent_ranks(folder, status_files.read(folder)) == [2]
    assert not supervision._every_rank_ended(folder, 4)
    os.utime(tmp_path / "rank3.alive", (stale, stale))
    assert supervision._every_rank_ended(folder, 4)  # rank 3's host is gone too: nothing left to wait for
    ranks = status_files.read(folder)
    report.report_ranks(ranks, [], status_files.silent_ranks(folder, ranks))
    err = capsys.readouterr().err
    assert ("ddlrun: ranks whose guard fell silent, their host gone or cut off (far-h2): rank 2 (pid 102 on far-h2), "
            "rank 3 (pid 103 on far-h2)") in err, err
    assert "whose end nobody recorded" not in err  # each rank is described once


def test_child_env_sets_ddl_variables_over_the_base():
    args = Namespace(topology="2x2", timeout=2.5)
    env = command.child_env(args, base={"PATH": "/bin", "DDL_TOPOLOGY": "old", "DDL_JOB_SECRET": "s" * 20})
    assert env == {"PATH": "/bin", "DDL_TOPOLOGY": "2x2", "DDL_TIMEOUT": "2.5", "DDL_JOB_SECRET": "s" * 20}
    # Without one, a fresh credential for each job (Horovod's runner draws its secret key the same way).
    drawn = [command.child_env(Namespace(topology=None, timeout=None), base={"A": "1"}) for _ in range(2)]
    assert all(set(env) == {"A", "DDL_JOB_SECRET"} and re.fullmatch(r"[0-9a-f]{64}", env["DDL_JOB_SECRET"])
               for env in drawn) and drawn[0]["DDL_JOB_SECRET"] != drawn[1]["DDL_JOB_SECRET"]


def test_survivor_grace_is_one_deadline_plus_reporting_time():
    from ddl_triton.options import Options
    assert supervision.survivor_grace({}) == Options.timeout + supervision._REPORT_SECONDS
    assert supervision.survivor_grace({"DDL_TIMEOUT": "7"}) == 7 + supervision._REPORT_SECONDS


def test_open_mpi_is_told_to_export_the_variables():
    words = command.mpiexec_command("mpiexec", "Open MPI", 4, {"DDL_TOPOLOGY": "2x2"}, ["python", "t.py"])
    assert words == ["mpiexec", "-n", "4", "-x", "DDL_TOPOLOGY", "-x", "DDL_JOB_SECRET", "python", "t.py"]


def test_exit_status_of_a_job_killed_by_a_signal(capsys):
    assert report.report(-signal.SIGKILL) == 128 + signal.SIGKILL
    assert "job failed with exit code 137 (mpiexec was killed by SIGKILL)" in capsys.readouterr().err


def _records(**ranks: dict[str, str]) -> dict[int, dict[str, str]]:
    return {int(name[1:]): events for name, events in ranks.items()}


def test_job_status_is_the_killed_ranks_not_hydras_bitwise_or(capsys):
    ranks = _records(r0={"start": "10", "returncode": "3"}, r1={"start": "11", "killed": "11 SIGKILL",
                                                                "returncode": "137"},
                     r2={"start": "12", "returncode": "3", "exit": ""})
    assert report.job_status(ranks) == (137, "rank 1 was killed by SIGKILL")
    assert report.report(139, report.job_status(ranks)) == 137
    assert ("job failed with exit code 137 (rank 1 was killed by SIGKILL; mpiexec's 139 is the bitwise OR of the "
            "ranks' statuses)") in capsys.readouterr().err


def test_a_failing_ranks_status_wins_over_mpiexec_dying_of_a_signal_afterwards(capsys):
    ranks = _records(r0={"start": "10", "returncode": "0"}, r1={"start": "11", "returncode": "3", "exit": ""})
    assert report.report(-signal.SIGPIPE, report.job_status(ranks)) == 3
    assert "job failed with exit code 3 (rank 1 exited with status 3; mpiexec was then killed by SIGPIPE)" \
        in capsys.readouterr().err


def test_a_job_whose_every_rank_exited_zero_succeeded_whatever_mpiexec_says():
    clean = _records(r0={"start": "10", "returncode": "0"}, r1={"start": "11", "returncode": "0"})
    assert report.every_rank_exited_zero(clean, 2)
    assert not report.every_rank_exited_zero(clean, 3)  # rank 2 recorded nothing
    assert not report.every_rank_exited_zero({**clean, 1: {"start": "11", "returncode": "3"}}, 2)
    assert not report.every_rank_exited_zero({}, 0)


def test_settle_waits_for_a_remote_guards_last_record_but_not_for_a_silent_one(tmp_path):
    folder = str(tmp_path)
    status_files.record(folder, 0, "returncode", "0")
    status_files.record(folder, 1, "start", "11")
    status_files.record(folder, 1, "alive", "")
    late = threading.Timer(0.3, lambda: status_files.record(folder, 1, "returncode", "0"))
    late.start()
    t0 = time.monotonic()
    records = status_files.settle(folder, 2, patience=5)
    assert records[1]["returncode"] == "0" and 0.25 < time.monotonic() - t0 < 3
    status_files.record(folder, 2, "start", "12")
    status_files.record(folder, 2, "alive", "")
    stale = time.time() - status_files.SILENT_SECONDS - 1
    os.utime(tmp_path / "rank2.alive", (stale, stale))
    t0 = time.monotonic()
    assert "returncode" not in status_files.settle(folder, 3, patience=5)[2]
    assert time.monotonic() - t0 < 1  # its host is gone: nothing to wait for


def test_job_status_without_a_kill_is_the_lowest_failing_ranks():
    ranks = _records(r0={"returncode": "0"}, r1={"returncode": "4"}, r2={"returncode": "2"})
    assert report.job_status(ranks) == (4, "rank 1 exited with status 4")
    assert report.job_status(_records(r0={"returncode": "0"}, r1={"start": "5"})) is None  # mpiexec's then


def test_report_describes_each_rank_once_by_its_most_certain_record(capsys):
    ranks = _records(r0={"start": "10", "returncode": "3"},                       # os._exit(3): no exit handlers
                     r1={"start": "11", "killed": "11 SIGKILL", "returncode": "137"},  # named by its guard
                     r2={"start": "12", "exit": "", "returncode": "1", "error": "rank 2: lost rank 1"},
                     r3={"start": "13"})                                          # nothing saw it end
    report.report_ranks(ranks, failed_pids=[11])
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "ddlrun: ranks whose end nobody recorded (killed by a signal, crashed, or ended by the launcher's cleanup): "
        "rank 3 (pid 13)",
        "ddlrun: rank 0 (pid 10) exited with status 3 without running its exit handlers (os._exit, or a fatal error "
        "in the interpreter)",
        "ddlrun: mpiexec reported rank 1 (pid 11) as failed",
        "ddlrun: rank 2 reported: rank 2: lost rank 1",
        "ddlrun: exit status per rank: 0: 3, 1: 137, 2: 1",
    ]


# --- what ddlrun loads ----------------------------------------------------------------------------------

# In a fresh interpreter: import the launch room, then run ddlrun's --help and a dry run (every check,
# including the probe of mpi4py's library, which must run in a subprocess) and list what got loaded.
_LOADS = """\
import sys
import ddl_triton.launch
print("after import ddl_triton.launch:", "mpi4py.MPI" in sys.modules, "torch" in sys.modules)
import ddl_triton.launch.ddlrun as d
assert d.main(["--help"]) == 0
print("after --help:", "mpi4py.MPI" in sys.modules, "torch" in sys.modules)
assert d.main(["-n", "2", "--dry-run", "--", sys.executable, "-c", "pass"]) == 0
print("after a dry run:", "mpi4py.MPI" in sys.modules, "torch" in sys.modules)
"""


def test_ddlrun_imports_neither_torch_nor_mpi():
    proc = subprocess.run([sys.executable, "-c", _LOADS], capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("after ")]
    assert lines == ["after import ddl_triton.launch: False False", "after --help: False False",
                     "after a dry run: False False"], proc.stdout + proc.stderr
    assert "usage: ddlrun -n N" in proc.stdout


# --- real launches (mpiexec, 2 ranks) ------------------------------------------------------------------

def test_real_launch_sets_topology_on_every_rank(tmp_path):
    rank_report = write_script(tmp_path, "report.py", RANK_REPORT)
    proc = run_ddlrun("-n", "2", "--topology", "2x1", "--", sys.executable, rank_report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Lines from the two ranks may interleave mid-line (mpiexec merges their streams): match, don't split.
    assert sorted(re.findall(r"rank \d of \d topology \S+?(?= secret)", proc.stdout)) == \
        ["rank 0 of 2 topology 2x1", "rank 1 of 2 topology 2x1"], proc.stdout
    assert proc.stderr.startswith("ddlrun: DDL_TOPOLOGY=2x1 ")
    # Every rank got the job's credential, the same one; the printed command line does not show it.
    assert len(set(re.findall(r"secret ([0-9a-f]{12})", proc.stdout))) == 1, proc.stdout
    assert "DDL_JOB_SECRET" not in proc.stderr


def test_real_launch_forwards_a_rank_failure(tmp_path):
    failing = write_script(tmp_path, "fail.py", EXIT_3_ON_RANK_1)
    proc = run_ddlrun("-n", "2", sys.executable, failing)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ddlrun: job failed with exit code 3 (rank 1 exited with status 3)" in proc.stderr.splitlines()
    assert "ddlrun: exit status per rank: 0: 0, 1: 3" in proc.stderr.splitlines()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_ddlrun_stops_the_job(tmp_path, signum):
    waiting = write_script(tmp_path, "wait.py", WAIT_FOREVER)
    proc = subprocess.Popen(ddlrun("-n", "2", sys.executable, waiting, str(tmp_path)),
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "ddlrun: job failed with exit code" in err
    rank_pids = [int((tmp_path / f"ready-{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in rank_pids):
        assert time.monotonic() < deadline, f"ranks {rank_pids} outlived ddlrun"
        time.sleep(0.05)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ddlrun_names_the_rank_that_was_killed_and_the_survivors_exit_by_themselves(tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(
        "import os, signal, torch, ddl_triton as ddl\n"
        "comm = ddl.init()\n"
        "for i in range(50):\n"
        "    if comm.rank == 1 and i == 3:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    comm.allreduce(torch.ones(100))\n"
        "ddl.finalize()\n")
    ddlrun = Path(sys.executable).parent / "ddlrun"
    proc = subprocess.run([str(ddlrun), "-n", "3", "--timeout", "20", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 128 + 9, proc.stderr
    assert re.search(r"ddlrun: rank 1 \(pid \d+\) was killed by SIGKILL", proc.stderr), proc.stderr
    # Each survivor raised on its own (not killed by the launcher), naming rank 1, and exited 1.
    for survivor in (0, 2):
        assert re.search(rf"ddlrun: rank {survivor} reported: rank {survivor}: allreduce #4 .*rank 1 on \S+ died",
                         proc.stderr), proc.stderr
    assert "ddlrun: exit status per rank: 0: 1, 1: 137, 2: 1" in proc.stderr, proc.stderr
    assert "nobody recorded" not in proc.stderr, proc.stderr


# --- the rank guard (ddl_triton/launch/rank_guard.py) -----------------------------------------------------------

def run_guard(tmp_path, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PMI_RANK="5", DDL_STATUS_DIR=str(tmp_path))
    return subprocess.run([sys.executable, command.RANK_GUARD, sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_guard_turns_a_rank_killed_by_a_signal_into_exit_status_128_plus_n(tmp_path):
    proc = run_guard(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == 128 + 9
    pid, signame = (tmp_path / "rank5.killed").read_text().split()
    assert signame == "SIGKILL" and int(pid) > 0
    assert f"ddlrun: rank 5 (pid {pid}) was killed by SIGKILL" in proc.stderr
    assert (tmp_path / "rank5.returncode").read_text() == "137"


def test_guard_beats_a_heartbeat_while_the_rank_runs(tmp_path):
    proc = run_guard(tmp_path, "import time; time.sleep(3)")
    assert proc.returncode == 0
    beat = tmp_path / "rank5.alive"
    assert beat.exists() and time.time() - beat.stat().st_mtime < 2  # rewritten since the start, 3 s ago


def test_guard_passes_the_exit_status_and_default_signals_through(tmp_path):
    proc = run_guard(tmp_path, "import signal, sys; print(signal.getsignal(signal.SIGINT), "
                               "int(signal.getsignal(signal.SIGUSR1))); sys.exit(3)")
    assert proc.returncode == 3
    # The guard ignores SIGINT and SIGUSR1 itself; the rank must start with Python's defaults.
    assert proc.stdout.split() == ["<built-in", "function", "default_int_handler>", "0"]  # 0: SIG_DFL
    assert not (tmp_path / "rank5.killed").exists()
    assert (tmp_path / "rank5.returncode").read_text() == "3"


def _start_guard_of_rank0_of_2(tmp_path, hosts: tuple[str, str]):
    """The guard of rank 0 of a 2-rank job whose ranks recorded ``hosts``, holding one end of a
    socketpair as hydra's PMI socket; its rank exits 0 at once. Returns (guard, hydra's end)."""
    for rank, host in enumerate(hosts):
        (tmp_path / f"rank{rank}.host").write_text(host)
    hydra_end, rank_end = socket.socketpair()
    env = dict(os.environ, PMI_RANK="0", PMI_SIZE="2", PMI_FD=str(rank_end.fileno()), DDL_STATUS_DIR=str(tmp_path))
    guard = subprocess.Popen([sys.executable, command.RANK_GUARD, sys.executable, "-c", "pass"], env=env,
                             pass_fds=(rank_end.fileno(),), stdin=subprocess.DEVNULL)
    rank_end.close()
    hydra_end.settimeout(30)
    return guard, hydra_end


def test_across_hosts_a_guard_tells_hydra_at_once_and_outlasts_every_rank(tmp_path):
    # hydra passes a rank's end to the other hosts' proxies; one that already ended makes mpiexec
    # fail (EPIPE) and kill the ranks still tearing down. The notice must go out when the rank
    # ends, and the guard (so its proxy) must stay until every rank of the job has ended.
    guard, hydra_end = _start_guard_of_rank0_of_2(tmp_path, ("h1", "h2"))
    try:
        assert hydra_end.recv(1) == b""  # the PMI socket closed: hydra knows rank 0 ended ...
        recorded = tmp_path / "rank0.returncode"  # (written just after the close)
        deadline = time.monotonic() + 15
        while not (recorded.exists() and recorded.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recorded.read_text() == "0"
        time.sleep(1.5)
        assert guard.poll() is None      # ... while its guard waits for rank 1
        (tmp_path / "rank1.returncode").write_text("0")
        assert guard.wait(timeout=15) == 0
    finally:
        guard.kill()
        hydra_end.close()


def test_on_one_host_a_guard_does_not_wait_for_the_other_ranks(tmp_path):
    guard, hydra_end = _start_guard_of_rank0_of_2(tmp_path, ("h1", "h1"))
    try:
        assert guard.wait(timeout=15) == 0  # rank 1 never records its end; the cap is 30 s
        assert not (tmp_path / "rank1.returncode").exists()
    finally:
        guard.kill()
        hydra_end.close()


def test_stragglers_are_ended_a_grace_period_after_a_rank_was_lost(tmp_path):
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "rank0.killed").write_text("1 SIGKILL")
        t0 = time.monotonic()
        supervision._end_stragglers(straggler, str(tmp_path), grace=0.5)
        assert straggler.wait(timeout=10) == -signal.SIGTERM
        assert 0.5 <= time.monotonic() - t0 < 5
    finally:
        straggler.kill()
