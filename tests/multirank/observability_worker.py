"""Workloads for tests/multirank/test_observability.py (run under ddlrun / mpiexec).

    python observability_worker.py hang         # rank 1 skips the last allreduce (line marked SKIPPED)
    python observability_worker.py mismatch     # rank 1 calls broadcast where the others call allreduce
    python observability_worker.py traced       # sync, async, broadcast and torch.profiler, with DDL_TRACE set
    python observability_worker.py bounded      # 50 calls into a 10-entry recorder, then SIGUSR2
    python observability_worker.py sites        # every entry's recorded call site, on shm and over MPI
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import ddl_triton as ddl
from support.report import print_line


def hang(comm) -> None:
    grad = torch.ones(1000)
    steps = 6 if comm.rank != 1 else 5
    for _ in range(steps):
        comm.allreduce(grad)  # ALLREDUCE-LINE


def mismatch(comm) -> None:
    x = torch.ones(100)
    for _ in range(3):
        comm.allreduce(x)
    if comm.rank == 1:
        comm.broadcast(x, root=0)  # BROADCAST-LINE
    else:
        comm.allreduce(x)  # MISMATCH-ALLREDUCE-LINE


def traced(comm) -> None:
    x = torch.arange(300_000, dtype=torch.float32)
    for _ in range(3):
        comm.allreduce(x)
    works = [comm.allreduce(torch.ones(200_000), async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    comm.broadcast(torch.ones(1000), root=0)
    with torch.profiler.profile() as prof:
        comm.allreduce(torch.ones(4096))
    names = [e.name for e in prof.events()]
    saw = any(n.startswith('ddl:allreduce(sum, 4096 x float32)') for n in names)
    print_line(f"PROFILER rank={comm.rank} saw={saw}")


def bounded(comm) -> None:
    x = torch.ones(8)
    for _ in range(50):
        comm.allreduce(x)
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.2)  # the handler runs between bytecodes of the main thread
    with open(os.path.join(os.environ["DDL_DUMP_DIR"], f"flight-rank{comm.rank}.json")) as f:
        dump = json.load(f)
    seqs = [r["seq"] for r in dump["records"]]
    print_line(f"BOUNDED rank={comm.rank} reason={dump['reason']} records={len(seqs)} first={seqs[0]} last={seqs[-1]}")


def sites(comm) -> None:
    """Each collective's record names the line that called it (lines marked SITE), through every
    entry: the small path's first call and its fast entry, the general path, async, and the
    other collectives; on the shm communicator and on one whose peers are reached over MPI (the
    call lane's fast entry). Prints the records whose site is wrong (none, when it works)."""
    from mpi4py import MPI

    from ddl_triton.observability.flight import RECORDER, site_of
    over_mpi = ddl.init(MPI.COMM_WORLD.Dup(), transport="mpi")
    wrong = []
    for c in (comm, over_mpi):
        small, large = torch.ones(8), torch.ones(50_000)
        lines = []
        for _ in range(3):  # the first call takes the general entry, the next ones the fast entry
            c.allreduce(small); lines.append(_here())  # SITE
        c.allreduce(large); lines.append(_here())  # SITE
        c.allreduce(large, async_op=True).wait(); lines.append(_here())  # SITE
        c.broadcast(small, root=0); lines.append(_here())  # SITE
        c.all_gather(torch.zeros(8 * c.size), small); lines.append(_here())  # SITE
        c.barrier(); lines.append(_here())  # SITE
        records = [r for r in RECORDER.records if r.comm == c._issuer.comm_id][-len(lines):]
        for record, line in zip(records, lines):
            site = site_of(record.site)
            if site != (__file__, line):
                wrong.append(f"#{record.seq} {record.call[0]}: {site} (expected line {line})")
    over_mpi.close()
    print_line(f"SITES rank={comm.rank} checked={2 * len(lines)} wrong={wrong}")


def _here() -> int:
    """The caller's line number (each SITE line calls a collective and then this, on one line)."""
    return sys._getframe(1).f_lineno


def main() -> int:
    mode = sys.argv[1]
    comm = ddl.init()
    {"hang": hang, "mismatch": mismatch, "traced": traced, "bounded": bounded, "sites": sites}[mode](comm)
    ddl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
