"""transports/gloo.py's close frees its process groups: their worker threads are joined while the
interpreter is whole, so none is left to abort the process at exit (support/launch.py tells the
story of torch's own groups, which DDP keeps alive until then). Two ranks on a local TCPStore."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from support.launch import TESTS

_RANK = r"""
import os, sys, torch, torch.distributed as dist
from transports.gloo import GlooTransport

def gloo_workers():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, use_libuv=False)
t = GlooTransport(store, rank, 2, timeout=30)
x = torch.arange(7, dtype=torch.int64) + 100 * rank
t.allreduce_group((0, 1), x, "sum", 30)
exact = torch.equal(x, 2 * torch.arange(7) + 100)
import time
deadline = time.monotonic() + 10  # a new worker thread names itself once it runs: late on a loaded machine
while gloo_workers() < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
before = gloo_workers()
t.close()
print(f"rank {rank} exact {exact} workers before {before} after {gloo_workers()}", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_close_after_a_clean_run_joins_the_gloo_worker_threads():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port)], cwd=str(TESTS.parent),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        # gloo starts two worker threads per group; after close none is left
        assert f"rank {r} exact True workers before 2 after 0" in out, out[-3000:]
