"""How a Placement names a peer in errors: with its host (this host's name on one host), and, for a
wait on every rank at once, the suspects narrowed from this host's live ranks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from ddl_triton.planning.topology import Topology
from ddl_triton.runtime.setup.placement import Placement


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has it now (pids are not reused this soon)


def _placement(rank: int, pids: tuple[int, ...], names=("h1", "h1", "h2", "h2")) -> Placement:
    host_of_rank = tuple(names.index(n) for n in names)  # the lowest rank on each host
    return Placement(rank, 4, Topology((2, 2), "2x2"), host_of_rank, host_of_rank, (), ("self",) * 4, "auto",
                     tuple(names), pids)


def test_a_peer_is_named_with_its_host_when_the_ranks_span_hosts():
    me = os.getpid()
    p = _placement(0, (me, me, 1, 1))
    assert p.spans_hosts and p.describe(2) == "rank 2 on h2" and p.describe(1) == "rank 1 on h1"
    one_host = Placement(0, 2, Topology((1, 2), "1x2"), (0, 0), (0, 0), (0, 1), ("self", "shm"), "auto")
    assert not one_host.spans_hosts and one_host.describe(1) == f"rank 1 on {socket.gethostname()}"
    assert one_host.describe(-1) == f"a rank on {socket.gethostname()} (the wait was on all ranks at once: which one is unknown)"


def test_a_wait_on_every_rank_names_the_other_hosts_ranks_when_every_rank_here_is_alive():
    me = os.getpid()
    assert _placement(0, (me, me, 1, 1)).describe(-1).startswith(
        "a rank on another host, one of rank(s) 2, 3 on h2 (the wait was on all ranks at once, and every rank on "
        "h1 is alive)")
    gone = _exited_pid()
    assert _placement(0, (me, gone, 1, 1)).describe(-1).startswith(
        "rank(s) 1 on h1 (this host), whose process has exited")


def test_a_killed_rank_not_yet_reaped_by_its_parent_counts_as_exited():
    # torchrun's agent reaps a killed rank a moment later: meanwhile it is a zombie, which
    # os.kill(pid, 0) still finds.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(200):  # until it has exited, unreaped: bounded, 10 s
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.05)
        assert "rank(s) 1 on h1 (this host), whose process has exited" in \
            _placement(0, (os.getpid(), child.pid, 1, 1)).describe(-1)
    finally:
        child.wait()
