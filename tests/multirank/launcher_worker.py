"""A rank started by a scheduler's own variables only (Slurm's srun, Open MPI's mpirun, a Kubeflow
PyTorchJob): ``dist.init_process_group("ddl")`` with no RANK or MASTER_ADDR of the test's making,
then exact integer allreduces (compared with ==) and one DDP step whose replicas must end
bitwise identical. Run by tests/multirank/test_testbed_launchers.py, 2 hosts x 2 ranks.

Prints per rank: "launcher_worker: rank R of N on HOST: exact, replicas identical" and the
world line of ``explain`` ("world: launcher slurm: rank R of N ...; store at ...; from ...").
Any mismatch raises (exit status 1); a clean run exits 0.
"""
from __future__ import annotations

import faulthandler
import signal
import socket

import torch
import torch.distributed as dist

import ddl_triton
import ddl_triton.torch  # noqa: F401  (registers "ddl")


def main() -> None:
    # The test sends SIGUSR1 to a rank still running at its deadline: every thread's stack, for the report.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dist.init_process_group("ddl")
    rank, size = dist.get_rank(), dist.get_world_size()
    triangle = size * (size + 1) // 2
    for numel in (1, 1000, 300_000):  # the small-message path, one chunk, several chunks
        for dtype in (torch.int64, torch.int32, torch.float32):
            t = torch.arange(numel, dtype=torch.int64).to(dtype) % 1000 * (rank + 1)
            dist.all_reduce(t)
            want = torch.arange(numel, dtype=torch.int64).to(dtype) % 1000 * triangle
            assert torch.equal(t, want), (rank, numel, dtype)
    t = torch.full((257,), rank, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, torch.full((257,), size - 1, dtype=torch.int64)), rank

    torch.manual_seed(0)  # one model on every rank; different (integer-valued) data per rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) % 7 * (rank + 1)
    for _ in range(2):
        opt.zero_grad()
        ddp(data).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(replicas, flat)
    assert all(torch.equal(r, replicas[0]) for r in replicas), f"rank {rank}: DDP replicas differ"

    world = ddl_triton.init().explain("allreduce", 1024).world
    print(f"launcher_worker: rank {rank} of {size} on {socket.gethostname()}: exact, replicas identical\n"
          f"launcher_worker: rank {rank} world: {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
