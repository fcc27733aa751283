"""One timed job of bench/allreduce_ab.py, under any launcher: how long ``ddl_triton.init()`` took,
then the time per call of an allreduce of each size asked for, each the slowest rank's.

Prints one JSON line per size on rank 0: ``{"package": <ddl_triton's folder>, "ranks": n, "bytes": S,
"init_s": ..., "us_per_call": [one figure per block], "wrong": <elements off the exact answer, summed
over ranks>}``. A block is ``--calls`` calls for small sizes, fewer for larger sizes (about 2 MB a block, at
least 3 calls).
The package's folder says which checkout ran, so a mixed-up A/B run shows in its output.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import ddl_triton as ddl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", default="128", help="a comma list of sizes")
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--calls", type=int, default=200, help="calls per timed block")
    p.add_argument("--async-op", action="store_true",
                   help="time allreduce(x, async_op=True).wait(): the queue's path, not the synchronous entry")
    args = p.parse_args()

    start = time.perf_counter()
    comm = ddl.init()
    init_s = time.perf_counter() - start
    for nbytes in (int(b) for b in args.bytes.split(",")):
        _time_size(comm, nbytes, args.blocks, max(3, min(args.calls, (2 << 20) // max(nbytes, 1))), init_s,
                   args.async_op)
    ddl.finalize()
    return 0


def _time_size(comm, nbytes: int, blocks: int, calls: int, init_s: float, async_op: bool) -> None:
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    call = (lambda: comm.allreduce(x, async_op=True).wait()) if async_op else (lambda: comm.allreduce(x))
    for _ in range(min(50, calls)):  # warm: plans cached, lanes posted
        call()
    per_call = []
    for _ in range(blocks):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - t0) / calls)
    slowest = torch.tensor(per_call + [init_s], dtype=torch.float64)
    comm.allreduce(slowest, op="max")

    # Exact on integer-valued data after the timed calls: every rank holds sum(1..size).
    x.fill_(comm.rank + 1)
    comm.allreduce(x)
    wrong = torch.tensor([int((x != comm.size * (comm.size + 1) // 2).sum())], dtype=torch.int64)
    comm.allreduce(wrong)
    if comm.rank == 0:
        print(json.dumps({"package": os.path.dirname(ddl.__file__), "ranks": comm.size, "bytes": nbytes,
                          "init_s": float(slowest[-1]), "us_per_call": [1e6 * float(v) for v in slowest[:-1]],
                          "wrong": int(wrong[0])}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
