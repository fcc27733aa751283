"""Two ranks: rank 0 closes its call lane while rank 1 has not yet taken rank 0's last message.

Rank 1 holds back its receive (no MPI call until rank 0 says, by a file, that it closed) after sending
its own message, so rank 0's exchange ends with its 64 KiB send still in flight (MPICH moves a message
that large by rendezvous).
Rank 0 then closes the lane, drops it, fills the freed heap with 0xAB bytes and keeps MPI's progress
running. Rank 1 must still receive rank 0's header and data exactly. A lane whose close freed the
send buffer under MPI delivered the filler instead (a CollectiveMismatch naming garbage, or wrong
data): tests/multirank/test_lane_close.py.
"""
from __future__ import annotations

import gc
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from ddl_triton.runtime.lanes import call_lane
from ddl_triton.runtime.lanes.fingerprint import encode
from ddl_triton.transports import mpi_retired

LIMIT = 64 * 1024
FINGERPRINT = encode("broadcast", None, torch.int64, LIMIT // 8, 0)  # the case that failed in the 2x2 matrix


def main() -> int:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    counter = types.SimpleNamespace(name="mpi", bytes_sent=0, bytes_received=0)
    lane = call_lane.CallLane(world, rank, 2, LIMIT, timeout=30.0, spin=0.0, counter=counter)
    head = call_lane.header(FINGERPRINT, LIMIT)
    pattern = (np.arange(LIMIT // 8, dtype=np.int64) * 7919 + 1).view(np.uint8)
    parity = lane.claim_send_buffer()
    lane.data_view(None, parity, LIMIT)[:] = pattern if rank == 0 else 0
    steps = Path(sys.argv[1])  # a private folder of the test's: the ranks' order, told by files (no MPI)
    if rank == 1:
        wait_recv = lane.wire.wait_recv

        def late_wait_recv(peer, timeout, seq, spin):
            _wait_for(steps / "closed")  # rank 0 finishes its call, closes and refills its heap meanwhile
            wait_recv(peer, timeout, seq, spin)
        lane.wire.wait_recv = late_wait_recv
    ok = exchanged = True
    try:
        lane.exchange(1, head, LIMIT)
    except Exception as e:  # noqa: BLE001 - the failure this test exists to show: reported, then both ranks end
        ok = exchanged = False
        print(f"rank {rank}: the exchange failed: {e}", flush=True)
    if rank == 1:  # taken, or refused: rank 0 need not keep MPI moving any longer
        (steps / "received").touch(mode=0o600, exist_ok=False)
    if rank == 1 and ok:
        got = lane.data_view(0, 0, LIMIT)
        ok = bool(np.array_equal(got, pattern))
        if not ok:
            print(f"rank 1: rank 0's data is not what it sent: first bytes {got[:16].tobytes().hex()}", flush=True)
    if exchanged:
        lane.done_reading()  # (a refused exchange re-posted its receives itself)
    lane.close()
    if rank == 0:
        print(f"rank 0: {mpi_retired.sweep()} retired requests active at close", flush=True)
        del lane
        gc.collect()
        filler = [np.full(LIMIT + 16, 0xAB, dtype=np.uint8) for _ in range(64)]  # reuse the freed heap
        (steps / "closed").touch(mode=0o600, exist_ok=False)
        # MPI's progress while rank 1 receives: an unfinished send moves from whatever is in its memory.
        _wait_for(steps / "received", lambda: world.Iprobe(source=1, tag=99))
        print(f"rank 0: {mpi_retired.sweep()} retired requests active after rank 1's receive, "
              f"{len(filler)} filler buffers", flush=True)
    world.Barrier()
    print(f"rank {rank}: lane close {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def _wait_for(path: Path, meanwhile=lambda: time.sleep(0.001), limit_s: float = 60.0) -> None:
    """Until ``path`` exists (the other rank's step), at most ``limit_s``: then raise."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {limit_s:g} s")
        meanwhile()


if __name__ == "__main__":
    sys.exit(main())
