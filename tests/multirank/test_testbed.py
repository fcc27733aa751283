"""The testbed (ddl_triton/testbed/): hosts built from namespaces that share nothing but a bridge,
MPI and ddl_triton across them, and nothing left behind. Skipped, with the reason, where the
machine cannot build hosts (no root or no namespaces)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ddl_triton import testbed  # the module, not its classes: pytest would try to collect Testbed*
from ddl_triton.testbed import check_available, hosts as hosts_mod, reap
from support.real_hosts import UNAVAILABLE as _UNAVAILABLE, namespaces as _namespaces
from support.report import read_report

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRATCH = ROOT / "build" / "testbed-tests"  # on the shared file system: each host's /tmp is its own

needs_hosts = pytest.mark.skipif(bool(_UNAVAILABLE), reason=_UNAVAILABLE or "")


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
    inits = [bed.run(h, ["cat", "/proc/1/cmdline"]).stdout for h in bed.hosts]
    assert all("holder.py" in i for i in inits), inits  # each host's own PID namespace, its holder its init
    boot = [bed.run(h, ["cat", "/proc/sys/kernel/random/boot_id"]).stdout for h in bed.hosts]
    assert boot[0] != boot[1]
    assert bed.run("h1", ["sh", "-c", "echo x > /dev/shm/ddl_triton-testbed-probe && echo y > /tmp/probe"]).returncode == 0
    assert bed.run("h2", ["ls", "/dev/shm/ddl_triton-testbed-probe"]).returncode != 0
    assert bed.run("h2", ["ls", "/tmp/probe"]).returncode != 0
    assert not os.path.exists("/dev/shm/ddl_triton-testbed-probe")  # nor in the root namespace
    bed.run("h1", ["rm", "/dev/shm/ddl_triton-testbed-probe", "/tmp/probe"])  # later jobs check for leaks
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


_BYTES = textwrap.dedent("""
    import socket, torch, ddl_triton as ddl
    from support.report import print_line  # one write per line: four ranks share mpiexec's pipe
    c = ddl.init()
    for n in (1 << 16, 100003):  # S = 4n bytes; the second does not split evenly
        t = (torch.arange(n) % 97 + c.rank).float()
        before = c.transport_bytes
        c.allreduce(t)
        after = c.transport_bytes
        sent = {k: after[k]["sent"] - before.get(k, {}).get("sent", 0) for k in after}
        exact = torch.equal(t, (torch.arange(n) % 97).float() * c.size + sum(range(c.size)))
        print_line(f"RANK {c.rank} host {socket.gethostname()} topology {c.topology.signature} n {n} "
                   f"exact {exact} mpi {sent.get('mpi', 0)} shm {sent.get('shm', 0)} links {','.join(c.placement.links)}")
    ddl.finalize()
""")


# Every host runs its ranks through hydra's ssh launcher, with the testbed's stand-in for ssh.
_ACROSS = ["env", "-u", "DDL_TOPOLOGY", "UCX_NET_DEVICES=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}", "DDL_TUNING_FILE=off",
           "OMP_NUM_THREADS=1", "PYTHONPATH=" + str(ROOT / "tests")]
_LAUNCHERS = {"ddlrun": [str(BIN / "ddlrun"), "-n", "4", "-H", "h1:2,h2:2", "--"]}


def _across(bed, launcher: str, body: str | Path, timeout_s: int = 30, *args: str, env: tuple[str, ...] = ()):
    """Run ``body`` (a script's text, or a path) on 2 ranks of each host, launched from h1 by ``launcher``."""
    if isinstance(body, str):
        script = SCRATCH / f"{launcher}_{abs(hash(body))}.py"
        script.write_text(body)
    else:
        script = body
    # restore_signals=False: mpiexec keeps pytest's ignored SIGPIPE, as ddlrun gives it (supervision.py).
    return bed.run("h1", [*_ACROSS, f"DDL_TIMEOUT={timeout_s}", *env, *_LAUNCHERS[launcher], sys.executable,
                          str(script), *args], cwd=str(ROOT), timeout=180, restore_signals=False)


@needs_hosts
def test_every_collective_op_and_dtype_exact_and_identical_across_two_hosts_under_ddlrun(bed):
    # The exact suite (every collective, op and dtype, sizes 0, 1, primes, not divisible by 4,
    # bitwise identical on every rank), with no DDL_TOPOLOGY: the 2x2 grid comes from the hosts.
    # Under ddlrun, not plain mpiexec: hydra alone may exit 141 or 255 after a clean job across
    # hosts (docs/launch.md), which ddlrun sees through.
    done = _across(bed, "ddlrun", ROOT / "tests" / "multirank" / "multirank_worker.py", 60, "--quick")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = read_report(done.stdout, "multirank_worker: 4 ranks", 4)  # ranks 0..3, each of world size 4
    assert sum(checks) > 1000, done.stdout[-3000:]


# A ring and a tree across the hosts mix shm and MPI hops in one cycle of waits: an MPI send
# must keep moving while its sender waits on shm (MpiTransport.progress_during_other_waits),
# or the first large allreduce deadlocks. 1 MB chunks make MPI's rendezvous certain.
_MIXED_HOPS = """
import torch
from mpi4py import MPI
import ddl_triton as ddl
from support.report import print_line
for schedule in ("ring", "tree"):
    c = ddl.init(MPI.COMM_WORLD.Dup(), schedule=schedule, chunk_bytes=1 << 20)
    for n in (262_147, 1_000_003):
        t = (torch.arange(n) % 89 + c.rank).float()
        c.allreduce(t)
        exact = torch.equal(t, (torch.arange(n) % 89).float() * c.size + sum(range(c.size)))
        print_line(f"RANK {c.rank} {schedule} n {n} exact {exact} links {','.join(c.placement.links)}")
    c.close()
ddl.finalize()
"""


@needs_hosts
def test_ring_and_tree_across_hosts_mixing_shm_and_mpi_hops_finish_exact(bed):
    done = _across(bed, "ddlrun", _MIXED_HOPS, 20)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("RANK")]
    assert len(rows) == 4 * 2 * 2 and sorted({int(w[1]) for w in rows}) == [0, 1, 2, 3], done.stdout  # 4 ranks
    assert all(w[6] == "True" for w in rows), done.stdout
    assert all("shm" in w[8] and "mpi" in w[8] for w in rows), done.stdout  # both kinds of hop


@needs_hosts
@pytest.mark.parametrize("schedule", ["hierarchical", "hierarchical_native"])
def test_hierarchical_across_hosts_sends_1_over_x_of_the_bytes_over_mpi_and_none_over_shm(bed, schedule):
    """Under ddlrun, the grid is detected as 2x2; shm links only ranks of one host; and the
    hierarchical allreduce of S bytes puts exactly the link's bound, 2(H-1)/H * S, on each host's
    link: each of its X = 2 ranks sends 1/X of it over MPI (its shard), and 2(X-1)/X * S over shm.
    hierarchical_native hands that shard to MPI's own allreduce, and moves the same bytes."""
    done = _across(bed, "ddlrun", _BYTES, env=(f"DDL_SCHEDULE={schedule}",))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("RANK")]
    assert len(rows) == 8 and sorted({int(w[1]) for w in rows}) == [0, 1, 2, 3], done.stdout  # 4 ranks
    per_host: dict[tuple[str, int], int] = {}
    for w in rows:
        rank, host, n, mpi, shm = int(w[1]), w[3], int(w[7]), int(w[11]), int(w[13])
        size = 4 * n
        assert host == ("h1" if rank < 2 else "h2") and w[5] == "2x2" and w[9] == "True", w
        want_links = ["self" if p == rank else "shm" if (p < 2) == (rank < 2) else "mpi" for p in range(4)]
        assert w[15].split(",") == want_links, w  # no shm link, so no shm byte, between the hosts
        assert shm == size, w                     # 2(X-1)/X * S within the host
        assert abs(mpi - size // 2) <= 4, w       # 1/X of the link's bound (one element of rounding)
        if n % 2 == 0:
            assert mpi == size // 2, w
        per_host[(host, n)] = per_host.get((host, n), 0) + mpi
    hosts = 2
    for (host, n), mpi in per_host.items():
        assert mpi == 2 * (hosts - 1) * 4 * n // hosts, (host, n, mpi)  # the bound 2(H-1)/H * S, exactly


# Each rank waits for SIGUSR2 (its own handler, set after init), then records it and ends cleanly.
_AWAIT_USR2 = """
import os, signal, sys, time
from pathlib import Path
import torch, ddl_triton as ddl
c = ddl.init()
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
c.allreduce(torch.ones(10))
Path(sys.argv[1], f"ready-{c.rank}-of-{c.size}").write_text("")
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
if got:
    Path(sys.argv[1], f"usr2-{c.rank}").write_text("")
ddl.finalize()
"""


@needs_hosts
def test_sigusr2_to_ddlrun_reaches_every_rank_on_every_host_and_nothing_else(bed, tmp_path):
    """Each host has its own PID namespace: h2's ranks' pids mean other processes (or none) on h1,
    where ddlrun runs. ddlrun signals h1's ranks by their proven identity and h2's through their
    own rank guards (docs/launch.md); the old ddlrun sent h2's pids the signal on h1."""
    folder = Path(tempfile.mkdtemp(prefix="usr2-", dir=SCRATCH))
    script = folder / "await_usr2.py"
    script.write_text(_AWAIT_USR2)
    job = bed.popen("h1", [*_ACROSS, "DDL_TIMEOUT=30", *_LAUNCHERS["ddlrun"], sys.executable, str(script),
                           str(folder)], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    restore_signals=False)
    try:
        deadline = time.monotonic() + 90
        while len(list(folder.glob("ready-*"))) < 4 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(p.name for p in folder.glob("ready-*")) == [f"ready-{r}-of-4" for r in range(4)]
        job.send_signal(signal.SIGUSR2)  # reaches ddlrun itself, inside h1
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out[-3000:]
    assert sorted(p.name for p in folder.glob("usr2-*")) == [f"usr2-{r}" for r in range(4)], out[-3000:]
    assert not list(folder.glob(".ddlrun-status-*"))
    subprocess.run(["rm", "-rf", str(folder)], check=True)


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
