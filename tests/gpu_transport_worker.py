"""The GPU transports' protocols on CPU ranks (run under mpiexec by test_gpu_transports.py).

This machine has no GPU, so the CUDA side is replaced at the transports' seams: NVSHMEM by
tests/_fake_nvshmem.py (symmetric memory in shared files, signals on the host) and CUDA
events by host stand-ins that report "done" only after a few queries. What runs for real:
NvshmemTransport's slot/flag bookkeeping and DeviceMpiTransport's staging, ordering and
posting logic, under the real Executor and real schedules, with exact integer checks and
bitwise identity across ranks. What does not: kernels on a GPU, NVLink, stream timing.

    mpiexec -n 3 python tests/gpu_transport_worker.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fake_nvshmem  # noqa: E402
from _report import gather_and_report  # noqa: E402

from ddl_triton import schedules  # noqa: E402
from ddl_triton.executor import CallContext, Executor  # noqa: E402
from ddl_triton.transports import nvshmem as nvshmem_transport  # noqa: E402
from ddl_triton.transports.mpi_device import DeviceMpiTransport  # noqa: E402

SIZES = [0, 1, 7, 13, 127, 1000, 4099]
CHUNK_BYTES = 256   # small slots: many chunks, every slot reused many times
DEPTH = 2


def data(count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (((torch.arange(count, dtype=torch.int64) * 7 + 11 * rank) % 23) - 11).to(dtype)


def run_cases(executor: Executor, rank: int, size: int, label: str, failures: list[str]) -> int:
    world = MPI.COMM_WORLD
    cases = 0
    for name in ("ring", "one_shot", "two_shot"):
        for dtype in (torch.float32, torch.int64):
            for count in SIZES:
                chunk = max(1, CHUNK_BYTES // dtype.itemsize)
                # allreduce (sum) in place
                t = data(count, rank, dtype)
                expect = sum(data(count, q, torch.int64) for q in range(size)).to(dtype)
                sched = schedules.build(name, "allreduce", size, count, chunk_elems=chunk)
                executor.run(sched, t, t, CallContext("allreduce", "sum"))
                cases += 1
                if not torch.equal(t, expect):
                    failures.append(f"rank {rank} {label} {name} allreduce {dtype} n={count}")
                mine = t.numpy().tobytes()
                if len(set(world.allgather(mine))) != 1:  # control path: the check itself
                    failures.append(f"rank {rank} {label} {name} allreduce {dtype} n={count}: ranks differ")
                # all_gather
                if schedules.supports(name, "all_gather"):
                    inp = data(count, rank, dtype)
                    out = torch.empty(size * count, dtype=dtype)
                    sched = schedules.build(name, "all_gather", size, count, chunk_elems=chunk)
                    executor.run(sched, inp, out, CallContext("all_gather"))
                    cases += 1
                    if not torch.equal(out, torch.cat([data(count, q, dtype) for q in range(size)])):
                        failures.append(f"rank {rank} {label} {name} all_gather {dtype} n={count}")
                # reduce_scatter (max)
                if schedules.supports(name, "reduce_scatter"):
                    inp = data(size * count, rank, dtype)
                    out = torch.empty(count, dtype=dtype)
                    sched = schedules.build(name, "reduce_scatter", size, count, chunk_elems=chunk)
                    executor.run(sched, inp, out, CallContext("reduce_scatter", "max"))
                    cases += 1
                    full = torch.stack([data(size * count, q, dtype) for q in range(size)]).max(0).values
                    if not torch.equal(out, full[rank * count:(rank + 1) * count]):
                        failures.append(f"rank {rank} {label} {name} reduce_scatter {dtype} n={count}")
    return cases


def main() -> int:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    failures: list[str] = []
    cases = 0

    # NVSHMEM transport over the fake, every peer on the node.
    nvshmem_transport._core = lambda: _fake_nvshmem
    nvshmem_transport._cuda = _fake_nvshmem.HostCudaOps
    node = world.Dup()
    nv = nvshmem_transport.NvshmemTransport(node, list(range(size)), slot_bytes=CHUNK_BYTES, depth=DEPTH,
                                            device=torch.device("cpu"), world_ranks=list(range(size)))
    route = [None if p == rank else nv for p in range(size)]
    cases += run_cases(Executor(rank, size, route, timeout=30, depth=DEPTH, transports=[nv]), rank, size,
                       "nvshmem", failures)
    sent = nv.bytes_sent
    nv.close()
    node.Free()
    if sent == 0 and size > 1:
        failures.append(f"rank {rank}: the NVSHMEM transport carried nothing")

    # Device MPI transport: host-staged (copies in flight) and CUDA-aware (stream synchronised per send).
    for cuda_aware in (False, True):
        ops = _fake_nvshmem.SlowEvents(lag=3)
        comm = world.Dup()
        mpi = DeviceMpiTransport(comm, torch.device("cpu"), cuda_aware=cuda_aware, _stream_ops=ops)
        route = [None if p == rank else mpi for p in range(size)]
        label = "mpi-cuda-aware" if cuda_aware else "mpi-staged"
        cases += run_cases(Executor(rank, size, route, timeout=30, depth=DEPTH), rank, size, label, failures)
        if cuda_aware and size > 1 and ops.synchronized == 0:
            failures.append(f"rank {rank}: CUDA-aware sends never synchronised the stream first")
        if mpi._copying or mpi._sending:
            failures.append(f"rank {rank} {label}: sends left outstanding after the collectives")
        mpi.close()  # frees comm
    return gather_and_report(f"gpu transports on CPU stand-ins: {size} ranks", failures, cases)


if __name__ == "__main__":
    sys.exit(main())
