"""PyTorch Lightning on the "ddl" backend, on the CPU; exits 0 only if the replicas end bitwise identical.

    torchrun --nproc-per-node 2 examples/lightning_train.py                       # DDPStrategy(process_group_backend="ddl")
    torchrun --nproc-per-node 2 examples/lightning_train.py --hook int8           # with one of our DDP comm hooks
    torchrun --nproc-per-node 2 examples/lightning_train.py --backend gloo        # the same on gloo

Without ``--hook`` the strategy is Lightning's own ``DDPStrategy(process_group_backend=...)``.
With ``--hook`` it is ``ddl_triton.torch.lightning.DDLStrategy``, the same strategy whose
``ddp_comm_hook`` also applies on the CPU; ``--strategy lightning`` keeps Lightning's, whose
hook is skipped on the CPU (lightning/pytorch/strategies/ddp.py:224; the run prints 0 hook calls).

Each rank trains a small MLP on its shard (Lightning's DistributedSampler) of integer-valued
data for ``--steps`` steps, then every rank compares its parameter bytes with rank 0's. Rank 0
prints the summed losses in full precision, so runs on "ddl" and on gloo can be compared exactly.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

HOOKS = ("allreduce", "fp16", "bf16", "int8", "onebit", "auto")


def _module(steps: int):
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        """y = sum(x) from integer x in [-3, 3], by a 12-24-1 MLP; keeps every step's loss and DDP's backend."""

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 1))
            self.losses: list[torch.Tensor] = []

        def on_train_start(self):  # the DDP wrapper exists now: where its gradients go
            self.ddp_backend = dist.get_backend(self.trainer.strategy.model.process_group)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1 / 64)

    x = torch.randint(-3, 4, (32 * steps, 12), generator=torch.Generator().manual_seed(7)).float()
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return Regression(), torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)


def _strategy(backend: str, hook: str | None, strategy: str, ddp_kwargs: dict):
    if backend == "ddl":
        import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")
    from lightning.pytorch.strategies import DDPStrategy

    if hook is None:
        return DDPStrategy(process_group_backend=backend, **ddp_kwargs), None
    from ddl_triton.torch import hooks
    from ddl_triton.torch.lightning import DDLStrategy

    state = hooks.HookState()  # the hooks' communicator: ddl_triton.init(), the world
    fn = getattr(hooks, f"{hook}_hook" if hook == "allreduce" else f"{hook}_compress_hook")
    cls = DDLStrategy if strategy == "ddl" else DDPStrategy
    return cls(process_group_backend=backend, ddp_comm_state=state, ddp_comm_hook=fn, **ddp_kwargs), state


def fit(backend: str, hook: str | None, strategy: str, steps: int, ddp_group=None) -> bool:
    """One ``Trainer.fit`` on every rank under torchrun; True if the replicas end bitwise identical.

    The first fit of a process initialises the group (Lightning's DDPStrategy does, on ``backend``);
    a later one reuses it, as Lightning does whenever a group already exists. ``ddp_group``: a
    process group for DDP's gradients instead of the default one (DDPStrategy passes it to DDP)."""
    import lightning.pytorch as pl

    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(1234 + rank)  # every rank starts different: DDP's broadcast must align them
    module, loader = _module(steps)
    strat, state = _strategy(backend, hook, strategy, {} if ddp_group is None else {"process_group": ddp_group})
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                         strategy=strat, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    size = dist.get_world_size()
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).view(torch.int32)  # the bytes
    replicas = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r, replicas[0]) for r in replicas)
    if rank == 0:
        calls = "" if state is None else f", hook {hook} calls on rank 0: {state.calls}"
        print(f"lightning_train: {size} ranks, {steps} steps, backend {module.ddp_backend}, "
              f"{type(strat).__name__}{calls}", flush=True)
        print(f"lightning_train: losses {losses.tolist()!r}", flush=True)
        print(f"lightning_train: replicas bitwise identical: {identical}", flush=True)
    return identical


def train(backend: str, hook: str | None, strategy: str, steps: int) -> int:
    """One fit, then the group destroyed; returns the exit status."""
    identical = fit(backend, hook, strategy, steps)
    dist.destroy_process_group()
    return 0 if identical else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("ddl", "gloo"), default="ddl")
    parser.add_argument("--hook", choices=HOOKS, default=None, help="register this ddl_triton.torch.hooks hook")
    parser.add_argument("--strategy", choices=("ddl", "lightning"), default="ddl",
                        help="with --hook: DDLStrategy (hook on every device) or Lightning's DDPStrategy (CUDA only)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    return train(args.backend, args.hook, args.strategy, args.steps)


if __name__ == "__main__":
    sys.exit(main())
