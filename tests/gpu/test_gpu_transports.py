"""The GPU path's transports and wiring, as far as a machine without a GPU can check them.

- tests/gpu/gpu_transports_worker.py runs NvshmemTransport (over a host stand-in of nvshmem.core)
  and DeviceMpiTransport (host-staged and CUDA-aware, with events that lag) under the real
  executor and schedules at 2 and 4 ranks, exactly; then communicators routed through
  ddl_triton/runtime/calls/gpu_path.py (NVSHMEM within a node, MPI between the nodes of a 2x2 grid).
- The fingerprint names the path, so a rank on the GPU path and one on the CPU path get a
  CollectiveMismatch instead of waiting on different transports.
- Options and the refusal of CUDA tensors where torch has no CUDA.
What needs a GPU (kernels on CUDA, NVSHMEM itself, stream timing) is tests/gpu/test_gpu.py and
bench/gpu_check.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from support.launch import assert_clean_run, ddl_segments, run_ranks
from support.report import read_report
from ddl_triton.runtime.lanes import fingerprint
from ddl_triton.runtime.calls import gpu_path
from ddl_triton.options import Options


def fake_symmetric_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ddl-fake-nvshmem-")}


@pytest.mark.parametrize("ranks", [2, 4])  # 4: the 2x2 grid; odd worlds run the same executor in test_multirank
def test_gpu_transports_protocols_on_cpu_stand_ins(ranks):
    """Both transports alone, then whole communicators (flat, and 1xN or 2x2: NVSHMEM within
    the node, device MPI between) whose every collective takes the GPU path's executor."""
    before, fake_before = ddl_segments(), fake_symmetric_files()
    proc = run_ranks(ranks, "gpu/gpu_transports_worker.py")
    assert_clean_run(proc, before)
    assert not fake_symmetric_files() - fake_before, "the NVSHMEM close did not free its symmetric memory"
    read_report(proc.stdout, f"gpu transports on CPU stand-ins: {ranks} ranks", ranks)  # every rank, none failed


def test_fingerprint_tells_the_gpu_path_from_the_cpu_path():
    cpu = fingerprint.encode("allreduce", "sum", torch.float32, 10, 0)
    gpu = fingerprint.encode("allreduce", "sum", torch.float32, 10, 0, on_gpu=True)
    assert cpu != gpu
    assert fingerprint.describe(gpu) == "allreduce(sum, 10 x float32, on CUDA)"
    assert fingerprint.describe(cpu) == "allreduce(sum, 10 x float32)"


def test_transport_and_cuda_aware_options():
    assert Options.from_env({"DDL_TRANSPORT": "nvshmem", "DDL_MPI_CUDA_AWARE": "1"}).mpi_cuda_aware
    assert Options.from_env({}).mpi_cuda_aware is False
    with pytest.raises(ValueError, match="'auto', 'mpi' or 'nvshmem'"):
        Options(transport="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_gpu_path_says_why():
    assert not gpu_path.available()
    assert gpu_path.unavailable_reason(torch.empty(0, device="meta")).startswith("only CPU and CUDA")
