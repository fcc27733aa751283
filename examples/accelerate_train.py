"""Hugging Face Accelerate on the "ddl" backend, on the CPU; exits 0 only if the replicas end bitwise identical.

    torchrun --nproc-per-node 2 examples/accelerate_train.py                        # the documented kwargs way
    torchrun --nproc-per-node 2 examples/accelerate_train.py --way pre-initialised  # dist.init_process_group first
    torchrun --nproc-per-node 2 examples/accelerate_train.py --backend gloo         # the same on gloo

``--way kwargs`` is Accelerate's documented way to choose a backend,
``Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="ddl")])``, after
``ddl_triton.torch.accelerate.use_ddl_on_cpu()`` (without it Accelerate 1.15 turns "ddl" into
"gloo" on the CPU and refuses: docs/frameworks.md). ``--way pre-initialised`` needs no patch.

Each rank trains a small MLP on its own shard of integer-valued data through
``accelerator.prepare`` and ``accelerator.backward``, then checks Accelerate's ``gather`` and
``reduce`` against integers it can predict, and compares every rank's parameter bytes with
rank 0's through ``accelerator.gather``. Rank 0 prints the losses in full precision, so two runs
(on "ddl" and on gloo) can be compared exactly.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist


def _accelerator(way: str, backend: str):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if backend == "ddl":
        import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")
    if way == "pre-initialised":
        dist.init_process_group(backend)  # torchrun: env://; Accelerate sees it initialised and keeps it
        return Accelerator(cpu=True)
    if backend == "ddl":
        from ddl_triton.torch.accelerate import use_ddl_on_cpu

        use_ddl_on_cpu()  # opt-in: keeps an explicit backend="ddl" on the CPU (state.py:810-813 would pick gloo)
    return Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=backend)])


def _helpers_exact(accelerator) -> bool:
    """Accelerate's gather and reduce (accelerate/utils/operations.py) on sizes 1 and 7, int64 and float32."""
    rank, size = accelerator.process_index, accelerator.num_processes
    ok = True
    for n in (1, 7):
        for dtype in (torch.int64, torch.float32):
            mine = (torch.arange(n) + 100 * rank).to(dtype)
            gathered = accelerator.gather(mine)
            expected = torch.cat([(torch.arange(n) + 100 * r).to(dtype) for r in range(size)])
            summed = accelerator.reduce(mine.clone(), reduction="sum")
            ok &= torch.equal(gathered, expected) and torch.equal(summed, expected.view(size, n).sum(0))
    return bool(ok)


def train(way: str, backend: str, steps: int) -> int:
    """Every rank's body; returns the exit status."""
    accelerator = _accelerator(way, backend)
    rank, size = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(1234 + rank)  # every rank starts different: DDP's broadcast must align them
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1 / 64)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # this rank's shard of the step's batch
        x = torch.randint(-3, 4, (16, 12), generator=gen).float()
        y = x.sum(1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        losses.append(accelerator.reduce(loss.detach(), reduction="sum").item())
    exact = _helpers_exact(accelerator)
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    replicas = accelerator.gather(flat.view(torch.int32)).view(size, -1)  # the bytes, not the values
    identical = bool((replicas == replicas[0]).all())
    if rank == 0:
        print(f"accelerate_train: {size} ranks, {steps} steps, way {way}, backend {dist.get_backend()} "
              f"(Accelerate's state.backend {accelerator.state.backend}, {accelerator.distributed_type})", flush=True)
        print(f"accelerate_train: losses {losses!r}", flush=True)
        print(f"accelerate_train: gather/reduce exact: {exact}", flush=True)
        print(f"accelerate_train: replicas bitwise identical: {identical}", flush=True)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if identical and exact else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=("kwargs", "pre-initialised"), default="kwargs")
    parser.add_argument("--backend", choices=("ddl", "gloo"), default="ddl")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    return train(args.way, args.backend, args.steps)


if __name__ == "__main__":
    sys.exit(main())
