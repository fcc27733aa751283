"""The GPU transports' protocols on CPU ranks (run under mpiexec by test_gpu_transports.py).

This machine has no GPU, so the CUDA side is replaced at the transports' seams: NVSHMEM by
tests/support/fake_nvshmem.py (symmetric memory in shared files, signals on the host) and CUDA
events by host stand-ins that report "done" only after a few queries. What runs for real:
NvshmemTransport's slot/flag bookkeeping and DeviceMpiTransport's staging, ordering and
posting logic, under the real Executor and real schedules, with exact integer checks and
bitwise identity across ranks; then whole communicators whose collectives take the GPU path's
executor (ddl_triton/runtime/calls/gpu_path.py: lazy build, NVSHMEM within a node and MPI between the nodes
of a 1xN or 2x2 grid, close). What does not: kernels on a GPU, NVLink, stream timing.

    mpiexec -n 3 python tests/gpu/gpu_transports_worker.py
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support/

from support import fake_nvshmem as _fake_nvshmem  # noqa: E402
from support.report import gather_and_report  # noqa: E402

import ddl_triton as ddl  # noqa: E402
from ddl_triton import schedules  # noqa: E402
from ddl_triton.runtime.calls.executor import CallContext, Executor  # noqa: E402
from ddl_triton.transports import mpi_device as mpi_device_transport  # noqa: E402
from ddl_triton.transports import nvshmem as nvshmem_transport  # noqa: E402
from ddl_triton.transports import table as transport_table  # noqa: E402
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
    cases += run_gpu_path(rank, size, failures)
    return gather_and_report(f"gpu transports on CPU stand-ins: {size} ranks", failures, cases)


def run_gpu_path(rank: int, size: int, failures: list[str]) -> int:
    """A Communicator whose collectives all take its GPU path's executor (ddl_triton/runtime/calls/gpu_path.py:
    routing, lazy build, close), over the stand-ins, through the public API."""
    world = MPI.COMM_WORLD
    mpi_device_transport.DeviceMpiTransport = functools.partial(DeviceMpiTransport,
                                                                _stream_ops=_fake_nvshmem.SlowEvents())
    transport_table.nvshmem_importable = lambda: True
    cases = 0
    topologies = {2: ["", "1x2"], 3: ["", "1x3"], 4: ["", "2x2"]}.get(size, [""])
    for topo in topologies:
        comm = ddl.init(world.Dup(), topology=topo, chunk_bytes=CHUNK_BYTES, pipeline_depth=DEPTH)
        comm._runner.executor = comm._gpu.executor(torch.device("cpu"))  # every collective through the GPU path,
        comm._runner.small = None  # small allreduces included (the CPU path's shortcut would bypass it)
        label = f"gpu path {topo or 'flat'}"
        for count in SIZES:
            t = data(count, rank, torch.float32)
            comm.allreduce(t)
            expect = sum(data(count, q, torch.int64) for q in range(size)).to(torch.float32)
            out = torch.empty(size * count, dtype=torch.int64)
            comm.all_gather(out, data(count, rank, torch.int64))
            b = data(count, rank, torch.int32)
            comm.broadcast(b, root=size - 1)
            cases += 3
            if not torch.equal(t, expect):
                failures.append(f"rank {rank} {label} allreduce n={count}")
            if not torch.equal(out, torch.cat([data(count, q, torch.int64) for q in range(size)])):
                failures.append(f"rank {rank} {label} all_gather n={count}")
            if not torch.equal(b, data(count, size - 1, torch.int32)):
                failures.append(f"rank {rank} {label} broadcast n={count}")
        moved = comm.transport_bytes
        nodes = len(set(comm.placement.node_of_rank))
        on_node = len(comm.placement.on_node)
        cases += 1
        if (on_node > 1) != (moved.get("nvshmem", {}).get("sent", 0) > 0) or comm._gpu.intra_node != (
                "nvshmem" if on_node > 1 else ""):
            failures.append(f"rank {rank} {label}: NVSHMEM use {moved} does not match {on_node} ranks on the node")
        if nodes > 1 and not moved["mpi"]["sent"]:
            failures.append(f"rank {rank} {label}: nothing crossed nodes over MPI: {moved}")
        comm.close()
    if size > 1:
        cases += run_limited_mpg(rank, size, failures)
    return cases


def run_limited_mpg(rank: int, size: int, failures: list[str]) -> int:
    """NVSHMEM in LIMITED MPG mode (several PEs on one GPU, no MPS; an H200 ended the process at
    the first on-stream barrier there): under transport "auto" the GPU path falls back to MPI and
    says why; under "nvshmem" every rank gets a ValueError naming the mode, and NVSHMEM is not
    initialised again for a later communicator."""
    world = MPI.COMM_WORLD
    os.environ[_fake_nvshmem.LIMITED_MPG_ENV] = "1"
    cases = 0
    try:
        comm = ddl.init(world.Dup(), topology=f"{size}x1", chunk_bytes=CHUNK_BYTES, pipeline_depth=DEPTH)
        comm._runner.executor = comm._gpu.executor(torch.device("cpu"))
        comm._runner.small = None
        t = data(4099, rank, torch.float32)
        comm.allreduce(t)
        cases += 2
        if not torch.equal(t, sum(data(4099, q, torch.int64) for q in range(size)).to(torch.float32)):
            failures.append(f"rank {rank} limited MPG fallback: allreduce wrong")
        if comm._gpu.intra_node != "mpi" or "LIMITED MPG" not in comm._gpu.why:
            failures.append(f"rank {rank} limited MPG fallback: intra-node {comm._gpu.intra_node!r}, why "
                            f"{comm._gpu.why!r}")
        comm.close()
        for attempt in range(2):  # the second refusal comes from the remembered reason
            comm = ddl.init(world.Dup(), topology=f"{size}x1", transport="nvshmem", chunk_bytes=CHUNK_BYTES,
                            pipeline_depth=DEPTH)
            cases += 1
            try:
                comm._gpu.executor(torch.device("cpu"))
                failures.append(f"rank {rank} limited MPG, transport nvshmem: no error (attempt {attempt})")
            except ValueError as e:
                if "LIMITED MPG" not in str(e) or f"rank {rank}" not in str(e):
                    failures.append(f"rank {rank} limited MPG, transport nvshmem: unclear error {e}")
            comm.close()
    finally:
        del os.environ[_fake_nvshmem.LIMITED_MPG_ENV]
        nvshmem_transport.NvshmemRuntime._refused = ""
    return cases


if __name__ == "__main__":
    sys.exit(main())
