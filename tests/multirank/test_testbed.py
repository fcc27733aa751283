"""The testbed (ddl_triton/testbed/): hosts built from namespaces that share nothing but a bridge,
MPI and ddl_triton across them, and nothing left behind. Skipped, with the reason, where the
machine cannot build hosts (no root or no namespaces)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddl_triton import testbed  # the module, not its classes: pytest would try to collect Testbed*
from ddl_triton.testbed import check_available, hosts as hosts_mod, reap

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRATCH = ROOT / "build" / "testbed-tests"  # on the shared file system: each host's /tmp is its own

try:
    check_available()
    _UNAVAILABLE = ""
except testbed.TestbedUnavailable as e:
    _UNAVAILABLE = str(e)
needs_hosts = pytest.mark.skipif(bool(_UNAVAILABLE), reason=_UNAVAILABLE or "")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ours(name: str) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(f"{name}-")}


@pytest.fixture(scope="module")
def bed():
    if _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE)
    reap()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    with testbed.Testbed(hosts=2, rate="1gbit") as made:
        yield made
    assert not _ours(made.name)


def test_without_root_it_refuses_in_one_clear_line(monkeypatch):
    monkeypatch.setattr(hosts_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(testbed.TestbedUnavailable, match=r"^ddl-testbed: needs root") as e:
        check_available()
    assert "\n" not in str(e.value)


def test_rates_and_bursts():
    assert hosts_mod.parse_rate("1gbit") == 10**9 and hosts_mod.parse_rate("10mbit") == 10**7
    assert hosts_mod.burst_bytes("1gbit") == 250_000 and hosts_mod.burst_bytes("10mbit") == 64 << 10
    with pytest.raises(ValueError, match="is not like"):
        hosts_mod.parse_rate("fast")


def test_the_folders_a_job_needs_under_tmp_stay_shared():
    shared = hosts_mod._shared_under_tmp(("/tmp/ddl-clone-x/.venv/bin", "/work/elsewhere"))
    assert "/tmp/ddl-clone-x" in shared and not any(d.startswith("/work") for d in shared)


@needs_hosts
def test_hosts_share_nothing_but_the_network(bed):
    names = [bed.run(h, ["hostname"]).stdout.strip() for h in bed.hosts]
    assert names == ["h1", "h2"]
    boot = [bed.run(h, ["cat", "/proc/sys/kernel/random/boot_id"]).stdout for h in bed.hosts]
    assert boot[0] != boot[1]
    assert bed.run("h1", ["sh", "-c", "echo x > /dev/shm/ddl_triton-testbed-probe && echo y > /tmp/probe"]).returncode == 0
    assert bed.run("h2", ["ls", "/dev/shm/ddl_triton-testbed-probe"]).returncode != 0
    assert bed.run("h2", ["ls", "/tmp/probe"]).returncode != 0
    assert not os.path.exists("/dev/shm/ddl_triton-testbed-probe")  # nor in the root namespace
    links = bed.run("h1", ["ip", "-o", "link"]).stdout
    assert "eth0" in links and len(links.splitlines()) == 2, links  # lo and eth0 only
    for ns, dev in ((f"{bed.name}-h1", "eth0"), (f"{bed.name}-sw", f"{bed.name}h1p")):
        qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc  # both directions shaped


_SERVE = "import socket; s = socket.create_server(('0.0.0.0', 29555)); c, _ = s.accept(); c.sendall(b'hi'); c.close()"
_CALL = ("import socket, sys\ntry:\n    c = socket.create_connection(('h1', 29555), timeout=2); print(c.recv(2).decode())\n"
         "except OSError as e:\n    print('no route:', type(e).__name__); sys.exit(3)")


@needs_hosts
def test_hosts_reach_each_other_by_name_and_a_cut_link_carries_nothing(bed):
    server = bed.popen("h1", [sys.executable, "-c", _SERVE])
    try:
        time.sleep(0.5)
        bed.cut("h1")
        cut = bed.run("h2", [sys.executable, "-c", _CALL], timeout=30)
        assert cut.returncode == 3, cut.stdout + cut.stderr
        bed.mend("h1")
        for _ in range(20):  # the port comes back through the bridge's learning: bounded
            done = bed.run("h2", [sys.executable, "-c", _CALL], timeout=30)
            if done.returncode == 0:
                break
            time.sleep(0.25)
        assert done.stdout.strip() == "hi", done.stdout + done.stderr
    finally:
        server.kill()
        server.wait(10)


_ALLREDUCE = textwrap.dedent("""
    import socket, sys, torch, ddl_triton as ddl
    from support.report import print_line  # one write per line: four ranks share mpiexec's pipe
    c = ddl.init()
    bad = 0
    for n in (0, 1, 7, 1000, 65537):
        for dtype in (torch.float32, torch.int32):
            t = (torch.arange(n) % 97 + c.rank + 1).to(dtype)
            want = sum((torch.arange(n) % 97 + r + 1).to(dtype) for r in range(c.size)) if n else t.clone()
            c.allreduce(t)
            bad += not torch.equal(t, want)
    moved = c.transport_bytes
    print_line(f"RANK {c.rank} host {socket.gethostname()} topology {c.topology.signature} bad {bad} "
               f"mpi {moved.get('mpi', {}).get('sent', 0)} shm {moved.get('shm', {}).get('sent', 0)}")
    ddl.finalize()
""")


# Every host runs its ranks through hydra's ssh launcher, with the testbed's stand-in for ssh.
_ACROSS = ["env", "UCX_NET_DEVICES=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}", "DDL_TUNING_FILE=off",
           "OMP_NUM_THREADS=1"]
_LAUNCHERS = {"mpiexec": [str(BIN / "mpiexec"), "-hosts", "h1:2,h2:2", "-launcher", "ssh", "-n", "4"],
              "ddlrun": [str(BIN / "ddlrun"), "-n", "4", "-H", "h1:2,h2:2", "--"]}


def _across(bed, launcher: str, body: str, timeout_s: int = 30) -> subprocess.CompletedProcess:
    """Run ``body`` as a script on 2 ranks of each host, launched from h1 by ``launcher``."""
    script = SCRATCH / f"{launcher}_{abs(hash(body))}.py"
    script.write_text(body)
    return bed.run("h1", [*_ACROSS, f"DDL_TIMEOUT={timeout_s}", *_LAUNCHERS[launcher], sys.executable, str(script)],
                   cwd=str(ROOT), timeout=120)


@needs_hosts
@pytest.mark.parametrize("launcher", ["mpiexec", "ddlrun"])
def test_ddl_over_mpi_across_two_hosts_detects_the_grid_and_is_exact(bed, launcher):
    done = _across(bed, launcher, _ALLREDUCE)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert len(lines) == 4, done.stdout
    for rank, line in enumerate(lines):
        words = line.split()
        assert words[3] == ("h1" if rank < 2 else "h2") and words[5] == "2x2" and words[7] == "0", line
        assert int(words[9]) > 0 and int(words[11]) > 0, line  # MPI between the hosts, shm within each


@needs_hosts
def test_the_command_line_brings_hosts_up_runs_on_them_and_takes_them_down():
    cli = str(BIN / "ddl-testbed")
    up = subprocess.run([cli, "up", "--hosts", "2", "--rate", "100mbit", "--name", "dtcli"], capture_output=True,
                        text=True, timeout=60)
    try:
        assert up.returncode == 0 and up.stdout.startswith("dtcli: h1 10.77.0.1, h2 10.77.0.2"), up.stdout + up.stderr
        run = subprocess.run([cli, "exec", "--name", "dtcli", "h2", "--", "hostname"], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0 and run.stdout.strip() == "h2"
        again = subprocess.run([cli, "up", "--name", "dtcli"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "already up" in again.stderr
    finally:
        down = subprocess.run([cli, "down", "--name", "dtcli"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and not _ours("dtcli")
    missing = subprocess.run([cli, "exec", "--name", "dtcli", "h1", "--", "true"], capture_output=True, text=True)
    assert missing.returncode == 2 and "no testbed named 'dtcli'" in missing.stderr


_OWNER = textwrap.dedent("""
    import sys, time
    from ddl_triton.testbed import Testbed
    with Testbed(hosts=2, rate="", name=sys.argv[1]) as bed:
        print("up", flush=True)
        bed.popen("h2", ["sleep", "600"])
        time.sleep(600)
""")


@needs_hosts
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_nothing_is_left_behind_after_ctrl_c_sigterm_or_a_killed_owner(how):
    name = {"ctrl-c": "dtint", "sigterm": "dtterm", "sigkill": "dtkil"}[how]
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, name], stdout=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        assert owner.stdout.readline().strip() == "up"
        assert _ours(name) == {f"{name}-h1", f"{name}-h2", f"{name}-sw"}
        owner.send_signal({"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how])
        owner.wait(30)
        if how == "sigkill":  # no clean-up could run: the next run's reap removes it
            assert _ours(name)
            assert name in reap()
    finally:
        owner.kill()
    assert not _ours(name)
    assert not (hosts_mod.STATE_DIR / f"{name}.json").exists()
    stray = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True).stdout.split()
    assert not stray, stray


_EXITS_3_ON_H2 = textwrap.dedent("""
    import sys, torch, ddl_triton as ddl
    c = ddl.init()
    t = torch.ones(10)
    c.allreduce(t)
    assert t.eq(c.size).all()
    c.barrier()
    if c.rank == 3:
        sys.exit(3)
    ddl.finalize()
""")


@needs_hosts
def test_ddlrun_across_hosts_exits_with_the_status_of_a_far_rank_that_fails(bed):
    done = _across(bed, "ddlrun", _EXITS_3_ON_H2, timeout_s=20)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "ddlrun: exit status per rank: 0: 0, 1: 0, 2: 0, 3: 3" in out, out  # h2's ranks' status files too


_RUNS_UNTIL_CUT = textwrap.dedent("""
    import time, torch, ddl_triton as ddl
    from support.report import print_line
    c = ddl.init()
    c.allreduce(torch.ones(10))
    print_line(f"READY rank {c.rank}")
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            c.allreduce(torch.ones(100000))
            time.sleep(0.001)
    except Exception as e:
        print_line(f"LOST rank {c.rank} after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
        raise SystemExit(1)
""")


@needs_hosts
def test_a_link_cut_mid_collective_ends_the_job_at_the_deadline_on_both_sides(bed):
    """h2's link is cut while 2 x 2 ranks run allreduces: every rank, on both hosts, raises a
    CollectiveTimeout at the deadline, and ddlrun ends the job a moment later (mpiexec alone would
    wait minutes for the proxy it can no longer reach) with a non-zero status."""
    script = SCRATCH / "runs_until_cut.py"
    script.write_text(_RUNS_UNTIL_CUT)
    log_path = SCRATCH / "runs_until_cut.log"
    with open(log_path, "w") as log:
        job = bed.popen("h1", [*_ACROSS, "DDL_TIMEOUT=10", *_LAUNCHERS["ddlrun"], sys.executable, str(script)],
                        cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):  # every rank has started its allreduces: bounded, 60 s
            if log_path.read_text().count("READY") == 4 or job.poll() is not None:
                break
            time.sleep(0.1)
        assert log_path.read_text().count("READY") == 4, log_path.read_text()
        time.sleep(1)
        bed.cut("h2")
        cut_at = time.monotonic()
        job.wait(10 + 30)
        ended_after = time.monotonic() - cut_at
    finally:
        if job.poll() is None:
            job.kill()
        bed.mend("h2")
    out = log_path.read_text()
    assert job.returncode != 0, out
    # h2's own output travels to mpiexec over the cut link, but every rank's error is in the status
    # files, which ddlrun reads back: every rank, on both sides of the cut, timed out in a collective.
    reported = re.findall(r"^ddlrun: rank (\d) reported: rank \1: allreduce #\d+ .*timed out", out, re.M)
    assert sorted(int(r) for r in reported) == [0, 1, 2, 3], out
    assert "ddlrun: exit status per rank: 0: 1, 1: 1, 2: 1, 3: 1" in out, out
    assert ended_after < 10 + 15, (ended_after, out)  # the deadline and a few seconds, on 2 busy cores
    assert "every rank has ended, but mpiexec is still waiting" in out, out
