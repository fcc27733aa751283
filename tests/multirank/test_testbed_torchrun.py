"""torchrun across real hosts (the testbed, ddl_triton/testbed/): one torchrun per host, 2 hosts x 2
ranks, a c10d rendezvous at h1, ``init_process_group("ddl")`` with no DDL_TOPOLOGY. The ranks must
find the 2x2 grid from the hosts themselves, carry bytes over shm within a host and gloo between
them, never link to a rank of the other host through shm, be exact in every collective, and end
DDP and FSDP2 replicas bitwise identical. Skipped, with the reason, where the machine cannot
build hosts (no root or no namespaces)."""
from __future__ import annotations

import re
import subprocess
import tempfile
import time

import pytest

from ddl_triton import testbed  # the module, not its classes: pytest would try to collect Testbed*
from ddl_triton.testbed import reap
from support.launch import TESTS, TORCHRUN, torch_launcher_env as _env
from support.real_hosts import UNAVAILABLE as _UNAVAILABLE, namespaces as _namespaces
from support.report import read_report

ROOT = TESTS.parent



@pytest.fixture(scope="module")
def bed():
    if _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE)
    reap()
    with testbed.Testbed(hosts=2, rate="1gbit") as made:
        yield made
    assert not {ns for ns in _namespaces() if ns.startswith(f"{made.name}-")}


def _torchrun_on_every_host(bed, run_id: str, *argv: str, timeout: float = 120, **env) -> list[tuple[int, str]]:
    """``torchrun --nnodes 2 --nproc-per-node 2`` on each host at once, meeting at h1:29400; returns
    (exit status, output) per host. Bounded: past ``timeout``, or 10 s after a host failed, every
    torchrun still running is stopped (SIGTERM, which it passes to its ranks, then SIGKILL)."""
    env = _env(GLOO_SOCKET_IFNAME="eth0", DDL_TUNING_FILE="off", **env)
    env.pop("DDL_TOPOLOGY", None)  # the grid must come from the hosts
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "h1:29400", "--rdzv-id", run_id, *argv]
    # Files, not pipes: a host's full pipe would stall its ranks, and the other host's with them.
    outs = [tempfile.TemporaryFile("w+") for _ in bed.hosts]
    procs = [bed.popen(h, cmd, cwd=str(TESTS), env=env, stdout=out, stderr=subprocess.STDOUT)
             for h, out in zip(bed.hosts, outs)]
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    results = []
    for p, out in zip(procs, outs):
        out.seek(0)
        results.append((p.returncode, out.read()))
        out.close()
    return results


def _all_exited_zero(results: list[tuple[int, str]]) -> str:
    everything = "\n".join(f"--- host h{i} exit {code}\n{out[-5000:]}" for i, (code, out) in enumerate(results, 1))
    assert [code for code, _ in results] == [0, 0], everything
    return everything


def test_every_collective_exact_grid_detected_and_bytes_between_hosts_through_gloo_only(bed):
    # Every backend op, sub-groups, p2p, DDP/gloo/FSDP2 training, the world communicator's own
    # collectives across several pipeline chunks, the int8 hook, then where each rank ran.
    out = _all_exited_zero(_torchrun_on_every_host(bed, "checks", "multirank/torch_launchers_worker.py", "checks",
                                                   DDL_CHUNK_BYTES="65536"))
    # Every rank, each of world size 4 (a root checks more than the others).
    checks = read_report(out, "torch_launchers_worker: 4 ranks, topology 2x2, checks", 4, same_on_every_rank=False)
    assert sum(checks) >= 500, out
    hosts = [re.search(rf"rank {q} on host (\S+), links (.*)", out) for q in range(4)]
    assert all(hosts), out
    where = [h.group(1) for h in hosts]
    # torchrun numbers one host's ranks first, whichever host that is.
    assert where[0] == where[1] != where[2] == where[3] and set(where) == {"h1", "h2"}, where
    for q in range(4):
        links = hosts[q].group(2).split()
        want = ["self" if p == q else "shm" if where[p] == where[q] else "gloo" for p in range(4)]
        assert links == want, (q, links, where)  # no shm link, so no shm byte, to the other host
        moved = re.search(rf"rank {q} transport bytes: (.*)", out).group(1)
        assert "'mpi'" not in moved, moved
        gloo = re.search(r"'gloo': \{'sent': (\d+), 'received': (\d+)\}", moved)
        shm = re.search(r"'shm': \{'sent': (\d+), 'received': (\d+)\}", moved)
        assert gloo and shm, moved
        assert int(gloo.group(1)) > 1_000_000 and int(gloo.group(2)) > 1_000_000, moved  # MBs between hosts
        assert int(shm.group(1)) > 0 and int(shm.group(2)) > 0, moved  # and within each
    # The link between the hosts was measured once the transports were open (over gloo's process
    # group: a store bootstrap has no data path before) and every rank plans with the same figures.
    plans = {re.search(rf"rank {q} plans with: (.*)", out).group(1) for q in range(4)}
    assert len(plans) == 1 and "link between hosts measured at init" in plans.pop(), out
