"""DDP on the "ddl" backend under whatever launched it; exits 0 only if the replicas end bitwise identical.

    torchrun --nproc-per-node 4 examples/ddp_anywhere.py            # torchrun: env://, gloo between hosts
    python examples/ddp_anywhere.py --spawn 4                       # torch.multiprocessing.spawn, file://
    ddlrun -n 4 -- python examples/ddp_anywhere.py                  # MPI: MPI between hosts
    DDL_TOPOLOGY=2x2 torchrun --nproc-per-node 4 examples/ddp_anywhere.py   # two emulated hosts

Each rank trains on its own shard of a synthetic regression problem for ``--steps`` steps,
then every rank compares its parameters with rank 0's, bit for bit, and rank 0 prints the
bytes each transport moved.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import ddl_triton
import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")


def train(steps: int) -> int:
    """The body every rank runs once the default group exists; returns the exit status."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # every rank starts different: DDP's broadcast must align them
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(99)
    w_true = torch.randn(16, 1, generator=gen)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r.view(torch.int32), replicas[0].view(torch.int32)) for r in replicas)
    comm = ddl_triton.init()  # the world communicator the "ddl" group runs on
    if rank == 0:
        print(f"ddp_anywhere: {size} ranks, {steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"topology {comm.topology.signature}, replicas bitwise identical: {identical}", flush=True)
        print(f"ddp_anywhere: bytes moved by rank 0, per transport: {comm.transport_bytes}", flush=True)
    dist.destroy_process_group()
    return 0 if identical else 1


def _spawned(rank: int, size: int, init_file: str, steps: int) -> None:
    dist.init_process_group("ddl", init_method=f"file://{init_file}", rank=rank, world_size=size)
    status = train(steps)
    if status:
        raise SystemExit(status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spawn", type=int, default=0, metavar="N",
                        help="start N ranks with torch.multiprocessing.spawn (file:// rendezvous)")
    args = parser.parse_args()
    if args.spawn:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="ddl_triton-spawn-") as tmp:
            mp.spawn(_spawned, args=(args.spawn, os.path.join(tmp, "init"), args.steps), nprocs=args.spawn)
        return 0
    dist.init_process_group("ddl")  # torchrun: env://; mpiexec/ddlrun: MPI's ranks
    return train(args.steps)


if __name__ == "__main__":
    sys.exit(main())
