"""A job that runs allreduces until told to stop or until it loses a peer, for the faults across
hosts (tests/support/host_faults.py injects them on the testbed).

    host_faults_worker.py API RESULTS SECONDS

API      ``ddl``: ``ddl_triton.init()`` and ``Communicator.allreduce`` (under ddlrun: MPI between
         hosts); ``torch``: ``init_process_group("ddl")`` and ``dist.all_reduce`` (under torchrun:
         gloo between hosts).
RESULTS  a folder every host sees; each rank writes ``rank<r>.ready`` (JSON: world size, host, pid as
         its host numbers it, time) once
         its first allreduce is done, and ``rank<r>.json`` at its end: the allreduces it completed,
         how many were wrong (exact integer data: any difference is a bug), and what it raised, with
         the wall-clock time (one clock: the hosts share a kernel), before the error propagates.
SECONDS  how long rank 0 lets the loop run before it asks every rank to stop (0: until a fault).
         The stop travels in the data: its last element, so every rank stops after the same call.

Every allreduce is 100,003 fp32 elements (400 KB: several pipeline chunks, every level of the grid).
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time

import torch

_ELEMENTS = 100_003
_LONGEST_S = 90.0  # rank 0 stops the loop by then, fault or not: every loop is bounded


def _write(folder: str, name: str, record: dict) -> None:
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole, or not at all: the harness may read it at any time


def main(api: str, folder: str, seconds: float) -> None:
    if api == "ddl":
        import ddl_triton
        comm = ddl_triton.init()
        rank, size, allreduce = comm.rank, comm.size, comm.allreduce
    else:
        import torch.distributed as dist
        import ddl_triton.torch  # noqa: F401  (registers "ddl")
        dist.init_process_group("ddl")
        rank, size, allreduce = dist.get_rank(), dist.get_world_size(), dist.all_reduce
    data = (torch.arange(_ELEMENTS) % 97).float()
    want = data * size + sum(range(1, size + 1))
    record = {"rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(), "done": 0, "wrong": 0}
    stop_after = seconds if seconds > 0 else _LONGEST_S
    t0 = time.monotonic()
    try:
        while True:
            t = data + (rank + 1)
            t[-1] = float(rank == 0 and time.monotonic() - t0 > stop_after)
            allreduce(t)
            stop = t[-1].item() > 0
            record["wrong"] += not torch.equal(t[:-1], want[:-1])
            record["done"] += 1
            if record["done"] == 1:
                _write(folder, f"rank{rank}.ready", dict(record, time=time.time()))
            if stop:
                break
    except Exception as e:
        _write(folder, f"rank{rank}.json", dict(record, error=f"{type(e).__name__}: {e}", time=time.time()))
        raise
    _write(folder, f"rank{rank}.json", dict(record, error=None, time=time.time()))
    if api == "ddl":
        ddl_triton.finalize()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    # A survivor that dies of a signal instead of raising (seen once: rank 1 of a kill-rank job ended by
    # SIGSEGV as its MPI peer was killed) prints where it was, Python's stack, into the job's output.
    faulthandler.enable()
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
