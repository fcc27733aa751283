"""Outer-sync training (DiLoCo) of the digits CNN: each rank trains on its own data, and every
``--sync-every`` steps the ranks average their parameter change and an outer optimizer applies it.

    ddlrun -n 2 -- python examples/diloco_train.py
    ddlrun -n 2 -- python examples/diloco_train.py --sync-every 16 --fragments 2 --delay 1 --compression int8
    ddlrun -n 4 --topology 2x2 -- python examples/diloco_train.py --replicas hosts   # DDP inside each host
    torchrun --nproc-per-node 3 examples/diloco_train.py --elastic                 # lose a rank, keep going

The model and data are examples/train_cnn.py's; the inner optimizer is SGD with momentum on this
rank's slice of each global batch (``--global-batch`` rows split over the replicas), the outer one
DiLoCo's SGD (lr 0.7, momentum 0.9, Nesterov). ``--replicas hosts`` makes the ranks of a host one
replica: DDP over ``ddl_triton.torch.host_group()`` reduces their gradients every step, and only
the outer sync crosses hosts. Rank 0 prints a line at every outer step of the last fragment
(``--log-every``: every that many of them), and at the end the test accuracy and whether every
rank holds bitwise the same global parameters (the backups); exit status 0 only then.

``--elastic`` runs under ``ddl_triton.torch.elastic`` (torchrun or env://): the DiLoCo's backups, step
and outer optimizer are part of the ``TorchState``, committed after every inner step, so a rank
lost during an outer step makes the survivors undo that step and redo it on the new world.
``--record FILE`` appends a JSON line per outer step and rank (the global parameters' hash) for
drills to compare; ``--die-at-outer K`` (a drill's: rank 2 of the first world kills itself in its
K-th outer step, after its inner step and before it joins the fragment's average, which the other
ranks have begun) strikes exactly mid-outer-step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_cnn import accuracy, build_model, load_data  # noqa: E402 - the same data and model

import ddl_triton  # noqa: E402
import ddl_triton.torch as ddt  # noqa: E402


def digest(tensors) -> str:
    """A digest of the tensors' bytes: equal digests mean bitwise-identical replicas."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def identical_everywhere(comm, text: str) -> bool:
    """Whether every rank of ``comm`` holds the same 16-hex-digit digest ``text``."""
    mine = torch.tensor([int(text, 16) & ((1 << 62) - 1)], dtype=torch.int64)
    every = torch.zeros(comm.size, dtype=torch.int64)
    comm.all_gather(every, mine)
    return bool((every == every[0]).all())


def _outer_state(opt: torch.optim.Optimizer) -> list:
    """The outer optimizer's state tensors (momentum), in parameter order."""
    return [v for g in opt.param_groups for p in g["params"] for _, v in sorted(opt.state.get(p, {}).items())
            if isinstance(v, torch.Tensor)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=192, help="inner steps")
    parser.add_argument("--sync-every", type=int, default=16, help="inner steps between syncs of a fragment (H)")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0, help="fragment_sync_delay (Streaming DiLoCo's tau)")
    parser.add_argument("--compression", default=None, help="a method of ddl_triton/compression_methods.py "
                        "for the pseudo-gradients (default: full precision)")
    parser.add_argument("--replicas", choices=("ranks", "hosts"), default="ranks")
    parser.add_argument("--global-batch", type=int, default=96, help="rows per step, split over the replicas")
    parser.add_argument("--lr", type=float, default=0.02, help="the inner SGD's learning rate")
    parser.add_argument("--log-every", type=int, default=1, help="print every this many outer rounds (0: none)")
    parser.add_argument("--elastic", action="store_true", help="run under ddl_triton.torch.elastic")
    parser.add_argument("--record", default="", help="append a JSON line per outer step and rank to this file")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="(drills) sleep this long in each step")
    parser.add_argument("--die-at-outer", type=int, default=0, help="(drills) rank 2 of the first world dies "
                        "in its K-th outer step")
    args = parser.parse_args(argv)

    if args.elastic:
        from ddl_triton.torch import elastic
        elastic.init_process_group("ddl")
    else:
        ddt.init_process_group()
    comm = ddl_triton.init()
    x_train, y_train, x_test, y_test = load_data()
    net = build_model(seed=0)
    model = net
    if args.replicas == "hosts":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, process_group=ddt.host_group(comm))
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = ddt.DiLoCo(model, inner, outer, sync_every=args.sync_every, fragments=args.fragments,
                        fragment_sync_delay=args.delay, compression=args.compression, replicas=args.replicas,
                        init_sync=not args.elastic)  # elastic: the state's first sync starts every rank alike
    record = open(args.record, "a") if args.record else None
    outer_steps = [0]
    if args.die_at_outer and args.elastic:
        def die(_optimizer, _args, _kwargs):  # runs before DiLoCo's hook (registered first): the inner step is
            if diloco.core.schedule.starts_at(diloco.step + 1) is None:  # taken, the fragment's average not begun
                return
            outer_steps[0] += 1
            if outer_steps[0] == args.die_at_outer and elastic.generation() == 0 and comm.rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # this very process: provably ours
        inner.register_step_post_hook(die)

    def train(state=None):
        with diloco:
            while diloco.step < args.steps:
                world = ddl_triton.init()
                replicas = world.size if args.replicas == "ranks" else len(ddt.hosts.host_ranks(world))
                replica = world.rank if args.replicas == "ranks" else \
                    [i for i, rs in enumerate(ddt.hosts.host_ranks(world)) if world.rank in rs][0]
                per = args.global_batch // replicas
                g = torch.Generator().manual_seed(1000 + diloco.step)
                rows = torch.randperm(len(y_train), generator=g)[:args.global_batch][replica * per: (replica + 1) * per]
                loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
                if args.step_seconds:
                    time.sleep(args.step_seconds)
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's hook counts it, and syncs a fragment when one is due
                if state is not None:
                    state.batch += 1  # the state's own count of inner steps: a restore must agree with DiLoCo's
                    state.commit()
                f = diloco.core.schedule.syncs_at(diloco.step)
                if f is None:
                    continue
                text = digest(diloco.core.backups)
                if record is not None:
                    record.write(json.dumps({"step": diloco.step, "rank": world.rank, "size": world.size,
                                             "generation": elastic.generation() if args.elastic else 0,
                                             "hash": text, "t": time.time(), "pid": os.getpid()}) + "\n")
                    record.flush()
                rounds = diloco.step // args.sync_every
                if world.rank == 0 and f == args.fragments - 1 and args.log_every and rounds % args.log_every == 0:
                    print(f"step {diloco.step}/{args.steps}: outer round {rounds}, loss {loss.item():.4f}, "
                          f"world {world.size}", flush=True)

    if args.elastic:
        state = elastic.TorchState(model, inner, diloco=diloco, batch=0)
        if record is not None:  # the state every rank holds once a world change is done: must be identical
            state.register_reset_callbacks([lambda: record.write(json.dumps(
                {"reset": True, "step": diloco.step, "batch": state.batch, "rank": elastic.rank(),
                 "size": elastic.size(),
                 "generation": elastic.generation(), "hash": digest(diloco.core.backups),
                 "params": digest(net.parameters()), "outer": digest(_outer_state(outer)),
                 "pid": os.getpid()}) + "\n")])
        elastic.run(train)(state)
    else:
        train()
    comm = ddl_triton.init()
    identical = identical_everywhere(comm, digest(diloco.core.backups))
    acc = accuracy(net, x_test, y_test)
    if comm.rank == 0:
        print(f"diloco_train: {diloco.step} inner steps, sync_every {args.sync_every}, fragments {args.fragments}, "
              f"world {comm.size}, test accuracy {acc:.4f}, global parameters bitwise identical: {identical}",
              flush=True)
    if record is not None:
        record.write(json.dumps({"final": True, "rank": comm.rank, "accuracy": acc, "identical": identical,
                                 "pid": os.getpid(), "t": time.time()}) + "\n")
        record.close()
    diloco.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
