"""Elastic data-parallel training: lose a host, keep training; start one again, and it joins.

    export DDL_JOB_SECRET=...   # the same for every process of the job: only its holders may join later
    torchrun --nproc-per-node 3 examples/elastic_train.py                       # one host, three ranks
    torchrun --nnodes 2 --nproc-per-node 2 ... examples/elastic_train.py        # one per host (c10d or static)
    RANK=0 WORLD_SIZE=3 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train.py   # env://, per process
    DDL_ELASTIC_JOIN=1 MASTER_ADDR=h1 MASTER_PORT=29500 python examples/elastic_train.py    # a host joining later

The digits CNN of examples/train_cnn.py, trained for ``--steps`` steps of one global batch
(``--global-batch`` rows, split evenly over however many ranks are alive, so every world computes
the same mean gradient), a commit after every step; rank 0 prints a progress line every
``--log-every`` steps (20). Kill a host (or a rank) mid-run: the survivors roll back the step in
flight, re-form the world and go on; the last line says how many world changes there were, the
test accuracy, and whether every rank ends bitwise identical (exit status 0 only then). ``--record FILE`` appends one JSON line per step and rank (the
parameters' hash, the loss, the world) for fault drills to compare.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_cnn import accuracy, build_model, load_data  # noqa: E402 - the same data and model

import ddl_triton  # noqa: E402
from ddl_triton.torch import elastic, hooks  # noqa: E402


def params_hash(model: torch.nn.Module) -> str:
    """A digest of every parameter's bytes: equal digests mean bitwise-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_hash(opt: torch.optim.Optimizer) -> str:
    """A digest of the optimizer's state tensors (momentum buffers), in parameter order."""
    h = hashlib.sha256()
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    h.update(key.encode() + value.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def residuals_hash(model) -> str | None:
    """A digest of this rank's error-feedback residuals (the int8 hook's), None without a hook."""
    states = [s for _, s in getattr(model, "_comm_hooks", [])]
    if not states:
        return None
    h = hashlib.sha256()
    for key, (kind, worker, server) in sorted(states[0].residuals_snapshot().items()):
        h.update(f"{key}:{kind}".encode() + worker.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def batch_rows(step: int, n_train: int, global_batch: int, seed: int = 1) -> torch.Tensor:
    """The rows of global batch ``step``: a fresh permutation per epoch, the same on every rank and
    in every world, so a redone step sees the same data."""
    per_epoch = n_train // global_batch
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed + step // per_epoch))
    at = (step % per_epoch) * global_batch
    return perm[at: at + global_batch]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=120, help="rows per step, split over the ranks "
                        "(120 divides evenly for 1 to 6 ranks)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compression", choices=("none", "int8"), default="none",
                        help="int8: the int8 comm hook, with error feedback")
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--record", default="", help="append a JSON line per step and rank to this file")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="sleep this long in each step's backward (lets a drill strike mid-step)")
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints a progress line every this "
                        "many steps (0: none)")
    args = parser.parse_args(argv)

    elastic.init_process_group("ddl")
    x_train, y_train, x_test, y_test = load_data()
    net = build_model(seed=0)
    if args.step_seconds:
        net[0].weight.register_hook(lambda grad: time.sleep(args.step_seconds))  # the last gradient of backward
    model = DDP(net)
    if args.compression == "int8":
        model.register_comm_hook(hooks.HookState(), hooks.int8_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = elastic.TorchState(model, opt, step=0)
    record = open(args.record, "a") if args.record else None
    if record is not None:  # the state every rank holds once a world change is done: must be identical
        state.register_reset_callbacks([lambda: record.write(json.dumps(
            {"reset": True, "step": state.step, "rank": elastic.rank(), "size": elastic.size(), "generation":
             elastic.generation(), "hash": params_hash(net), "optimizer": optimizer_hash(opt),
             "residuals": residuals_hash(model), "pid": os.getpid()}) + "\n")])

    @elastic.run(min_size=args.min_size)
    def train(state):
        while state.step < args.steps:
            rank, size = elastic.rank(), elastic.size()
            if args.global_batch % size:
                raise ValueError(f"--global-batch {args.global_batch} does not split evenly over {size} ranks")
            per = args.global_batch // size
            rows = batch_rows(state.step, len(y_train), args.global_batch)[rank * per: (rank + 1) * per]
            loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            state.commit()
            if rank == 0 and args.log_every and (state.step % args.log_every == 0 or state.step == args.steps):
                print(f"step {state.step}/{args.steps}: loss {loss.item():.4f}, world {size}, "
                      f"{len(elastic.recoveries())} world change(s)", flush=True)
            if record is not None:
                record.write(json.dumps({"step": state.step, "rank": rank, "size": size, "generation":
                                         elastic.generation(), "hash": params_hash(net), "loss": loss.item(),
                                         "residuals": residuals_hash(model),
                                         "t": time.time(), "pid": os.getpid()}) + "\n")
                record.flush()

    train(state)
    digest = torch.tensor([int(params_hash(net), 16) & ((1 << 62) - 1)], dtype=torch.int64)
    comm = ddl_triton.init()
    digests = torch.zeros(comm.size, dtype=torch.int64)
    comm.all_gather(digests, digest)
    identical = bool((digests == digests[0]).all())
    acc = accuracy(net, x_test, y_test)
    if comm.rank == 0:
        print(f"elastic_train: {args.steps} steps, world {comm.size} at the end, {len(elastic.recoveries())} world "
              f"change(s), test accuracy {acc:.4f}, replicas bitwise identical: {identical}", flush=True)
    if record is not None:
        record.write(json.dumps({"final": True, "rank": comm.rank, "accuracy": acc, "identical": identical,
                                 "recoveries": elastic.recoveries(), "pid": os.getpid(), "t": time.time()}) + "\n")
        record.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
