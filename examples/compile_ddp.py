"""torch.compile on a DDP model over the "ddl" backend; exits 0 only if the replicas end bitwise identical.

    torchrun --nproc-per-node 2 examples/compile_ddp.py                 # inductor, torch's default
    torchrun --nproc-per-node 2 examples/compile_ddp.py --backend aot_eager --check-eager
    ddlrun -n 2 -- python examples/compile_ddp.py

Each rank trains a small residual MLP of its own class on its own batches for ``--steps`` steps,
with ``torch.compile(DistributedDataParallel(model))``. Dynamo compiles the model's forward and
its DDPOptimizer splits the graph at DDP's bucket boundaries, so each bucket's allreduce can start
while backward goes on; the "ddl" group itself always runs eagerly, as a C++ backend would
(ddl_triton/torch/compile_boundary.py). Rank 0 prints the loss, Dynamo's graph breaks and graphs,
and whether the replicas are identical; ``--check-eager`` also trains an uncompiled copy and says
whether the compiled weights are the same bits (they are under ``aot_eager``, which runs eager's
own operators; inductor's fused kernels may round differently).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")


class ResidualMLP(nn.Module):
    """A module class of the script's own, as models are: Dynamo compiles user code from the top
    (a bare nn.Sequential, called from DDP's own code, which Dynamo skips, would stay eager)."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train(compiled: bool, backend: str, steps: int) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = ResidualMLP()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)  # several buckets: graph splits
    run = torch.compile(ddp, backend=backend) if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        loss = nn.functional.cross_entropy(run(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.int32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (inductor, aot_eager, ...)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--check-eager", action="store_true", help="also train uncompiled; compare the weights")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ddl")
    from torch._dynamo.utils import counters

    model, losses = train(True, args.backend, args.steps)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    mine = _weights(model)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    identical = all(torch.equal(every[0], w) for w in every[1:])
    same_as_eager = None
    if args.check_eager:
        same_as_eager = torch.equal(_weights(train(False, args.backend, args.steps)[0]), mine)
    if dist.get_rank() == 0:
        print(f"compile_ddp: {dist.get_world_size()} ranks, backend {args.backend}, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {graphs} graph(s), {breaks} graph break(s), "
              f"replicas bitwise identical: {identical}"
              + ("" if same_as_eager is None else f", same weights as eager: {same_as_eager}"), flush=True)
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
